from __future__ import annotations

import json
import random
import time

import pytest

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf
from tightfit.planner.errors import PlanError, PlanInfeasibleError
from tightfit.planner.pipeline import (
    DeviceSpec,
    LayerMemory,
    PartitionPlan,
    PipelineProblem,
    balance,
    brute_force,
    evaluate,
    even,
    even_boundaries,
    parameter_balanced,
    sky_allocator,
)

GIB = 2**30


def _problem(costs, mems, devs, **kw) -> PipelineProblem:
    return PipelineProblem(layer_costs=costs, layer_memory=mems, devices=devs, **kw)


def _devices(speeds, memory=GIB):
    mems = memory if isinstance(memory, (list, tuple)) else [memory] * len(speeds)
    return [DeviceSpec(name=f"d{i}", speed=s, memory_bytes=m) for i, (s, m) in enumerate(zip(speeds, mems))]


def _random_instance(rng: random.Random):
    L = rng.randint(3, 7)
    D = rng.randint(1, min(3, L))
    costs = [rng.uniform(0.1, 2.0) for _ in range(L)]
    mems = [LayerMemory(param_bytes=rng.randint(1, 100), activation_bytes=rng.randint(0, 50),
                        output_bytes=rng.randint(0, 50)) for _ in range(L)]
    devs = [DeviceSpec(name=f"d{i}", speed=rng.uniform(0.2, 1.0), memory_bytes=rng.randint(300, 2500))
            for i in range(D)]
    links = rng.choice([None, 30.0, [[rng.uniform(5, 100) for _ in range(D)] for _ in range(D)]])
    return costs, mems, devs, links


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dp_matches_brute_force_on_random_instances(schedule):
    rng = random.Random(1234 if schedule == "gpipe" else 99)
    checked = infeasible = 0
    for _ in range(120):
        costs, mems, devs, links = _random_instance(rng)
        M = rng.randint(1, 6)
        problem = _problem(costs, mems, devs, microbatches=M, schedule=schedule, links=links)
        best = brute_force(problem)
        if best is None:
            with pytest.raises(PlanInfeasibleError):
                balance(problem)
            infeasible += 1
            continue
        plan = balance(problem)
        assert plan.feasible
        assert plan.step_time_s == pytest.approx(best.step_time_s, rel=1e-9)
        # the given order is solved exactly too
        fixed = brute_force(problem, search_order=False)
        if fixed is not None:
            got = balance(problem, order="given")
            assert got.step_time_s == pytest.approx(fixed.step_time_s, rel=1e-9)
        checked += 1
    assert checked > 60 and infeasible > 3  # both branches were exercised


def test_slow_device_gets_fewer_layers():
    devs = _devices([1.0, 0.33, 1.0, 1.0])
    problem = _problem([1.0] * 24, [1000] * 24, devs, microbatches=8, schedule="1f1b")
    plan = balance(problem, order="given")
    counts = plan.layer_counts()
    assert counts[1] < min(counts[0], counts[2], counts[3])
    assert sum(counts) == 24
    ev = even(problem)
    assert ev.layer_counts() == (6, 6, 6, 6)
    assert plan.step_time_s < 0.7 * ev.step_time_s  # the slow device no longer sets the pace


def test_memory_caps_bound_the_stages():
    # device 0 is fastest but holds only 2 layers: weights + grads + Adam state = 4 x 100 B per layer
    devs = _devices([1.0, 0.5], memory=[2 * 4 * 100 + 50, GIB])
    plan = balance(_problem([1.0] * 8, [100] * 8, devs, microbatches=4, schedule="gpipe"), order="given")
    assert plan.layer_counts()[0] == 2
    assert all(s.memory_bytes <= s.memory_cap_bytes for s in plan.stages)


def test_infeasible_memory_names_the_shortfall():
    devs = _devices([1.0, 1.0], memory=1000)
    with pytest.raises(PlanInfeasibleError, match=r"short by .*Fix: add devices") as info:
        balance(_problem([1.0] * 4, [LayerMemory(param_bytes=200)] * 4, devs, microbatches=2, schedule="1f1b"))
    assert info.value.needed_bytes == 4 * 200 * 4 and info.value.budget_bytes == 2000
    # enough in total, but one layer is larger than any device
    with pytest.raises(PlanInfeasibleError, match=r"largest layer needs .* more than the largest device holds"):
        balance(_problem([1.0] * 3, [10, 400, 10], devs, microbatches=1, schedule="gpipe"))


def test_gpipe_keeps_every_microbatch_in_flight_1f1b_does_not():
    mems = [LayerMemory(param_bytes=10, activation_bytes=100)] * 4
    devs = _devices([1.0, 1.0], memory=[500, 10_000])
    with pytest.raises(PlanInfeasibleError, match="schedule='1f1b'"):
        balance(_problem([1.0] * 4, mems, devs, microbatches=8, schedule="gpipe"), order="given")
    # 1F1B's last stage holds one microbatch; the first holds two
    plan = balance(_problem([1.0] * 4, mems, _devices([1.0, 1.0], memory=[10_000, 500]), microbatches=8,
                            schedule="1f1b"), order="given")
    assert plan.feasible and plan.stages[1].memory_bytes <= 500


def test_order_search_crosses_a_slow_link_once():
    # devices 0,2 at one site and 1,3 at another: 100x slower between sites
    fast, slow = 1e9, 1e7
    site = [0, 1, 0, 1]
    links = [[fast if site[a] == site[b] else slow for b in range(4)] for a in range(4)]
    mems = [LayerMemory(param_bytes=10, output_bytes=1_000_000)] * 8
    devs = _devices([1.0] * 4)
    problem = _problem([0.01] * 8, mems, devs, microbatches=4, schedule="1f1b", links=links)
    given = balance(problem, order="given")
    best = balance(problem)
    crossings = sum(site[a] != site[b] for a, b in zip(best.order, best.order[1:]))
    assert crossings == 1
    assert best.step_time_s < given.step_time_s
    assert "exhaustive" in best.notes[0]
    bf = brute_force(problem)
    assert best.step_time_s == pytest.approx(bf.step_time_s)


def test_plan_json_round_trip_and_explain(tmp_path):
    plan = balance(_problem([1.0, 2.0, 1.0, 3.0], [100] * 4, _devices([1.0, 0.5]), microbatches=4, schedule="1f1b",
                            links=1e6))
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = PartitionPlan.from_json(path)
    assert again == plan
    assert json.loads(path.read_text())["__type__"] == "PartitionPlan"
    text = plan.explain()
    assert "balanced partition of 4 layers over 2 devices" in text and "predicted step" in text
    assert again.boundaries[0] == 0 and again.boundaries[-1] == 4


def test_interleaved_places_chunks_round_robin():
    devs = _devices([1.0, 0.5])
    plan = balance(_problem([1.0] * 12, [10] * 12, devs, microbatches=4, schedule="interleaved", virtual_stages=2))
    assert len(plan.stages) == 4
    assert [s.device for s in plan.stages] == [plan.order[0], plan.order[1], plan.order[0], plan.order[1]]
    counts = plan.layer_counts()
    slow = 1 if plan.order[1] == 1 else 0
    assert counts[1] < counts[0] if slow == 1 else counts[1] < counts[0]
    assert sum(counts) == 12


def test_baselines():
    assert even_boundaries(10, 3) == [0, 4, 7, 10]
    costs, mems = [1.0] * 6, [100, 100, 100, 100, 400, 400]
    devs = _devices([1.0, 1.0])
    problem = _problem(costs, mems, devs, microbatches=2, schedule="gpipe")
    pb = parameter_balanced(problem)
    assert pb.boundaries == (0, 4, 6) and pb.method == "parameter-balanced"
    ev = even(problem)
    assert ev.boundaries == (0, 3, 6)
    priced = evaluate(problem, [0, 3, 6])
    assert priced.step_time_s == ev.step_time_s == pytest.approx(3 + 3 + 1 * 3)


def test_sky_allocator_reproduces_the_give_back_slip():
    costs, mems = [1.0] * 12, [10] * 12
    slow_first = _devices([0.5, 1.0])
    # the original never gives a layer away: the slow first worker keeps its even share
    one = _problem(costs, mems, slow_first, microbatches=1, schedule="gpipe")
    assert sky_allocator(one).layer_counts() == (6, 6)
    # with the comparison fixed it gives one back, then stops at its +1-layer tolerance
    fixed = sky_allocator(one, fix_give_back=True)
    assert fixed.layer_counts() == (5, 7)
    ours = balance(_problem(costs, mems, slow_first, microbatches=8, schedule="1f1b"), order="given")
    assert ours.layer_counts() == (4, 8)
    # taking layers does work: a slow *last* worker is relieved by the first one
    slow_last = _devices([1.0, 0.5])
    assert sky_allocator(_problem(costs, mems, slow_last, microbatches=1, schedule="gpipe")).layer_counts() == (8, 4)


def test_sky_allocator_respects_memory_first():
    devs = _devices([1.0, 1.0], memory=[2 * 4 * 10 + 1, GIB])
    plan = sky_allocator(_problem([1.0] * 6, [10] * 6, devs, microbatches=1, schedule="gpipe"))
    assert plan.layer_counts()[0] <= 2 and plan.feasible


def test_bad_inputs_name_the_rule():
    devs = _devices([1.0, 1.0])
    with pytest.raises(PlanError, match="schedule 'zb' is unknown"):
        balance(_problem([1.0] * 4, [1] * 4, devs, microbatches=2, schedule="zb"))
    with pytest.raises(PlanError, match="3 layers cannot fill 4 stages"):
        balance(_problem([1.0] * 3, [1] * 3, devs, microbatches=2, schedule="interleaved", virtual_stages=2))
    with pytest.raises(PlanError, match="layer_memory has 2 entries but layer_costs has 3"):
        balance(_problem([1.0] * 3, [1] * 2, devs, microbatches=2, schedule="gpipe"))
    with pytest.raises(PlanError, match="speed=0 must be"):
        DeviceSpec(name="x", speed=0, memory_bytes=1)
    with pytest.raises(PlanError, match="must be a 2x2 matrix"):
        balance(_problem([1.0] * 3, [1] * 3, devs, microbatches=2, schedule="gpipe", links=[[1.0]]))
    with pytest.raises(PlanError, match="permutation of 0..1"):
        balance(_problem([1.0] * 3, [1] * 3, devs, microbatches=2, schedule="gpipe"), order=[0, 0])


def test_160_layers_on_64_devices_plans_in_under_a_second():
    """The paper's scale. CPU time of this process (not wall time), so other load does not count."""
    rng = random.Random(7)
    costs = [2.0] + [1.0] * 160 + [0.5]
    mems = [LayerMemory(param_bytes=50_000_000, activation_bytes=20_000_000, output_bytes=4_000_000)] * 162
    devs = [DeviceSpec(name=f"d{i}", speed=1 / rng.uniform(1, 4), memory_bytes=int(16e9 / rng.uniform(1, 3)))
            for i in range(64)]
    start = time.process_time()
    problem = _problem(costs, mems, devs, microbatches=32, schedule="1f1b", links=1.25e9)
    plan = balance(problem)
    elapsed = time.process_time() - start
    assert plan.feasible and len(plan.stages) == 64
    assert plan.step_time_s < even(problem).step_time_s
    assert elapsed < 1.0, f"planning 160 layers x 64 devices took {elapsed:.2f} s of CPU time"


def test_tightfit_plan_sky_cli(tmp_path, capsys):
    from tightfit.cli import main

    out = tmp_path / "sky.json"
    rc = main(["plan", "sky", "--layers", "12", "--speeds", "1,0.25", "--memory", "8GiB", "--compare",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "balanced partition of 12 layers over 2 devices" in text and "even" in text and "sky (Sky" in text
    plan = PartitionPlan.from_json(out)
    assert plan.layer_counts()[1] < plan.layer_counts()[0]
    assert main(["plan", "sky", "--layers", "12", "--speeds", "1,1", "--memory", "1MiB"]) == 3
    assert "short by" in capsys.readouterr().err
    assert main(["plan", "sky", "--layers", "12", "--speeds", "1,1", "--memory", "1GiB,2GiB,3GiB"]) == 2


def test_readme_planner_snippet_runs():
    """docs/sky.md's planner example (section "The planner") is executed as written, and plans what it says."""
    from tests.helpers.docs import python_block

    code = python_block("docs/sky.md", "The planner")
    assert "tightfit.planner.pipeline" in code, "docs/sky.md's section 'The planner' lost its planner example"
    namespace: dict = {}
    exec(compile(code, "docs/sky.md: The planner", "exec"), namespace)
    assert namespace["plan"].layer_counts() == (20, 4)


# --------------------------------------------------------------------------------------------------
# The problem object, the registry, the replica merge, and the plan shared from rank 0


def test_problem_is_validated_once_and_normalised():
    devs = _devices([1.0, 0.5])
    problem = _problem([1.0] * 4, [100, LayerMemory(param_bytes=5)] * 2, devs, microbatches=2, schedule="1f1b",
                       links=[[1e9, 2e9], [2e9, 1e9]])
    assert problem.layer_memory[0] == LayerMemory(param_bytes=100) and isinstance(problem.devices, tuple)
    assert problem.links == ((1e9, 2e9), (2e9, 1e9))
    assert (problem.num_layers, problem.num_devices, problem.chunks, problem.num_stages) == (4, 2, 1, 2)
    assert list(problem.param_prefix) == [0, 100, 105, 205, 210]
    # lists and tuples give the same (hashable) problem; the derived arrays take no part in equality
    again = PipelineProblem(layer_costs=(1.0,) * 4, layer_memory=problem.layer_memory, devices=tuple(devs),
                            microbatches=2, schedule="1f1b", links=problem.links)
    assert again == problem and hash(again) == hash(problem)
    interleaved = _problem([1.0] * 8, [1] * 8, devs, microbatches=4, schedule="interleaved", virtual_stages=2)
    assert (interleaved.chunks, interleaved.num_stages) == (2, 4)
    with pytest.raises(PlanError, match="microbatches=0 must be a whole number >= 1"):
        _problem([1.0] * 4, [1] * 4, devs, microbatches=0, schedule="1f1b")
    with pytest.raises(PlanError, match="links=0 bytes/s must be a number > 0"):
        _problem([1.0] * 4, [1] * 4, devs, microbatches=1, schedule="1f1b", links=0)
    with pytest.raises(PlanError, match="is not a DeviceSpec"):
        _problem([1.0] * 4, [1] * 4, ["gpu0", "gpu1"], microbatches=1, schedule="1f1b")


def test_registry_is_strict_and_plan_pipeline_dispatches():
    from tightfit.planner.pipeline import PartitionerRegistry, partitioners, plan_pipeline

    assert {"balanced", "even", "parameter-balanced", "sky", "sky-fixed"} <= set(partitioners.names())
    problem = _problem([1.0] * 12, [10] * 12, _devices([0.5, 1.0]), microbatches=1, schedule="gpipe")
    assert plan_pipeline(problem, "sky").layer_counts() == (6, 6)
    assert plan_pipeline(problem, "sky-fixed").layer_counts() == (5, 7)  # one function, two preset names
    assert plan_pipeline(problem, "even") == even(problem)
    given = plan_pipeline(problem, (0, 5, 12))
    assert given.method == "given" and given.boundaries == (0, 5, 12)
    with pytest.raises(PlanError, match=r"unknown partitioner 'greedy'; known partitioners: balanced, even"):
        plan_pipeline(problem, "greedy")
    with pytest.raises(PlanError, match="keeps the devices as listed"):
        partitioners.get("even")(problem, order=[1, 0])
    mine = PartitionerRegistry()
    mine.register("halves", lambda p: evaluate(p, [0, p.num_layers // 2, p.num_layers]), summary="split in two")
    assert mine.get("halves")(problem).boundaries == (0, 6, 12)
    with pytest.raises(PlanError, match="'halves' is already registered"):
        mine.register("halves", even, summary="again")
    with pytest.raises(PlanError, match="partitioner name 'two words' is invalid"):
        mine.register("two words", even, summary="bad name")


def test_interleaved_pipelines_keep_the_device_order():
    from tightfit.planner.pipeline import plan_pipeline

    # a free search ends the pipeline on the slow device (its last chunk sends nothing), but
    # ScheduleInterleaved1F1B runs chunk k on rank k % ranks: the runtime needs rank = position
    mems = [LayerMemory(param_bytes=10, output_bytes=1_000_000)] * 12
    problem = _problem([1.0] * 12, mems, _devices([1.0, 0.25]), microbatches=4, schedule="interleaved", links=1e9)
    assert balance(problem, order="search").order == (1, 0)
    assert plan_pipeline(problem, "balanced", order="search").order == (0, 1)
    assert plan_pipeline(problem, "balanced", order="search") == balance(problem, order="given")


def test_replicas_are_merged_into_the_slowest_copy_of_each_position():
    from tightfit.planner.pipeline import merge_replicas

    devs = [DeviceSpec(name=f"r{i}", speed=s, memory_bytes=m)
            for i, (s, m) in enumerate([(1.0, 800), (0.9, 900), (0.5, 700), (1.0, 600)])]
    links = [[float("inf"), 10, 1, 1], [10, float("inf"), 1, 1], [1, 1, float("inf"), 4], [1, 1, 4, float("inf")]]
    merged, merged_links = merge_replicas(devs, links, replicas=2)
    # position 0 = ranks 0 and 2 (rank 2 is slower), position 1 = ranks 1 and 3 (rank 1 is slower)
    assert merged == [DeviceSpec(name="r0/r2", speed=0.5, memory_bytes=700),
                      DeviceSpec(name="r1/r3", speed=0.9, memory_bytes=600)]
    assert merged_links == [[float("inf"), 4], [4, float("inf")]]  # the slower replica's link
    assert merge_replicas(devs, 5e9, replicas=4) == ([DeviceSpec(name="r0/r1/r2/r3", speed=0.5, memory_bytes=600)],
                                                    5e9)
    assert merge_replicas(devs, None, replicas=1) == (devs, None)
    with pytest.raises(PlanError, match="4 devices cannot form 3 equal replicas"):
        merge_replicas(devs, None, replicas=3)
    with pytest.raises(PlanError, match="links must be a 4x4 matrix"):
        merge_replicas(devs, [[1.0]], replicas=2)


def _awkward_problem() -> PipelineProblem:
    rng = random.Random(5)  # floats with every digit in use, so a lossy codec would show
    devs = [DeviceSpec(name=f"d{i}", speed=rng.uniform(0.1, 1.0), memory_bytes=GIB) for i in range(3)]
    return _problem([rng.uniform(1e-4, 1e-2) for _ in range(9)],
                    [LayerMemory(param_bytes=rng.randint(1, 10**6), output_bytes=rng.randint(1, 10**5))
                     for _ in range(9)], devs, microbatches=4, schedule="1f1b",
                    links=[[rng.uniform(1e8, 1e9) for _ in range(3)] for _ in range(3)])


def _plan_shared_from_rank0(rank: int, world_size: int) -> tuple[str, int]:
    from tightfit.distributed import decide_on_rank0

    calls = []

    def decide() -> PartitionPlan:
        calls.append(rank)
        return balance(_awkward_problem())

    plan = decide_on_rank0(decide, encode=lambda p: p.to_json(), decode=PartitionPlan.from_json)
    return plan.to_json(), len(calls)


@RunIf(min_world=2)
def test_plan_round_trips_json_exactly_and_every_rank_gets_rank0s():
    plan = balance(_awkward_problem())
    again = PartitionPlan.from_json(plan.to_json())
    assert again == plan  # field by field, floats compared with ==
    assert [s.compute_s for s in again.stages] == [s.compute_s for s in plan.stages]
    outs = run_distributed(_plan_shared_from_rank0, 2, timeout=120)
    assert [calls for _, calls in outs] == [1, 0]  # only rank 0 planned
    assert [PartitionPlan.from_json(text) for text, _ in outs] == [plan, plan]
