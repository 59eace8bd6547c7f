"""``Fabric(strategy="elixir")`` under a budget where it offloads vs Fabric's own FSDP with CPU offload: wall step
time, 2 gloo processes.

The bar users hold a Fabric strategy to (issue 59) is Fabric's ``FSDPStrategy(cpu_offload=True)``. Fabric refuses it
off a GPU ("FSDP is only available on GPU"), and torch's FSDP under it needs an accelerator, so on a CPU-only machine
the peer is Fabric's other FSDP, the one Lightning recommends for new code: ``ModelParallelStrategy`` with a
``parallelize_fn`` that applies FSDP2 ``fully_shard`` to every decoder layer and then the root, each with
``CPUOffloadPolicy`` (parameters, gradients and optimizer state on the host, the step there) - at its strongest:
the same layer-wise wrapping torch's and Lightning's examples use, every parameter offloaded, nothing recomputed.
With 2 or more CUDA devices the peer is ``FSDPStrategy(cpu_offload=True)`` itself, wrapped per decoder layer. The
result records which peer ran (``peer``).

One model nobody here wrote, the same for both: a Hugging Face ``LlamaForCausalLM`` built ``from_config`` (4 layers,
hidden 256, GQA 8/2 heads, vocabulary 4096), AdamW fp32, batches of 8 x 128 tokens per rank, the loop a litgpt-style
Fabric loop (forward, ``fabric.backward``, ``optimizer.step``). Elixir gets ``memory_budget`` =
:func:`tightfit.planner.elixir.mixed_budget` of this model: the budget where the plan shards and offloads some units
(the plan is recorded). Every repeat is a fresh Fabric and model of ``steps`` steps on batches drawn for that
round; its step time is the mean interval between step starts after the first two (warm-up), on rank 0. Rounds run
both contenders after a warm-up round (Elixir's calibration runs, and is cached, there), in an order that reverses
every round; the ratio is paired (:func:`benchmarks.common.paired`: the median of per-round ratios, rounds won,
range).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.common import format_paired, paired, parser, run_two_ranks, summarize, write_result

NAME = "elixir_fabric"
CONTENDERS = ("peer", "elixir")
# (vocabulary, hidden, layers, batch, sequence); tests shrink it.
SIZE = {"vocab": 4096, "hidden": 256, "layers": 4, "batch": 8, "seq": 128}


def build_model(size: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["hidden"] * 11 // 4,
                      num_hidden_layers=size["layers"], num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=size["seq"] + 1)
    return LlamaForCausalLM(cfg)


def _offload_every_layer(model, mesh):
    """The CPU peer's ``parallelize_fn``: FSDP2 per decoder layer, then the root, all with CPU offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dp = mesh["data_parallel"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, mesh=dp, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model


def peer_strategy():
    """Fabric's FSDP with CPU offload: ``FSDPStrategy(cpu_offload=True)`` with 2+ GPUs, else FSDP2 through
    ``ModelParallelStrategy`` (see the module docstring); returns (strategy, accelerator, description)."""
    import torch

    if torch.cuda.device_count() >= 2:
        from lightning.fabric.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return (FSDPStrategy(cpu_offload=True, auto_wrap_policy={LlamaDecoderLayer}), "cuda",
                "FSDPStrategy(cpu_offload=True), wrapped per LlamaDecoderLayer")
    from lightning.fabric.strategies import ModelParallelStrategy

    return (ModelParallelStrategy(parallelize_fn=_offload_every_layer, data_parallel_size=2, tensor_parallel_size=1),
            "cpu", "ModelParallelStrategy + fully_shard(CPUOffloadPolicy) per LlamaDecoderLayer and the root")


def elixir_budget(size: dict, device) -> int:
    """The budget where Elixir's plan for this model shards and offloads on ``device`` (a ``DeviceProfile``)."""
    import torch

    from lightning_elixir.planning import FORWARD, profile_module
    from tightfit.planner.elixir import mixed_budget
    from tightfit.profiler.types import ClusterSpec

    with torch.device("meta"):
        model = build_model(size)
    profile = profile_module(model, torch.zeros(size["batch"], size["seq"], dtype=torch.long), stage_method=FORWARD)
    return mixed_budget(profile, ClusterSpec.uniform(device, 2), precision="32-true")


def fit(name: str, seed: int, steps: int, size: dict, budget: int, device=None) -> tuple[float, dict | None]:
    """One fresh Fabric loop; (mean step seconds after two warm-up steps, Elixir's plan or None). ``device``: the
    ``DeviceProfile`` Elixir plans for (``None``: this machine's, measured and cached)."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_elixir import ElixirFabricStrategy

    example = torch.zeros(size["batch"], size["seq"], dtype=torch.long)
    if name == "elixir":
        strategy, accelerator = ElixirFabricStrategy(memory_budget=budget, example_input=example, verbose=False,
                                                     device_profile=device, calibrate=device is None), None
    else:
        strategy, accelerator, _ = peer_strategy()
    fabric = L.Fabric(accelerator=accelerator or ("cuda" if torch.cuda.device_count() >= 2 else "cpu"), devices=2,
                      strategy=strategy)
    fabric.launch()
    fabric.seed_everything(seed, verbose=False)
    model = fabric.setup_module(build_model(size))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(seed * 2 + fabric.global_rank)
    data = torch.randint(0, size["vocab"], (steps, size["batch"], size["seq"] + 1), generator=g)
    starts = []
    for step in range(steps):
        starts.append(time.perf_counter())
        x, y = data[step, :, :-1].to(fabric.device), data[step, :, 1:].to(fabric.device)
        logits = model(x).logits
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    fabric.barrier()
    starts.append(time.perf_counter())
    plan = None
    if name == "elixir":
        p = strategy.plan
        plan = {"units": [{"blocks": len(u.blocks), "mode": u.mode, "offload": u.offload} for u in p.units],
                "runtime": strategy.runtime, "cost_model": p.cost_model, "predicted_step_s": p.step_time_s}
    return (starts[-1] - starts[2]) / (len(starts) - 3), plan


def measure(rank: int, repeats: int, steps: int, size: dict, device=None) -> dict:
    """The interleaved rounds (collective: every rank runs them); what rank 0 records."""
    if device is None:
        from tightfit.profiler import profile_device

        device = profile_device()
    budget = elixir_budget(size, device)
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    plan = None
    for r in range(repeats + 1):  # round 0: warm-up (Elixir calibrates and caches there)
        for name in (CONTENDERS if r % 2 else CONTENDERS[::-1]):  # A B, B A, ...: drift cancels
            step_s, got = fit(name, 1000 * r + 17, steps, size, budget, device)
            plan = got or plan
            if r:
                times[name].append(step_s)
        if rank == 0 and r:
            print(f"  repeat {r}/{repeats}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in CONTENDERS),
                  flush=True)
    return {"times": times, "plan": plan, "budget": budget, "steps": steps, "peer": peer_strategy()[2], "size": size}


def _rank(rank: int, world: int, port: int, quick: bool, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", NODE_RANK="0",
                      PYTHONWARNINGS="ignore")
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    data = measure(rank, repeats, 6 if quick else 10, SIZE)
    if rank == 0:
        Path(out).write_text(json.dumps(data))


def results_of(data: dict) -> dict:
    """The result JSON's ``results``: each contender's repeats, Elixir's steps/s over the peer's, paired."""
    t = data["times"]
    return {**{n: {**summarize(t[n]), "repeats": t[n]} for n in CONTENDERS},
            "elixir_over_peer": paired([1 / s for s in t["elixir"]], [1 / s for s in t["peer"]]),
            "plan": data["plan"], "budget_bytes": data["budget"], "peer_strategy": data["peer"]}


def markdown(data: dict, repeats: int) -> str:
    r = results_of(data)

    def cell(t: list[float]) -> str:
        return f"{statistics.median(t) * 1e3:.0f} ({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f})"

    units = data["plan"]["units"]
    plan = (f"{sum(u['offload'] for u in units)} of {len(units)} units offloaded, "
            f"{sum(u['mode'] != 'replicate' for u in units)} sharded; {data['plan']['runtime']}")
    return "\n".join([
        f"`Fabric(strategy=ElixirFabricStrategy(memory_budget={data['budget'] / 2**20:.0f} MiB))` vs Fabric's FSDP with "
        f"CPU offload ({data['peer']}), 2 gloo processes, LLaMA {data['size']['layers']} x {data['size']['hidden']}, "
        f"AdamW fp32, batch {data['size']['batch']} x {data['size']['seq']}. Wall step time in ms: median of {repeats} "
        f"interleaved repeats (min-max), each a fresh Fabric of {data['steps']} steps timed after two; the ratio is "
        "Elixir's steps/s over the peer's, paired (median of per-round ratios, rounds won, range).", "",
        "| peer ms | Elixir ms | Elixir / peer (steps/s) | Elixir's plan |", "|---|---|---|---|",
        f"| {cell(data['times']['peer'])} | {cell(data['times']['elixir'])} | "
        f"**{format_paired(r['elixir_over_peer'])}** | {plan} |"])


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 7)
    data = run_two_ranks(_rank, args.quick, repeats)
    text = markdown(data, repeats)
    print(text)
    write_result(NAME, title="Elixir under Fabric vs Fabric's FSDP with CPU offload (2 processes)",
                 params={"quick": args.quick, "repeats": repeats, "steps": data["steps"], **data["size"]},
                 results=results_of(data), markdown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
