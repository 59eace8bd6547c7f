"""energon inside a hard memory limit: the serving plan covers the whole process, so under a cgroup limit smaller than
what the engine uses unlimited it is never OOM-killed. It fits (streaming layers from disk, greedy tokens equal to
the unlimited run) or ``tightfit serve`` refuses in one line with exit code 3 before anything loads."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.memlimit import CGROUP_V1_MEMORY, last_json_line, limit_unavailable, run_limited
from tests.helpers.multiprocess import free_port

pytestmark = pytest.mark.skipif(limit_unavailable() is not None, reason=str(limit_unavailable()))

MiB = 2**20
# Weights of about 190 MiB (6 layers of 24 MiB, embedding and head of 23 MiB each): the controller and one worker
# with every layer in memory (and its packed copies) need far more than LIMIT, which still holds the
# least-memory plan (every layer streamed from disk).
# ``tightfit serve``'s own process also imports its HTTP stack: it is given LIMIT + 100 MiB where it must fit.
LIMIT = 600 * MiB
TOO_SMALL = 400 * MiB  # below the least-memory plan: refused

_CHILD = """
import json, os, sys
from energon_infer import Engine, MemoryPoolConfig, SamplingParams

if __name__ == "__main__":
    path, budget = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    pool = MemoryPoolConfig(memory_budget=budget) if budget else None
    options = json.loads(os.environ.get("CHILD_OPTIONS", "{}"))
    with Engine.from_pretrained(path, memory_pool=pool, progress=False, **options) as engine:
        # the third prompt is longer than the token budget the plan chooses: it runs in chunks
        outs = engine.generate([[5, 6, 7, 8], [9, 10], [(7 * i) % 8000 for i in range(1, 301)]],
                               SamplingParams(temperature=0, max_tokens=6))
        plan, budget = engine.memory_plan, engine.memory_report()["budget"]
        print(engine.explain(), file=sys.stderr)
        pool = engine.memory_pool
        choices = {"packed": engine.config.runtime.packed_weights, "tables": list(pool.disk_vocab if pool else ())}
    print(json.dumps({"tokens": [o.token_ids for o in outs], "plan": plan.to_json(), "budget": budget, **choices}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from energon_infer.demo import write_random_llama

    root = tmp_path_factory.mktemp("memlimit")
    path = write_random_llama(root / "llama", vocab=8000, hidden=768, layers=6, heads=12, kv_heads=4,
                              intermediate=2048, max_positions=512)
    (path / "tokenizer.json").unlink()  # token ids in and out: the server's logprobs name each token's id
    (root / "child.py").write_text(_CHILD)
    yield path
    shutil.rmtree(root, ignore_errors=True)


def _engine(model: Path, limit: int, *budget: str, name: str):
    return run_limited([sys.executable, str(model.parent / "child.py"), str(model), *budget], limit,
                       name=f"energon-{name}", timeout=300)


@pytest.fixture(scope="module")
def unlimited(model):
    run = _engine(model, 16 * 2**30, name="unlimited")
    assert run.returncode == 0 and not run.oom_killed, run.stderr[-3000:]
    assert run.peak_bytes > LIMIT  # the limit below is smaller than what it uses unlimited
    return last_json_line(run.stdout)


def _check_fits(run, unlimited: dict) -> dict:
    from tightfit.planner.serving import ServingPlan

    assert not run.oom_killed and run.returncode == 0, run.stderr[-3000:]
    out = last_json_line(run.stdout)
    assert out["tokens"] == unlimited["tokens"]  # exact against the unlimited run
    plan = ServingPlan.from_json(out["plan"])
    assert plan.streams and plan.where.startswith("the memory limit")  # the limit was read, layers stream
    lines = dict(plan.lines[0])
    assert lines["total"] <= lines["this rank's share of the limit"]
    assert [(b["what"], b["bytes"]) for b in out["budget"]] == list(plan.lines[0])  # memory_report() carries it
    assert "interpreter, libraries and runtime" in run.stderr and "KV cache" in run.stderr  # explain(), per line
    return out


@pytest.fixture(scope="module")
def default_run(model):
    """The engine under ``LIMIT`` with no budget given: one run, which two tests below check from two sides."""
    return _engine(model, LIMIT, name="default")


def test_with_no_budget_it_fits_the_limit_and_streams_exact_tokens(default_run, unlimited):
    _check_fits(default_run, unlimited)


def test_a_budget_given_is_kept_and_lookahead_chosen_within_it(model, unlimited):
    from tightfit.planner.serving import ServingPlan

    out = _check_fits(_engine(model, LIMIT, "130MiB", name="given"), unlimited)
    plan = ServingPlan.from_json(out["plan"])
    assert plan.pools[0].device_bytes <= 130 * MiB and plan.lookahead < 2  # 3 slots of 24 MiB would not fit


@pytest.mark.parametrize("limit, flags, match", [
    (TOO_SMALL, [], r"the least-memory serving plan .* needs .* but the memory limit .* leaves .*; cheapest change: "
                    r"quantized weights \(--quantization int8\)"),
    (TOO_SMALL, ["--max-batch-tokens", "4096"], r"max_batch_tokens 4096\) needs .*; cheapest change: a smaller "
                                                r"--max-batch-tokens"),  # given: kept, and named as the change
    (LIMIT + 100 * MiB, ["--memory-budget", "300MiB"], r"--memory-budget 300.00 MiB for each worker's weights is more than the "
                                           r".* lower it to"),
], ids=["limit-too-small", "token-budget-given", "budget-over-the-limit"])
def test_serve_refuses_an_infeasible_limit_in_one_line_with_exit_code_3(model, limit, flags, match):
    tightfit = Path(sys.executable).with_name("tightfit")
    run = run_limited([str(tightfit), "serve", str(model), "--port", "0", *flags], limit, name="energon-refuse",
                      timeout=120)
    assert not run.oom_killed and run.returncode == 3, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("tightfit serve:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.search(match, errors[0]), errors[0]


def _oom_kills(group: Path) -> int:
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def test_serve_with_no_budget_fits_the_limit_and_answers_the_unlimited_tokens(model, unlimited):
    """``tightfit serve DIR`` as a user starts it, in a cgroup of its own: it comes up and answers greedy tokens equal
    to the unlimited engine's, and the group's OOM killer never fires."""
    import httpx

    group = CGROUP_V1_MEMORY / f"tightfit-energon-serve-{os.getpid()}"
    group.mkdir()
    proc = None
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT + 100 * MiB))  # serve's HTTP stack needs a little more

        def join() -> None:  # in the child, before exec: the server and its workers are all counted
            (group / "cgroup.procs").write_text(str(os.getpid()))

        port = free_port()
        proc = subprocess.Popen([str(Path(sys.executable).with_name("tightfit")), "serve", str(model), "--port",
                                 str(port), "--log-level", "warning"], preexec_fn=join, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
        while True:
            assert proc.poll() is None and _oom_kills(group) == 0, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        tokens = []
        for prompt in ([5, 6, 7, 8], [9, 10]):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})
            assert r.status_code == 200, r.text
            tokens.append([int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]])
        assert tokens == unlimited["tokens"][:2]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log = proc.stdout.read()
        assert _oom_kills(group) == 0
        assert "layers kept in memory" in log and "read from disk each pass" in log  # the plan, printed at start
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


_FLOORS = """
import json, sys
from energon_infer.engine.engine_config import engine_config
from energon_infer.engine.memory_plan import WORKER_RUNTIME_BYTES, stage_shapes, worker_baseline_bytes
from energon_infer.loading.config import load_config
from tightfit.memory_limit import read_memory
from tightfit.planner.errors import PlanInfeasibleError
from tightfit.planner.serving import plan_serving
from tightfit.profiler.types import DiskProfile

path = sys.argv[1]
cfg, model = engine_config(None, dtype="float32"), load_config(path)
rt, sched = cfg.runtime, cfg.scheduler
floors = {}
for packed, tables in ((True, ()), (True, ("embed",)), (False, ("embed",)), (True, ("embed", "lm_head")),
                       (False, ("embed", "lm_head"))):
    shapes = stage_shapes(path, model, tp=1, pp=1, dtype="float32", io_threads=2, quant=None, packed=packed,
                          tables=tables)
    try:
        plan_serving(shapes, free_bytes=0, worker_bytes=worker_baseline_bytes() + WORKER_RUNTIME_BYTES,
                     max_batch_tokens=sched.max_batch_tokens, kv_cache_tokens=rt.kv_cache_tokens,
                     block_size=rt.block_size, max_running=sched.max_running,
                     disk=DiskProfile(path=path, free_bytes=2**40, read_fit=(1e-4, 1e9)))
    except PlanInfeasibleError as exc:
        floors["packed" * packed + "+".join(tables)] = exc.needed_bytes
reading = read_memory(settle=True)
print(json.dumps({"held": reading.usage - reading.reclaimable, **floors}))
"""


def test_each_step_down_gives_up_the_next_cheapest_thing_and_stays_exact(tmp_path):
    """A model with a large vocabulary under three limits, each between two of the plan's floors: where the tables
    held do not fit, the embedding is read from disk by row (the packed copies kept); lower, the packed copies give
    way too; lower still, the head is read from disk in chunks as well. Every run gives the unlimited run's tokens.
    Given ``packed_weights=True`` by name at the lowest limit, the copies are kept and the head read from disk."""
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "wide", vocab=32000, hidden=768, layers=2, heads=12, kv_heads=4,
                              intermediate=2048, max_positions=512)
    (tmp_path / "floors.py").write_text(_FLOORS)
    (tmp_path / "child.py").write_text(_CHILD)
    measured = run_limited([sys.executable, str(tmp_path / "floors.py"), str(path)], 16 * 2**30, name="energon-floors",
                           timeout=120)
    assert measured.returncode == 0, measured.stderr[-3000:]
    f = last_json_line(measured.stdout)
    table = 32000 * 768 * 4
    assert f["packed"] - f["packedembed"] > table - MiB  # the embedding read by row saves the table
    assert f["embed+lm_head"] < f["embed"]  # the least-memory plan
    free = run_limited([sys.executable, str(tmp_path / "child.py"), str(path)], 16 * 2**30, name="energon-wide",
                       timeout=300)
    assert free.returncode == 0, free.stderr[-3000:]
    expected = {"packed": True, "tables": ["embed"]}, {"packed": False, "tables": ["embed"]}, \
        {"packed": False, "tables": ["embed", "lm_head"]}
    bounds = (f["packedembed"], f["packed"]), (f["embed"], f["packedembed"]), \
        (f["embed+lm_head"], f["embed"])
    for (low, high), want in zip(bounds, expected):
        limit = f["held"] + (low + high) // 2
        run = run_limited([sys.executable, str(tmp_path / "child.py"), str(path)], limit, name="energon-wide",
                          timeout=300)
        assert not run.oom_killed and run.returncode == 0, run.stderr[-3000:]
        out = last_json_line(run.stdout)
        assert out["tokens"] == last_json_line(free.stdout)["tokens"]
        assert {"packed": out["packed"], "tables": out["tables"]} == want
        what = "embedding read from disk; the rest" if want["tables"] == ["embed"] else \
            "embedding and head read from disk; the rest"
        assert what in {b["what"] for b in out["budget"]}
    # Named by the caller, the packed copies are never given up: the head goes to disk instead (every layer streams
    # at this limit, and a streamed layer has no packed copy, so this plan needs little more).
    given = run_limited([sys.executable, str(tmp_path / "child.py"), str(path)], limit, name="energon-wide",
                        timeout=300, env={**os.environ, "CHILD_OPTIONS": '{"packed_weights": true}'})
    assert not given.oom_killed and given.returncode == 0, given.stderr[-3000:]
    out = last_json_line(given.stdout)
    assert (out["packed"], out["tables"]) == (True, ["embed", "lm_head"])
    assert out["tokens"] == last_json_line(free.stdout)["tokens"]


def test_plan_serve_prints_the_plan_the_engine_then_runs(model, default_run, tmp_path):
    """``tightfit plan serve DIR`` under the limit, before anything loads, shows the plan the engine started under the
    same limit runs: the same layers read from disk, lookahead and token budget."""
    from tightfit.planner.serving import ServingPlan

    tightfit = Path(sys.executable).with_name("tightfit")
    shown = run_limited([str(tightfit), "plan", "serve", str(model), "--json", str(tmp_path / "plan.json")], LIMIT,
                        name="energon-plan", timeout=120)
    assert shown.returncode == 0 and not shown.oom_killed, shown.stderr[-3000:]
    assert "read from disk each pass" in shown.stdout and "the memory limit" in shown.stdout
    printed = ServingPlan.from_json(json.dumps(json.loads((tmp_path / "plan.json").read_text())["serving"]))
    assert default_run.returncode == 0, default_run.stderr[-3000:]  # the engine started under the same limit
    ran = ServingPlan.from_json(last_json_line(default_run.stdout)["plan"])
    assert printed.streams and [p.disk_layers for p in printed.pools] == [p.disk_layers for p in ran.pools]
    assert (printed.lookahead, printed.max_batch_tokens) == (ran.lookahead, ran.max_batch_tokens)
