"""``Trainer(strategy="elixir")`` with memory to spare vs ``Trainer(strategy="ddp")``: wall step time, 2 CPU processes.

The promise: when replicating fits the budget, Elixir is never slower than DDP (within 5%). Two models
nobody here wrote, each in a plain LightningModule with AdamW in fp32, default strategy options:

- ``llama``: a Hugging Face ``LlamaForCausalLM`` built ``from_config`` (4 layers, hidden 256, GQA: 8 query heads,
  2 key/value heads, vocabulary 4096), batches of 8 x 128 tokens;
- ``transformer``: Lightning's demo ``Transformer`` (``lightning.pytorch.demos``; 6 layers, hidden 192, 4 heads,
  feed-forward 768, vocabulary 4096), batches of 8 x 128 tokens.

Two gloo ranks, all cores (torch threads = cores / 2). Every repeat is a fresh ``Trainer.fit`` of ``steps`` steps
on batches drawn for that repeat (new data each time); its wall step time is the mean interval between the starts
of the steps after the first two (warm-up: lazy init, first allocations), on rank 0, with rank 0's process CPU time
per step beside it (a diagnostic: on a loaded host the wall time of one fit swings by 10-30%, the CPU time a step
spends much less). Rounds run every contender after a warm-up round (Elixir's calibration runs, and is cached,
there), in an order that reverses every round (A B C, C B A, ...), so drift on the host does not favour whoever runs
first. Every contender of a round trains on the same batches (one seed per round), so the rounds pair up. Reported:
the median of the repeats beside min/max, each ratio to DDP paired (:func:`benchmarks.common.paired`: the median of
the per-round ratios, the rounds Elixir was faster, the range), and the plan Elixir chose (unit modes, offload, recomputation, how it searched and which cost model priced
it) and how the runtime applied it (``DDP``: torch's composable ``replicate``; ``FSDP2``).

Per step, an all-replicate Elixir run does what ``strategy="ddp"`` does: the same ``DistributedDataParallel``
reducer with torch's defaults (25 MiB buckets, 1 MiB first bucket, ``gradient_as_bucket_view=False``, no static
graph, no unused-parameter search, buffers broadcast each forward), the user's optimizer unchanged but for a step
pre/post hook that regroups parameters by placement (one group here), Lightning's own precision plugin, and a
prediction monitor that reads ``perf_counter`` at the first steps' starts. What only Elixir pays is at fit start:
planning, and on the first run the calibration (``first_fit_s``; cached after).

A third contender, ``elixir on FSDP2``, runs the same default strategy with the all-replicate plan applied by
``fully_shard`` on a ``(world, 1)`` mesh instead of ``lightning_elixir.replicate``: what applying an all-replicate
plan with DDP semantics saves, measured in the same interleaved rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import format_paired, paired, parser, run_two_ranks, summarize, write_result

NAME = "elixir_vs_ddp"
VOCAB, BATCH, SEQ = 4096, 8, 128
MODELS = ("llama", "transformer")
CONTENDERS = ("ddp", "elixir", "elixir_fsdp2")


def _modules():
    import lightning as L
    import torch
    import torch.nn.functional as F

    class Data(L.LightningModule):
        """Shared: random token batches for this repeat, AdamW, a step-start clock."""

        def __init__(self, seed: int, batches: int) -> None:
            super().__init__()
            self.seed, self.batches, self.starts, self.cpu_clock = seed, batches, [], []

        def train_dataloader(self):
            g = torch.Generator().manual_seed(self.seed)
            data = torch.randint(0, VOCAB, (self.batches * BATCH, SEQ + 1), generator=g)
            return torch.utils.data.DataLoader(data, batch_size=BATCH)

        def on_train_batch_start(self, batch, batch_idx):
            self.starts.append(time.perf_counter())
            self.cpu_clock.append(time.process_time())

        def on_train_end(self):
            self.starts.append(time.perf_counter())
            self.cpu_clock.append(time.process_time())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Llama(Data):
        def __init__(self, seed: int, batches: int) -> None:
            from transformers import LlamaConfig, LlamaForCausalLM

            super().__init__(seed, batches)
            cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQ + 1)
            self.model = LlamaForCausalLM(cfg)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss

    class DemoTransformer(Data):
        def __init__(self, seed: int, batches: int) -> None:
            from lightning.pytorch.demos import Transformer

            super().__init__(seed, batches)
            self.model = Transformer(vocab_size=VOCAB, ninp=192, nhead=4, nhid=768, nlayers=6)

        def training_step(self, batch, batch_idx):
            x, y = batch[:, :-1], batch[:, 1:]
            out = self.model(x, y)
            return F.nll_loss(out, y.reshape(-1))

    return {"llama": Llama, "transformer": DemoTransformer}


def _plan_info(strategy) -> dict:
    plan = strategy.plan
    return {"units": [{"blocks": len(u.blocks), "mode": u.mode, "offload": u.offload,
                       "checkpoint": len(u.checkpoint)} for u in plan.units],
            "search_method": plan.search_method, "cost_model": plan.cost_model,
            "predicted_step_s": plan.step_time_s, "runtime": getattr(strategy, "runtime", "FSDP2")}


def _fit(model_cls, name: str, seed: int, steps: int, root: Path) -> tuple[float, float, dict | None]:
    import lightning as L

    import lightning_elixir.strategy as elixir_strategy
    from lightning_elixir import ElixirStrategy
    from lightning_elixir.replicate import replicates_everything

    L.seed_everything(seed, verbose=False)
    module = model_cls(seed, steps)
    strategy = "ddp" if name == "ddp" else ElixirStrategy(verbose=False)
    # "elixir_fsdp2": the same search's plan, applied on FSDP2 even when it replicates everything.
    elixir_strategy.replicates_everything = (lambda plan: False) if name == "elixir_fsdp2" else replicates_everything
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=str(root))
    trainer.fit(module)
    s, c = module.starts, module.cpu_clock
    step_s = (s[-1] - s[2]) / (len(s) - 3)
    cpu_s = (c[-1] - c[2]) / (len(c) - 3)
    return step_s, cpu_s, (_plan_info(strategy) if name != "ddp" else None)


def _rank(rank: int, world: int, port: int, quick: bool, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", NODE_RANK="0",
                      PYTHONWARNINGS="ignore")
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    threads = max(1, (os.cpu_count() or 2) // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    classes = _modules()
    steps = 8 if quick else 10
    root = Path(tempfile.mkdtemp(prefix=f"{NAME}-{rank}-"))
    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in CONTENDERS} for m in MODELS}
    cpu: dict[str, dict[str, list[float]]] = {m: {n: [] for n in CONTENDERS} for m in MODELS}
    plans: dict[str, dict] = {}
    setup_s: dict[str, dict[str, float]] = {m: {} for m in MODELS}
    for model in MODELS:
        for r in range(repeats + 1):  # round 0: warm-up (Elixir calibrates and caches there)
            for name in (CONTENDERS if r % 2 else CONTENDERS[::-1]):  # A B C, C B A, ...: drift cancels
                start = time.perf_counter()
                step_s, cpu_s, plan = _fit(classes[model], name, 1000 * r + 17, steps, root)
                if r == 0:
                    setup_s[model][name] = time.perf_counter() - start
                    continue
                times[model][name].append(step_s)
                cpu[model][name].append(cpu_s)
                if plan is not None:
                    plans[f"{model}/{name}"] = plan
            if rank == 0 and r:
                print(f"  {model} repeat {r}/{repeats}: " + ", ".join(
                    f"{n} {times[model][n][-1] * 1e3:.0f} ms" for n in CONTENDERS), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "cpu": cpu, "plans": plans, "first_fit_s": setup_s,
                                         "threads": threads, "steps": steps}))
    dist.barrier()
    dist.destroy_process_group()


def _plan_text(plan: dict) -> str:
    modes: dict[str, int] = {}
    for u in plan["units"]:
        modes[u["mode"]] = modes.get(u["mode"], 0) + 1
    off = sum(u["offload"] for u in plan["units"])
    ckpt = sum(u["checkpoint"] for u in plan["units"])
    return (f"{', '.join(f'{n} {m}' for m, n in modes.items())}; {off} offloaded, {ckpt} blocks recomputed; "
            f"{plan['search_method']}, {plan['cost_model']}; applied with {plan['runtime']}")


def over_ddp(data: dict, model: str, name: str, key: str = "times") -> dict[str, object]:
    """Contender ``name``'s step time over DDP's, paired round by round (lower is better)."""
    return paired(data[key][model][name], data[key][model]["ddp"], higher_is_better=False)


def markdown(data: dict, repeats: int) -> str:
    def cell(t: list[float]) -> str:
        return f"{statistics.median(t) * 1e3:.0f} ({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f})"

    rows = []
    for model in MODELS:
        t = data["times"][model]
        first = data["first_fit_s"][model]
        rows.append(f"| {model} | {cell(t['ddp'])} | {cell(t['elixir_fsdp2'])} | "
                    f"{format_paired(over_ddp(data, model, 'elixir_fsdp2'), 3)} | {cell(t['elixir'])} | "
                    f"**{format_paired(over_ddp(data, model, 'elixir'), 3)}** | "
                    f"{format_paired(over_ddp(data, model, 'elixir', 'cpu'), 3)} | "
                    f"{first['elixir']:.1f} / {first['ddp']:.1f} | {_plan_text(data['plans'][f'{model}/elixir'])} |")
    return "\n".join([
        f"`Trainer(strategy=\"elixir\")` (default options, whole device) vs `Trainer(strategy=\"ddp\")`, 2 gloo "
        f"processes x {data['threads']} threads, AdamW fp32, batch {BATCH} x {SEQ}. Wall step time in ms: median of "
        f"{repeats} interleaved repeats (min-max), each a fresh fit of {data['steps']} steps on fresh batches, "
        "timed after its first two steps. Target: Elixir / DDP <= 1.05 (the paired median). *Elixir on FSDP2*: "
        "the same plan applied by `fully_shard` on a (world, 1) mesh; *Elixir*: an all-replicate plan applied with "
        "DDP semantics (composable `replicate`). Ratios to DDP are paired: the median of the per-round ratios "
        "(lower is faster), the rounds won, the range; *CPU*: the same for rank 0's process CPU time per step "
        "(diagnostic). *First fit*: the warm-up round's whole `fit`, Elixir's including its calibration (cached "
        "after; the later rounds plan from the cache).", "",
        "| model | DDP ms | Elixir on FSDP2 ms | on FSDP2 / DDP | Elixir ms | Elixir / DDP | CPU Elixir / DDP | "
        "first fit s Elixir / DDP | Elixir's plan |",
        "|---|---|---|---|---|---|---|---|---|", *rows])


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 7)
    data = run_two_ranks(_rank, args.quick, repeats)
    results = {model: {name: {**summarize(data["times"][model][name]), "repeats": data["times"][model][name],
                              "cpu_s": data["cpu"][model][name]}
                       for name in CONTENDERS} for model in MODELS}
    for model in MODELS:
        for name in ("elixir", "elixir_fsdp2"):
            results[model][f"{name}_over_ddp"] = over_ddp(data, model, name)
            results[model][f"{name}_over_ddp_cpu"] = over_ddp(data, model, name, "cpu")
            results[model][f"{name}_plan"] = data["plans"][f"{model}/{name}"]
        results[model]["first_fit_s"] = data["first_fit_s"][model]
    text = markdown(data, repeats)
    print(text)
    write_result(NAME, title="Elixir with memory to spare vs DDP (Trainer, 2 CPU processes)",
                 params={"quick": args.quick, "repeats": repeats, "steps": data["steps"], "threads": data["threads"],
                         "batch": BATCH, "seq": SEQ, "vocab": VOCAB},
                 results=results, markdown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
