"""Fine-tune a Hugging Face causal LM in a litgpt-style Fabric loop with ``Fabric(strategy="elixir")``.

    python examples/lightning_elixir/fabric_finetune.py                         # 2 CPU processes (or every GPU)
    python examples/lightning_elixir/fabric_finetune.py --budget 2MiB           # a budget that shards and offloads
    python examples/lightning_elixir/fabric_finetune.py --steps 6 --resume      # continue from runs/elixir_fabric
    python examples/lightning_elixir/fabric_finetune.py --steps 4               # seconds (the tests)

The model is a small Llama built from its config (random weights: nothing is downloaded) under
``fabric.init_module(empty_init=True)``, so it starts on the meta device. Fabric hands the strategy the model
before any batch, so the strategy gets an example of what the forward takes (``example_input=``): it profiles
one step on the meta device, searches the plan, prints it and only then allocates each unit where the plan puts
it. The loop is the one litgpt's scripts write: ``fabric.backward``, ``fabric.no_backward_sync`` over the
accumulated micro-batches, ``fabric.clip_gradients``, ``fabric.save`` / ``fabric.load``.

Outputs in ``--out`` (default ``runs/elixir_fabric``): ``ckpt`` (a sharded, atomic checkpoint directory, read by
``--resume``), ``plan.json`` and ``summary.json`` (the losses of this run's steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_WHO = "[fabric_finetune]" + ("" if os.environ.get("LOCAL_RANK", "0") == "0" else f" rank {os.environ['LOCAL_RANK']}:")
print(f"{_WHO} importing PyTorch, Lightning and transformers ...", flush=True)
import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import lightning_elixir  # noqa: E402,F401  (registers strategy="elixir" for Trainer and Fabric)
from lightning_elixir import ElixirFabricStrategy  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def batches(seq: int, batch: int, rank: int, world: int):
    """Byte windows of the corpus (a 256-token vocabulary, no tokenizer): the ``i``-th micro-batch of this rank is
    the same in every run, so a resumed run continues with the very batches the uninterrupted one would see."""
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    i = 0
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (world, batch), generator=g)[rank]
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        yield i, window[:, :-1], window[:, 1:]
        i += 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (with --resume: up to this step)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=4, help="micro-batch size per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--budget", default=None, help="per-device memory the plan may use (default: all of it)")
    p.add_argument("--device-profile", default=None,
                   help="plan for this device (a datasheet preset or a profile JSON) instead of measuring this one")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--save-every", type=int, default=2, help="checkpoint every this many steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --out/ckpt")
    p.add_argument("--out", default="runs/elixir_fabric")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    gpu = torch.cuda.is_available()
    strategy = ElixirFabricStrategy(memory_budget=args.budget, verbose=True, device_profile=args.device_profile,
                                    example_input=torch.zeros(args.batch, args.seq, dtype=torch.long))
    fabric = L.Fabric(accelerator="cuda" if gpu else "cpu", devices=-1 if gpu else args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    with fabric.init_module(empty_init=True):  # on meta: the plan allocates each unit where it lives
        model = LlamaForCausalLM(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(out / "ckpt", state)
        fabric.print(f"[fabric_finetune] resumed from {out / 'ckpt'} at step {state['step']}")
    if fabric.global_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        assert strategy.plan is not None
        strategy.plan.to_json(out / "plan.json")
    data = batches(args.seq, args.batch, fabric.global_rank, fabric.world_size)
    start, losses = time.perf_counter(), []
    for _ in range(state["step"] * args.accumulate):
        next(data)  # the micro-batches the checkpointed steps consumed
    while state["step"] < args.steps:
        for micro in range(args.accumulate):
            _, x, y = next(data)
            x, y = fabric.to_device((x, y))
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                logits = model(x).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        fabric.print(f"[fabric_finetune] step {state['step']:4d}  loss {losses[-1]:.4f}")
        if state["step"] % args.save_every == 0 or state["step"] == args.steps:
            fabric.save(out / "ckpt", state)
    strategy.teardown()
    if fabric.global_rank == 0:
        summary = {"steps": state["step"], "losses": losses, "runtime": strategy.runtime,
                   "units": len(strategy.units), "seconds": round(time.perf_counter() - start, 3)}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"\n[fabric_finetune] {len(losses)} steps on {fabric.world_size} x {'GPU' if gpu else 'CPU'} "
              f"({strategy.runtime}, {len(strategy.units)} units)", flush=True)
        print(f"artifacts in {out}/: ckpt (checkpoint, --resume reads it), plan.json, summary.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
