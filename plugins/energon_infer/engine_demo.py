"""The engine part of ``tightfit demo``: start an engine, serve it over HTTP, answer a few requests.

It serves the GPT the Elixir demo trained when its checkpoint is there (``$TIGHTFIT_ELIXIR_CHECKPOINT``,
else ``runs/elixir_demo/model.safetensors`` (with the ``config.json`` the example writes beside it),
or the newest ``*.safetensors`` / ``*.ckpt`` file there, in the working directory or the source checkout), and otherwise a tiny random LLaMA-architecture model saved to a
temporary directory. Three prompts go to the engine at once (continuously batched), one more
through ``POST /v1/completions`` on 127.0.0.1 with a real HTTP client.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

__all__ = ["find_elixir_checkpoint", "run_engine_demo"]

PROMPTS = ["the controller sends a step", "every rank holds", "models larger than the hardware"]


def find_elixir_checkpoint() -> Path | None:
    """The Elixir demo's exported checkpoint file, if one exists (see the module docstring)."""
    env = os.environ.get("TIGHTFIT_ELIXIR_CHECKPOINT")
    if env:
        return Path(env) if Path(env).is_file() else None
    roots = [Path.cwd() / "runs" / "elixir_demo", Path(__file__).resolve().parents[2] / "runs" / "elixir_demo"]
    for root in roots:
        # The example exports model.safetensors + config.json; its last.ckpt is a sharded directory.
        if (root / "model.safetensors").is_file():
            return root / "model.safetensors"
        if root.is_dir():
            files = [p for pattern in ("*.safetensors", "*.ckpt") for p in root.glob(pattern) if p.is_file()]
            if files:
                return max(files, key=lambda p: p.stat().st_mtime)
    return None


def run_engine_demo(quick: bool = True) -> str:
    import httpx

    from energon_infer.engine.engine import Engine
    from energon_infer.sampling import SamplingParams
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    ckpt = find_elixir_checkpoint()
    with tempfile.TemporaryDirectory(prefix="energon-engine-demo-") as tmp:
        start = time.perf_counter()
        if ckpt is not None:
            print(f"[engine] serving the Elixir demo's GPT from {ckpt}")
            engine = Engine.from_lightning_checkpoint(ckpt, progress=False, threads_per_worker=1)
            what = f"the Elixir-trained GPT ({ckpt.name})"
        else:
            from energon_infer.demo import write_random_llama

            path = write_random_llama(tmp, layers=2)
            print("[engine] no Elixir demo checkpoint found (runs/elixir_demo/); serving a tiny random model")
            engine = Engine.from_pretrained(path, progress=False, tp=1 if quick else 2, threads_per_worker=1)
            what = f"a tiny random LLaMA on tp={1 if quick else 2}"
        loaded = time.perf_counter() - start
        with engine:
            # Seeded sampling: each request draws from its own generator, so the answers do not depend on
            # what else is batched with them, and the HTTP request below (seed 0) must repeat the first one.
            params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=12, ignore_eos=True)
                      for i in range(len(PROMPTS))]
            t0 = time.perf_counter()
            futures = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
            outs = [f.result(timeout=120) for f in futures]
            seconds = time.perf_counter() - t0
            for prompt, c in zip(PROMPTS, outs):
                print(f"  [engine] {prompt!r} => {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason}, "
                      f"{c.latency_s * 1e3:.0f} ms)")
            with BackgroundServer(engine, ServerConfig(port=0)) as server:
                reply = httpx.post(server.url + "/v1/completions", timeout=60,
                                   json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0.8, "top_k": 20,
                                         "seed": 0, "ignore_eos": True})
                reply.raise_for_status()
                http_text = reply.json()["choices"][0]["text"]
                print(f"  [http] POST {server.url}/v1/completions => {http_text!r}")
            same = http_text == outs[0].text
        tokens = sum(len(c.token_ids) for c in outs)
        return (f"engine served {what}: {len(outs)} concurrent requests, {tokens} tokens in {seconds:.2f} s "
                f"(workers up in {loaded:.1f} s); HTTP /v1/completions {'matched' if same else 'DIFFERED from'} "
                "the engine's answer")
