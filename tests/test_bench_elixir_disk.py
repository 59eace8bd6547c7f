"""benchmarks/elixir_disk.py: what it measures is measured right (bytes from /proc/self/io, the warm-up step left
out, the disk fraction, the bit-for-bit check), it is in the suite, and (slow) its quick mode writes its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_runs_it_and_not_its_helpers():
    from benchmarks.run import discover

    names = discover()
    assert "elixir_disk" in names
    assert "memlimit" not in names and "_elixir_disk_child" not in names


def test_step_clock_counts_the_bytes_this_process_writes_to_disk(tmp_path):
    from benchmarks._elixir_disk_child import StepClock

    clock = StepClock()
    clock.start()
    payload = os.urandom(8 << 20)
    clock.backward_done()
    with open(tmp_path / "f", "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    clock.end(1.5)
    (step,) = clock.steps
    assert step["loss"] == 1.5 and step["wall_s"] >= step["opt_s"] > 0
    assert step["opt_write_bytes"] >= len(payload) and step["write_bytes"] >= step["opt_write_bytes"]


def test_step_clock_splits_the_cpu_between_the_stores_threads_and_the_rest():
    import threading
    import time

    from benchmarks._elixir_disk_child import StepClock

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, stop = threading.Event(), threading.Event()

    def worker() -> None:  # named as the store's pool names its threads; alive (idle) until the step ends
        spin(0.2)
        spun.set()
        stop.wait()

    clock = StepClock()
    clock.start()
    thread = threading.Thread(target=worker, name="tightfit-io_0")
    thread.start()
    assert spun.wait(30)
    spin(0.15)  # this (main) thread: "other"
    clock.backward_done()
    spin(0.3)
    clock.end(1.0)
    stop.set()
    thread.join()
    (step,) = clock.steps
    # CPU time is counted in clock ticks (10 ms): each spin shows within a few of them.
    assert step["io_cpu_fwd_bwd_s"] >= 0.15 and step["other_cpu_fwd_bwd_s"] >= 0.1
    assert step["io_cpu_opt_s"] <= 0.05 and step["other_cpu_opt_s"] >= 0.25


def _run(steps: list[tuple[float, float, int, int]], ok: bool = True, peak: int = 1 << 30, oom: bool = False) -> dict:
    return {"ok": ok, "steps": [{"wall_s": w, "opt_s": o, "read_bytes": r, "write_bytes": wr, "opt_read_bytes": r,
                                  "opt_write_bytes": wr, "loss": 2.0} for w, o, r, wr in steps],
            "limit": {"peak_bytes": peak, "oom_killed": oom, "capped": True, "enforced": True}}


def test_analyse_leaves_the_warm_up_step_out_and_prices_the_phase_against_the_profile():
    from benchmarks.elixir_disk import analyse
    from tightfit.profiler.types import DiskProfile

    disk = DiskProfile(path="/d", free_bytes=1 << 40, read_fit=(0.0, 1e9), write_fit=(0.0, 2e9))
    plan = type("P", (), {"step_time_s": 3.0, "disk_bytes_per_rank": 10**9})()
    runs = {"elixir disk": [_run([(99.0, 50.0, 0, 0), (4.0, 2.0, 10**9, 10**9), (4.0, 2.0, 10**9, 10**9)])],
            "ram": [_run([(1.0, 0.5, 0, 0), (2.0, 1.0, 0, 0)], oom=True)]}
    stats = analyse(runs, disk, plan)
    el = stats["elixir disk"]
    assert el["step_s"]["median"] == 4.0 and el["step_s"]["n"] == 2  # the 99 s warm-up step is not counted
    # 1 GB read at 1 GB/s + 1 GB written at 2 GB/s = 1.5 s of profiled disk time in a 2 s phase
    assert el["disk_fraction"]["median"] == pytest.approx(0.75)
    assert el["prediction_error"] == pytest.approx(0.25) and el["predicted_disk_bytes_per_step"] == 2 * 10**9
    assert stats["ram"]["disk_fraction"] is None and stats["ram"]["oom_killed"] is True


def test_deepspeed_is_compared_with_elixir_repeat_by_repeat():
    """DeepSpeed's step over Elixir's is paired by repeat (the same tokens): the median of the per-repeat ratios,
    not of the medians; the uncapped DeepSpeed run pairs with the repeat it ran in."""
    from benchmarks._elixir_disk_report import DS_UNCAPPED, vs_elixir
    from benchmarks.elixir_disk import analyse
    from tightfit.profiler.types import DiskProfile

    disk = DiskProfile(path="/d", free_bytes=1 << 40, read_fit=(0.0, 1e9), write_fit=(0.0, 2e9))
    plan = type("P", (), {"step_time_s": 3.0, "disk_bytes_per_rank": 10**9})()
    runs = {"elixir disk": [_run([(9.0, 1.0, 0, 0), (2.0, 1.0, 0, 0)]), _run([(9.0, 1.0, 0, 0), (4.0, 1.0, 0, 0)])],
            "deepspeed nvme": [_run([(9.0, 1.0, 0, 0), (6.0, 1.0, 0, 0)]), _run([], ok=False, oom=True)],
            DS_UNCAPPED: [{**_run([(9.0, 1.0, 0, 0), (5.0, 1.0, 0, 0)]), "repeat": 1}]}
    stats = analyse(runs, disk, plan)
    assert stats["elixir disk"]["repeat_step_s"] == {"0": 2.0, "1": 4.0}
    capped = vs_elixir(stats, "deepspeed nvme")
    assert capped["ratios"] == [3.0] and capped["wins"] == 1  # only repeat 0 finished under the limit
    assert vs_elixir(stats, DS_UNCAPPED)["ratios"] == [1.25]   # paired with repeat 1's Elixir step, not repeat 0's
    assert vs_elixir(stats, "ram") is None


def test_exactness_is_bit_for_bit_and_names_what_differs():
    from benchmarks.elixir_disk import exactness

    def run(losses, digests):
        return {"ok": True, "steps": [{"loss": x} for x in losses], "digests": digests}

    same = {"elixir disk": [run([2.0, 1.5], {"a": "1", "b": "2"})], "ram": [run([2.0, 1.5], {"a": "1", "b": "2"})]}
    assert exactness(same)["exact"] is True
    weights = {"elixir disk": [run([2.0, 1.5], {"a": "1", "b": "3"})], "ram": [run([2.0, 1.5], {"a": "1", "b": "2"})]}
    out = exactness(weights)
    assert out["exact"] is False and out["per_repeat"][0]["params_differing"] == ["b"]
    losses = {"elixir disk": [run([2.0, 1.5000001], {"a": "1"})], "ram": [run([2.0, 1.5], {"a": "1"})]}
    assert exactness(losses)["exact"] is False
    failed = {"elixir disk": [{"ok": False}], "ram": [run([2.0], {"a": "1"})]}
    assert exactness(failed)["exact"] is False  # nothing compared is not exact


def test_the_deepspeed_peer_is_configured_as_zero_infinity_with_the_profiled_aio(tmp_path):
    from benchmarks.elixir_disk import deepspeed_config, model_config
    from tightfit.profiler.disk_presets import disk_preset

    cfg = model_config(quick=True)
    disk = disk_preset("nvme-gen3", path=str(tmp_path), free_bytes=1 << 40)
    ds = deepspeed_config(cfg, disk, tmp_path, 1e-3, 1 << 30)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "nvme"
    assert not zero["offload_optimizer"]["pin_memory"] and not zero["offload_param"]["pin_memory"]
    assert zero["offload_param"]["buffer_size"] >= cfg["vocab_size"] * cfg["hidden"]  # holds the largest parameter
    assert ds["optimizer"]["params"]["torch_adam"] is True
    # Buffers for half the model's parameter tensors and 16 more (fewer failed in the first forward, see
    # param_buffers), counted on the model itself, at both sizes.
    from benchmarks.elixir_disk import param_buffers
    from tightfit.models import GPTConfig, build_gpt

    for c in (cfg, model_config(quick=False)):
        tensors = len(list(build_gpt(GPTConfig(**c), device="meta").parameters()))
        assert param_buffers(c) == tensors // 2 + 16
    assert zero["offload_param"]["buffer_count"] == param_buffers(cfg)
    assert (ds["aio"]["block_size"], ds["aio"]["queue_depth"]) == (disk.request_bytes, disk.queue_depth)


def test_a_terminated_run_removes_its_work_directory(tmp_path):
    """SIGTERM while the run is under way (its work directory made): the process exits 143 and leaves nothing."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.elixir_disk", "--quick", "--dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not list(tmp_path.glob("tightfit-elixir-disk-*")) and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        assert list(tmp_path.glob("tightfit-elixir-disk-*")), "the run never made its work directory"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert not list(tmp_path.glob("tightfit-elixir-disk-*"))


def test_quick_mode_writes_its_result(tmp_path):
    """The whole quick run (three contenders in their own processes, under the limit where root): the JSON the
    report is built from has every contender's repeats, the limit and the targets."""
    env = {**os.environ, "TIGHTFIT_BENCH_RESULTS": str(tmp_path / "results")}
    run = subprocess.run([sys.executable, "-m", "benchmarks.elixir_disk", "--quick", "--dir", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "results" / "elixir_disk.json").read_text())
    res = data["results"]
    assert set(res["runs"]) >= {"elixir disk", "ram"}
    assert res["stats"]["ram"]["step_s"]["n"] >= 1
    assert data["params"]["limit"] > 0 and data["params"]["commit"]
    assert "| contender |" in data["markdown"] and "Targets (ratios to DeepSpeed paired" in data["markdown"]
    assert set(res["headline"]["targets_met"]) == {"exact", "prediction", "disk", "deepspeed", "never_killed",
                                                   "state_3x_limit"}
    assert not list(tmp_path.glob("tightfit-elixir-disk-*"))  # its stores and swap files are removed


def test_the_child_starts_again_when_its_rendezvous_port_is_taken(tmp_path):
    """Lightning binds port 0 and closes it to choose MASTER_PORT; when another process takes the port before the
    store listens (EADDRINUSE, seen in CI), the child trains on a new port instead of failing. Here the port is
    taken for certain: MASTER_PORT names one this test holds."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    cfg = {"vocab_size": 64, "n_positions": 8, "hidden": 32, "layers": 1, "heads": 2, "name": "gpt-port"}
    spec = {"role": "ram", "config": cfg, "batch": 1, "seq": 8, "steps": 2, "seed": 0, "lr": 1e-3, "plan": None,
            "work_dir": str(tmp_path), "disk_dir": str(tmp_path), "threads": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(held.getsockname()[1]),
           "PYTHONWARNINGS": "ignore"}
    try:
        run = subprocess.run([sys.executable, "-m", "benchmarks._elixir_disk_child", str(tmp_path / "spec.json")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        held.close()
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ok"], out.get("traceback")
    assert len(out["steps"]) == 2
