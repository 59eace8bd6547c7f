"""Elixir planner: exact search vs brute force, the sanity laws over random instances, the plan's
JSON / explain / DeepSpeed views, identity checks and the infeasibility error.

Profiles here are synthetic (built in the test) so the laws are checked on many shapes; the
planner is pure, so nothing runs on a device.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from tests.helpers.runif import RunIf
from tightfit.planner.elixir import (
    MODES,
    ElixirConstraints,
    ElixirPlan,
    PlanInfeasibleError,
    PlanMismatchError,
    UnitPlan,
    baseline,
    estimate,
    frontier,
    mixed_budget,
    search,
)
from tightfit.planner.errors import PlanError
from tightfit.profiler.types import BlockProfile, ClusterSpec, DeviceProfile, ModelProfile, ParamInfo

GiB = 2**30


# ---- synthetic profiles ---------------------------------------------------------------------------
def make_profile(blocks: list[dict], *, name: str = "synthetic", batch: int = 4, seq: int = 128,
                 dtype: str = "float32") -> ModelProfile:
    """A ModelProfile from per-block numbers: numel, fwd (FLOPs), saved, ckpt, transient (bytes)."""
    width = 4 if dtype == "float32" else 2
    bps, params = [], []
    for i, b in enumerate(blocks):
        name_i = b.get("name", f"layers.{i}")
        pnames = (f"{name_i}.weight",) if b["numel"] else ()
        if b["numel"]:
            params.append(ParamInfo(name=pnames[0], shape=(b["numel"],), dtype=dtype, numel=b["numel"],
                                    bytes=b["numel"] * width, block=name_i))
        bps.append(BlockProfile(
            name=name_i, type="Block", index=i, params=pnames, param_numel=b["numel"], param_bytes=b["numel"] * width,
            fwd_flops=float(b["fwd"]), bwd_flops=2.0 * b["fwd"], saved_bytes=int(b["saved"]),
            checkpoint_bytes=int(b.get("ckpt", b["saved"] // 8)), transient_bytes=int(b.get("transient", 0)),
            output_bytes=int(b.get("ckpt", b["saved"] // 8)), checkpointable=b.get("checkpointable", True)))
    return ModelProfile(
        model=name, step="train", inputs={"input_ids": [batch, seq]}, params=tuple(params), blocks=tuple(bps),
        forward_order=tuple(p.name for p in params), backward_order=tuple(p.name for p in reversed(params)),
        timeline=(), activation_peak_bytes=sum(b.saved_bytes for b in bps), peak_bytes=0,
        fwd_flops=sum(b.fwd_flops for b in bps), bwd_flops=sum(b.bwd_flops for b in bps), param_dtype=dtype)


def gpt_like(layers: int = 6, hidden: int = 1024, *, batch: int = 4, seq: int = 512, vocab: int = 32000,
             name: str = "gpt-like") -> ModelProfile:
    """GPT-2 shaped blocks (embedding, ``layers`` transformer layers, final norm), fp32 profile."""
    bsh = batch * seq * hidden
    heads = max(1, hidden // 64)
    layer = {"numel": 12 * hidden * hidden + 13 * hidden, "fwd": 24 * bsh * hidden + 4 * batch * seq * seq * hidden,
             "saved": bsh * (34 + 5 * heads * seq / hidden) * 2, "ckpt": bsh * 4,
             "transient": 2 * batch * heads * seq * seq * 4}
    blocks = [{"name": "embed", "numel": vocab * hidden + seq * hidden, "fwd": 0, "saved": bsh * 4, "ckpt": bsh * 4,
               "checkpointable": False}]
    blocks += [dict(layer, name=f"layers.{i}") for i in range(layers)]
    blocks.append({"name": "head", "numel": 2 * hidden, "fwd": 2 * bsh * vocab, "saved": batch * seq * vocab * 8,
                   "ckpt": bsh * 4, "checkpointable": False})
    return make_profile(blocks, name=name, batch=batch, seq=seq)


def device(*, mem: float = 40 * GiB, flops: float = 100e12, bus: float = 100e9, h2d: float = 20e9,
           host_adam: float = 1e9, dev_adam: float = 4e10, kind: str = "cuda", host_mem: int = 0) -> DeviceProfile:
    coll = {1 << 16: bus / 8, 1 << 24: bus / 2, 1 << 30: bus}
    return DeviceProfile(
        name="synthetic-gpu", kind=kind, memory_bytes=int(mem), free_bytes=int(mem),  # type: ignore[arg-type]
        matmul_flops={"float32": flops / 8, "bfloat16": flops, "float16": flops},
        h2d_bytes_per_s={"pinned": h2d}, d2h_bytes_per_s={"pinned": h2d},
        host_adam_elems_per_s=host_adam, device_adam_elems_per_s=dev_adam,
        collective_bytes_per_s={"all_gather": dict(coll), "reduce_scatter": dict(coll)}, host_memory_bytes=host_mem,
        source="datasheet:test")


NO_RESERVE = ElixirConstraints(reserved_bytes=0)


def random_instance(rng: random.Random, n_blocks: int) -> tuple[ModelProfile, ClusterSpec]:
    blocks = []
    for _ in range(n_blocks):
        numel = rng.choice([0, rng.randint(10**6, 10**8)]) if rng.random() < 0.15 else rng.randint(10**6, 10**8)
        saved = rng.randint(10**7, 10**9)
        blocks.append({"numel": numel, "fwd": rng.uniform(1e11, 5e12), "saved": saved,
                       "ckpt": int(saved * rng.uniform(0.02, 0.5)), "transient": rng.randint(0, 10**8),
                       "checkpointable": rng.random() < 0.85})
    prof = make_profile(blocks, name=f"random-{n_blocks}")
    world = rng.choice([1, 2, 4, 8])
    dev = device(flops=rng.uniform(20e12, 300e12), bus=rng.uniform(5e9, 300e9), h2d=rng.uniform(5e9, 30e9),
                 host_adam=rng.uniform(2e8, 2e9), dev_adam=rng.uniform(5e9, 8e10))
    return prof, ClusterSpec.uniform(dev, world)


def brute_force(prof: ModelProfile, cluster: ClusterSpec, depths=(1, 2)) -> list[ElixirPlan]:
    """Every plan of the space, priced through the public estimate() (independent of the search)."""
    names = [b.name for b in prof.blocks]
    n = len(names)
    plans = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        spans, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                spans.append((start, i))
                start = i
        spans.append((start, n))
        ck_ids = [i for i, b in enumerate(prof.blocks) if b.checkpointable]
        for choice in itertools.product(itertools.product(MODES, (False, True)), repeat=len(spans)):
            for ck_bits in itertools.product((False, True), repeat=len(ck_ids)):
                ck = {names[i] for i, bit in zip(ck_ids, ck_bits) if bit}
                units = [UnitPlan(blocks=tuple(names[a:b]), mode=m, tier=o,
                                  checkpoint=tuple(x for x in names[a:b] if x in ck))
                         for (a, b), (m, o) in zip(spans, choice)]
                for df in depths:
                    for db in depths:
                        plans.append(estimate(prof, cluster, units, forward_prefetch=df, backward_prefetch=db,
                                              constraints=NO_RESERVE))
    return plans


def _changes(p: ElixirPlan) -> int:
    return len(p.offloaded_units) + len(p.checkpointed_blocks)


# ---- exact search == brute force ------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_exhaustive_search_matches_brute_force(seed):
    rng = random.Random(seed)
    prof, cluster = random_instance(rng, 3)
    everything = brute_force(prof, cluster)
    peaks = sorted(p.peak_bytes for p in everything)
    exact = ElixirConstraints(reserved_bytes=0, exhaustive=True, replication_margin=0.0)  # the pure optimum
    for q in (0.02, 0.3, 0.6, 1.0):
        budget = peaks[min(len(peaks) - 1, int(q * (len(peaks) - 1)))]
        fitting = [p for p in everything if p.peak_bytes <= budget]
        best = min(p.step_time_s for p in fitting)
        plan = search(prof, cluster, memory_budget=budget, constraints=exact)
        assert plan.search_method == "exhaustive"
        assert plan.peak_bytes <= budget
        assert plan.step_time_s == pytest.approx(best, rel=1e-9), (seed, q)
        # Among the equally fast plans it picks one that offloads and recomputes least.
        ties = [p for p in fitting if p.step_time_s <= best * (1 + 1e-9)]
        assert _changes(plan) == min(_changes(p) for p in ties)
    with pytest.raises(PlanInfeasibleError):
        search(prof, cluster, memory_budget=peaks[0] - 1, constraints=exact)


def test_greedy_search_is_close_to_the_exact_optimum():
    """On spaces small enough to solve exactly, the greedy frontier loses little (measured, then bounded)."""
    gaps = []
    for seed in range(4):
        rng = random.Random(100 + seed)
        prof, cluster = random_instance(rng, 4)
        least = frontier(prof, cluster, constraints=NO_RESERVE)[0].peak_bytes
        most = frontier(prof, cluster, constraints=NO_RESERVE)[-1].peak_bytes
        for q in (0.1, 0.5, 0.9):
            budget = int(least + q * (most - least))
            exact = search(prof, cluster, memory_budget=budget,
                           constraints=ElixirConstraints(reserved_bytes=0, exhaustive=True))
            greedy = search(prof, cluster, memory_budget=budget,
                            constraints=ElixirConstraints(reserved_bytes=0, exhaustive=False))
            assert greedy.search_method == "greedy frontier"
            assert greedy.step_time_s >= exact.step_time_s * (1 - 1e-9)  # exact really is the optimum
            gaps.append(greedy.step_time_s / exact.step_time_s - 1)
    assert max(gaps) < 0.15, gaps
    assert sum(gaps) / len(gaps) < 0.05, gaps


# ---- the sanity laws, over random instances --------------------------------------------------------
def _instances(count: int, seed: int, n_blocks=(3, 8)):
    rng = random.Random(seed)
    for _ in range(count):
        yield random_instance(rng, rng.randint(*n_blocks))


@pytest.mark.parametrize("exhaustive", [True, False])
def test_law_ample_memory_offloads_and_recomputes_nothing(exhaustive):
    cons = ElixirConstraints(reserved_bytes=0, exhaustive=exhaustive)
    for prof, cluster in _instances(6 if exhaustive else 12, 1, (3, 3) if exhaustive else (3, 10)):
        plan = search(prof, cluster, memory_budget=10**15, constraints=cons)
        assert plan.offloaded_units == () and plan.checkpointed_blocks == (), plan.explain()


def test_law_shrinking_the_budget_never_gives_a_faster_plan():
    for prof, cluster in _instances(10, 2, (3, 12)):
        plans = frontier(prof, cluster, constraints=NO_RESERVE)
        top, low = plans[-1].peak_bytes * 1.05, plans[0].peak_bytes
        budgets = [int(low + (top - low) * k / 12) for k in range(12, -1, -1)]
        times = [search(prof, cluster, memory_budget=b, constraints=NO_RESERVE).step_time_s for b in budgets]
        assert all(later >= earlier * (1 - 1e-12) for earlier, later in zip(times, times[1:])), times
        assert times[-1] > times[0]  # the range is wide enough that the trade-off shows


def test_law_more_devices_never_need_more_memory_per_device_for_the_same_plan():
    for prof, cluster in _instances(10, 3, (3, 12)):
        budget = frontier(prof, cluster, constraints=NO_RESERVE)[-1].peak_bytes // 2
        try:
            plan = search(prof, cluster, memory_budget=budget, constraints=NO_RESERVE)
        except PlanInfeasibleError:
            plan = search(prof, cluster, constraints=NO_RESERVE, memory_budget=10**15)
        dev = cluster.devices[0]
        peaks = []
        for world in (1, 2, 4, 8, 16):
            p = estimate(prof, ClusterSpec.uniform(dev, world), plan.units, forward_prefetch=plan.forward_prefetch,
                         backward_prefetch=plan.backward_prefetch, constraints=NO_RESERVE)
            peaks.append(p.peak_bytes)
        assert peaks == sorted(peaks, reverse=True), peaks


def test_law_chosen_plan_peak_is_under_the_budget():
    for prof, cluster in _instances(12, 4, (3, 12)):
        plans = frontier(prof, cluster, constraints=NO_RESERVE)
        for frac in (0.0, 0.25, 0.5, 1.0):
            budget = int(plans[0].peak_bytes + frac * (plans[-1].peak_bytes - plans[0].peak_bytes))
            plan = search(prof, cluster, memory_budget=budget, constraints=NO_RESERVE)
            assert plan.peak_bytes <= budget == plan.budget_bytes and plan.fits


# ---- mixed plans for the runtime's tests ------------------------------------------------------------
def cpu_device(mem: int = 24 * GiB) -> DeviceProfile:
    """A CPU "device" as profile_device measures one: no PCIe, gloo collectives, host == device AdamW."""
    return DeviceProfile(name="cpu", kind="cpu", memory_bytes=mem, free_bytes=mem, matmul_flops={"float32": 5e10},
                         host_adam_elems_per_s=3e8, device_adam_elems_per_s=3e8,
                         collective_bytes_per_s={"all_gather": {1 << 20: 1e9}, "reduce_scatter": {1 << 20: 1e9}})


def test_intermediate_budget_gives_a_mixed_plan():
    prof = gpt_like(layers=6, hidden=256, batch=4, seq=128, vocab=4096)
    cluster = ClusterSpec.uniform(cpu_device(), 2)
    budget = mixed_budget(prof, cluster, precision="32-true")
    plan = search(prof, cluster, memory_budget=budget, precision="32-true")
    offloaded = [u for u in plan.units if u.offload]
    resident = [u for u in plan.units if not u.offload]
    assert offloaded and resident, plan.explain()
    assert any(u.mode == "reshard" for u in plan.units), plan.explain()
    assert 0 < len(plan.checkpointed_blocks) < 6, plan.explain()
    assert plan.is_mixed and plan.variety == 3
    # Ample memory: nothing offloaded or recomputed, so not mixed.
    ample = search(prof, cluster, memory_budget=10**15, precision="32-true")
    assert not ample.is_mixed and not ample.offloaded_units and not ample.checkpointed_blocks


def test_mixed_budget_explains_when_no_mix_exists():
    prof = make_profile([{"numel": 10**6, "fwd": 1e9, "saved": 10**6}])
    with pytest.raises(ValueError, match="no budget gives a mixed plan.*at least two"):
        mixed_budget(prof, ClusterSpec.uniform(cpu_device(), 2))


# ---- the plan object ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_and_profile():
    prof = gpt_like(layers=8, hidden=1024, batch=4, seq=512)
    cluster = ClusterSpec.uniform(device(mem=2 * GiB), 4)
    budget = mixed_budget(prof, cluster)
    return search(prof, cluster, memory_budget=budget), prof, cluster


def test_plan_json_round_trip(plan_and_profile, tmp_path):
    plan, _, _ = plan_and_profile
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = ElixirPlan.from_json(path)
    assert again == plan
    assert ElixirPlan.from_json(plan.to_json()) == plan
    data = json.loads(path.read_text())
    assert data["__type__"] == "ElixirPlan" and data["units"][0]["__type__"] == "UnitPlan"
    with pytest.raises(ValueError, match="unknown field"):
        ElixirPlan.from_json(json.dumps({**data, "surprise": 1}))


def test_explain_shows_units_totals_and_runner_ups(plan_and_profile):
    plan, _, _ = plan_and_profile
    text = plan.explain()
    assert "Elixir plan for gpt-like" in text and "predicted step" in text
    for header in ("unit", "mode", "state on", "ckpt", "device state", "host state", "gathered", "time"):
        assert header in text.splitlines()[3]
    assert "host" in text and "reshard" in text and "total" in text
    assert "runner-ups" in text and "why this plan" in text
    full = plan.explain(full=True)
    assert len(full.splitlines()) >= len(plan.units) + 4
    # Unit time shares plus the tail account for the step.
    assert sum(u.time_s for u in plan.units) <= plan.step_time_s * (1 + 1e-9)
    b = plan.breakdown
    assert b.compute_s + b.recompute_s + b.exposed_comm_s + b.optimizer_s == pytest.approx(plan.step_time_s)
    m = plan.memory
    assert m.state_bytes + m.params_bytes + m.activation_bytes + m.margin_bytes == pytest.approx(plan.peak_bytes, abs=2)


def test_runner_ups_are_slower_or_equal(plan_and_profile):
    plan, _, _ = plan_and_profile
    assert plan.runner_ups
    for r in plan.runner_ups:
        assert r.step_time_s >= plan.step_time_s * (1 - 1e-9)
        assert r.peak_bytes <= plan.budget_bytes


def test_check_compatible_rejects_other_models_and_world_sizes(plan_and_profile):
    plan, prof, _ = plan_and_profile
    plan.check_compatible(prof, 4)
    plan.check_compatible(prof, 4, precision="bf16-mixed")
    with pytest.raises(PlanMismatchError, match=r"world size 4, this run has 2 ranks") as e:
        plan.check_compatible(prof, 2)
    assert e.value.field == "world_size" and e.value.expected == 4 and e.value.actual == 2
    other = gpt_like(layers=9, hidden=1024, batch=4, seq=512)
    with pytest.raises(PlanMismatchError, match="parameters"):
        plan.check_compatible(other, 4)
    renamed = make_profile([{"numel": b.param_numel, "fwd": b.fwd_flops, "saved": b.saved_bytes,
                             "name": b.name.replace("layers", "h")} for b in prof.blocks])
    with pytest.raises(PlanMismatchError, match=r"blocks do not match.*'layers.0' vs model 'h.0'"):
        plan.check_compatible(renamed, 4)
    with pytest.raises(PlanMismatchError, match="precision 'bf16-mixed'.*'32-true'"):
        plan.check_compatible(prof, 4, precision="32-true")


def test_deepspeed_translation(plan_and_profile):
    plan, _, _ = plan_and_profile
    cfg = plan.to_deepspeed_config()
    zero = cfg["zero_optimization"]
    frac = sum(u.param_numel for u in plan.units if u.offload) / plan.param_numel
    assert zero["stage"] == 3 and zero["offload_optimizer"]["ratio"] == pytest.approx(frac, abs=1e-4)
    assert "offload_param" not in zero  # DeepSpeed cannot offload some units' parameters only
    assert cfg["bf16"] == {"enabled": True} and cfg["train_micro_batch_size_per_gpu"] == 4
    gaps = " ".join(plan.deepspeed_gaps())
    assert "which units are offloaded" in gaps and "which blocks are checkpointed" in gaps
    # Fixed configurations translate to the stage users know.
    _, prof, cluster = plan_and_profile
    assert baseline(prof, cluster, "zero2").to_deepspeed_config()["zero_optimization"]["stage"] == 2
    z3o = baseline(prof, cluster, "zero3-offload").to_deepspeed_config()["zero_optimization"]
    assert z3o["offload_param"]["device"] == "cpu" and "ratio" not in z3o["offload_optimizer"]
    assert baseline(prof, cluster, "ddp").to_deepspeed_config()["zero_optimization"]["stage"] == 0


@RunIf(deepspeed=True)
def test_deepspeed_accepts_the_translation(plan_and_profile):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    plan, prof, cluster = plan_and_profile
    for p in (plan, baseline(prof, cluster, "zero3-offload"), baseline(prof, cluster, "zero2")):
        zero = DeepSpeedZeroConfig(**p.to_deepspeed_config()["zero_optimization"])
        assert int(zero.stage) == p.to_deepspeed_config()["zero_optimization"]["stage"]


def test_baselines_priced_by_the_same_model(plan_and_profile):
    _, prof, cluster = plan_and_profile
    z3 = baseline(prof, cluster, "zero3", checkpoint=False, memory_budget=10**15)
    z3o = baseline(prof, cluster, "zero3-offload", checkpoint=False, memory_budget=10**15)
    z2 = baseline(prof, cluster, "zero2", checkpoint=False, memory_budget=10**15)
    ddp = baseline(prof, cluster, "ddp", checkpoint=False, memory_budget=10**15)
    assert {u.mode for u in z3.units} == {"reshard"} and not z3.offloaded_units
    assert len(z3o.offloaded_units) == len(z3o.units)
    assert z3o.peak_bytes < z3.peak_bytes < z2.peak_bytes < ddp.peak_bytes
    assert z3o.step_time_s > z3.step_time_s
    best = search(prof, cluster, memory_budget=10**15)
    assert best.step_time_s <= min(z3.step_time_s, z2.step_time_s, ddp.step_time_s) * (1 + 1e-9)
    with pytest.raises(ValueError, match="unknown baseline 'zero4'; known: ddp, zero2"):
        baseline(prof, cluster, "zero4")


# ---- when nothing fits -------------------------------------------------------------------------------
def test_infeasible_names_the_smallest_budget_and_the_cheapest_change():
    prof = gpt_like(layers=4, hidden=1024, batch=8, seq=1024)
    cluster = ClusterSpec.uniform(device(), 2)
    least = frontier(prof, cluster, constraints=NO_RESERVE)[0].peak_bytes
    with pytest.raises(PlanInfeasibleError, match=r"no Elixir plan fits .*Smallest budget that fits: .*Cheapest "
                                                  r"change: reduce the per-device batch from 8 to") as e:
        search(prof, cluster, memory_budget=int(least * 0.8), constraints=NO_RESERVE)
    err = e.value
    assert err.budget_bytes == int(least * 0.8) and err.needed_bytes >= least * 0.99
    # The budget it names really fits.
    assert search(prof, cluster, memory_budget=err.needed_bytes, constraints=NO_RESERVE).fits
    # With checkpointing forbidden, allowing it is the cheapest change.
    cons = ElixirConstraints(reserved_bytes=0, allow_checkpointing=False)
    no_ck_least = frontier(prof, cluster, constraints=cons)[0].peak_bytes
    with pytest.raises(PlanInfeasibleError, match="Cheapest change: allow activation checkpointing") as e2:
        search(prof, cluster, memory_budget=int(no_ck_least * 0.9), constraints=cons)
    assert e2.value.needed_bytes >= no_ck_least * 0.99


def test_infeasible_suggests_more_devices_when_state_dominates():
    # Activations are tiny, parameters huge, offloading forbidden: allowing it is the cheapest change,
    # and sharding over more devices is the other way out.
    prof = make_profile([{"numel": 5 * 10**8, "fwd": 1e12, "saved": 10**6} for _ in range(4)], batch=1)
    cluster = ClusterSpec.uniform(device(), 1)
    cons = ElixirConstraints(reserved_bytes=0, allow_offload=False)
    with pytest.raises(PlanInfeasibleError, match=r"Cheapest change: allow .*offloading.*Other options: use \d+ "
                                                  r"devices instead of 1") as e:
        search(prof, cluster, memory_budget=8 * GiB, constraints=cons)
    more = int(re.search(r"use (\d+) devices", e.value.suggestions[1]).group(1))
    # The fewest devices that fit: one fewer does not.
    assert search(prof, ClusterSpec.uniform(device(), more), memory_budget=8 * GiB, constraints=cons).fits
    with pytest.raises(PlanInfeasibleError):
        search(prof, ClusterSpec.uniform(device(), more - 1), memory_budget=8 * GiB, constraints=cons)


def test_infeasible_because_host_memory_is_too_small_says_so():
    # Device budget is ample for the least-memory plan, but the host cannot hold what it offloads.
    prof = make_profile([{"numel": 5 * 10**8, "fwd": 1e12, "saved": 10**6} for _ in range(4)], batch=1)
    small_host = ClusterSpec.uniform(device(mem=24 * GiB, host_mem=4 * GiB), 2)
    with pytest.raises(PlanInfeasibleError, match=r"fits the device budget of .* but the state it offloads does "
                                                  r"not fit host memory.*Cheapest change: use about \d+ devices"):
        search(prof, small_host, memory_budget=8 * GiB, constraints=NO_RESERVE)
    # The same budget with a roomy host is feasible: the host was what bound.
    roomy = ClusterSpec.uniform(device(mem=24 * GiB, host_mem=512 * GiB), 2)
    assert search(prof, roomy, memory_budget=8 * GiB, constraints=NO_RESERVE).fits


# ---- inputs are validated ------------------------------------------------------------------------------
def test_constraints_and_inputs_are_validated():
    with pytest.raises(ValueError, match="modes=.*subset"):
        ElixirConstraints(modes=("zero9",))
    with pytest.raises(ValueError, match="prefetch_depths.*>= 1"):
        ElixirConstraints(prefetch_depths=(0,))
    with pytest.raises(ValueError, match="fragmentation=1.5"):
        ElixirConstraints(fragmentation=1.5)
    with pytest.raises(ValueError, match="UnitPlan.mode='zero'"):
        UnitPlan(blocks=("a",), mode="zero")
    with pytest.raises(ValueError, match="not blocks of this unit"):
        UnitPlan(blocks=("a",), checkpoint=("b",))
    prof = gpt_like(layers=2, hidden=256)
    cluster = ClusterSpec.uniform(device(), 2)
    with pytest.raises(ValueError, match="precision 'fp8'.*bf16-mixed"):
        search(prof, cluster, precision="fp8")
    with pytest.raises(ValueError, match="optimizer 'lion'"):
        search(prof, cluster, optimizer="lion")
    with pytest.raises(ValueError, match="cannot read memory size"):
        search(prof, cluster, memory_budget="lots")
    with pytest.raises(ValueError, match="not the next contiguous run"):
        estimate(prof, cluster, [UnitPlan(blocks=("layers.0",)), UnitPlan(blocks=("embed",))])
    with pytest.raises(ValueError, match=r"units cover 1 of 4 blocks"):
        estimate(prof, cluster, [UnitPlan(blocks=("embed",))])
    fwd_only = ModelProfile(**{**{f: getattr(prof, f) for f in prof.__dataclass_fields__}, "step": "forward"})
    with pytest.raises(ValueError, match="'forward' profile.*step='train'"):
        search(fwd_only, cluster)


def test_memory_budget_forms():
    prof = gpt_like(layers=2, hidden=256)
    cluster = ClusterSpec.uniform(device(mem=40 * GiB), 2)
    assert search(prof, cluster).budget_bytes == 40 * GiB
    assert search(prof, cluster, memory_budget=0.5).budget_bytes == 20 * GiB
    assert search(prof, cluster, memory_budget="10GiB").budget_bytes == 10 * GiB
    assert search(prof, cluster, memory_budget=3 * GiB).budget_bytes == 3 * GiB


def test_gpt2_20b_shape_on_8_devices_uses_the_greedy_search():
    """The 20B shape of the Elixir paper (h8192, 24 layers): the large-space path runs (its time is
    measured by benchmarks/elixir_planner.py, not asserted here)."""
    h, layers, b, s, vocab = 8192, 24, 8, 1024, 50257
    prof = gpt_like(layers=layers, hidden=h, batch=b, seq=s, vocab=vocab, name="gpt2-20b")
    assert 19e9 < prof.param_numel < 21e9
    a100 = device(mem=80 * GiB, flops=250e12, bus=200e9, h2d=24e9, host_adam=1.5e9, dev_adam=5e10,
                  host_mem=2048 * GiB)
    plan = search(prof, ClusterSpec.uniform(a100, 8))
    assert plan.search_method == "greedy frontier" and plan.fits
    assert plan.host_bytes_per_rank * 8 <= 2048 * GiB * 0.8


# ---- the command line ----------------------------------------------------------------------------------
def test_cli_plan_elixir_writes_the_plan_file(tmp_path, capsys):
    from tightfit.cli import main

    prof = gpt_like(layers=4, hidden=512, batch=4, seq=256)
    prof.to_json(tmp_path / "model.json")
    device(mem=1 * GiB).to_json(tmp_path / "gpu.json")
    out = tmp_path / "plan.json"
    rc = main(["plan", "elixir", "--profile", str(tmp_path / "model.json"), "--device-profile",
               str(tmp_path / "gpu.json"), "--devices", "2", "--device-memory", "2GiB", "--baselines",
               "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "Elixir plan for gpt-like" in captured.out and "runner-ups" in captured.out
    assert "fixed configurations, same cost model" in captured.out and "zero3-offload" in captured.out
    assert "[plan elixir] greedy descent" in captured.err and "\r" not in captured.err  # a line per stage (no TTY)
    plan = ElixirPlan.from_json(out)
    assert plan.world_size == 2 and plan.budget_bytes == 2 * GiB and plan.fits
    plan.check_compatible(prof, 2)


def test_cli_reports_infeasible_budgets(tmp_path, capsys):
    from tightfit.cli import main

    gpt_like(layers=4, hidden=512, batch=4, seq=256).to_json(tmp_path / "model.json")
    device().to_json(tmp_path / "gpu.json")
    rc = main(["plan", "elixir", "--profile", str(tmp_path / "model.json"), "--device-profile",
               str(tmp_path / "gpu.json"), "--budget", "1MiB"])
    assert rc == 3
    assert "no Elixir plan fits 1.00 MiB" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "name a planner: elixir" in capsys.readouterr().err


def test_cli_profiles_a_model_preset(tmp_path, capsys):
    pytest.importorskip("tightfit.models")
    from tightfit.cli import main

    cpu_device().to_json(tmp_path / "cpu.json")
    rc = main(["plan", "elixir", "--model", "gpt2-tiny", "--batch", "2", "--seq", "64", "--device-profile",
               str(tmp_path / "cpu.json"), "--devices", "2", "--precision", "32-true"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "Elixir plan for gpt2-tiny" in captured.out and "on 2 x cpu" in captured.out


# ---- with memory to spare, DDP's plan unless clearly beaten (issue 32) -----------------------------------
@pytest.mark.parametrize("seed", range(8))  # seed 6: a plan 12% faster than replicating; the others within 10%
def test_replication_is_kept_unless_another_plan_is_predicted_clearly_faster(seed):
    prof, cluster = random_instance(random.Random(seed), 4)
    names = tuple(b.name for b in prof.blocks)
    replicated = estimate(prof, cluster, [UnitPlan(blocks=names, mode="replicate")], constraints=NO_RESERVE)
    roomy = replicated.peak_bytes * 4
    pure = search(prof, cluster, memory_budget=roomy,
                  constraints=ElixirConstraints(reserved_bytes=0, replication_margin=0.0))
    kept = search(prof, cluster, memory_budget=roomy, constraints=ElixirConstraints(reserved_bytes=0))
    all_replicated = lambda p: all(u.mode == "replicate" and not u.offload and not u.checkpoint  # noqa: E731
                                   for u in p.units)
    if pure.step_time_s >= replicated.step_time_s * 0.9:
        assert all_replicated(kept) and "replication kept" in kept.search_method, kept.search_method
        assert kept.step_time_s == pytest.approx(replicated.step_time_s, rel=1e-9)
    else:  # a plan predicted more than 10% faster wins
        assert kept.step_time_s == pytest.approx(pure.step_time_s, rel=1e-9)
    # Too little memory to replicate: the fastest fitting plan, as without the margin.
    tight = search(prof, cluster, memory_budget=replicated.peak_bytes - 1, constraints=ElixirConstraints(reserved_bytes=0))
    assert not all_replicated(tight) and tight.peak_bytes < replicated.peak_bytes


def test_replication_margin_is_validated():
    with pytest.raises(PlanError, match=r"replication_margin=1.5: must be in \[0, 1\)"):
        ElixirConstraints(replication_margin=1.5)
