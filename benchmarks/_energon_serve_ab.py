"""A paired A/B of one serving change, read from the engine's own time account (not a timed benchmark).

    python -m benchmarks._energon_serve_ab [--change text|budget] [--rounds 6] [--requests 32] [--concurrency 16]

The benchmark's model (``benchmarks.energon_serve.make_model``) behind an in-process server; each round sends the
same requests (streamed, ``ignore_eos``) once with each side of the change, the order alternating, and prints each
side's account (the medians over the rounds) and the client's mean time to first token. ``--change text``: the
frontend decoding the text outside the controller's lock (B, the default) against the scheduler decoding every
request's text under it (A, as before); it also times ``Engine.encode`` on the server's already-encoded ids against a
plain list of the same ids (the second pass over each prompt the server used to make). ``--change budget``:
``token_budget`` ``"fixed"`` (A) against ``"measured"`` (B).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.energon_serve import make_model


def _round(url: str, bodies: list[dict], concurrency: int) -> float:
    """Send ``bodies`` over ``concurrency`` connections; the mean time to first token (s)."""
    todo = list(bodies)
    lock = threading.Lock()
    ttft: list[float] = []

    def run() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    body = todo.pop()
                t0 = time.perf_counter()
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    for i, _ in enumerate(r.iter_bytes()):
                        if i == 0:
                            first = time.perf_counter() - t0
                with lock:
                    ttft.append(first)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.mean(ttft)


def main() -> None:
    from energon_infer.engine.engine import Encoded, Engine
    from energon_infer.serving.server import BackgroundServer, ServerConfig

    p = argparse.ArgumentParser()
    p.add_argument("--change", choices=("text", "budget"), default="text")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    model = make_model(Path(tempfile.mkdtemp()) / "model")
    words = (Path(__file__).resolve().parent.parent / "README.md").read_text().split()
    bodies = [{"prompt": " ".join(words[i * 7: i * 7 + 100]), "max_tokens": 32 + i % 32, "ignore_eos": True,
               "stream": True} for i in range(args.requests)]
    names = (("A: text under the lock", "B: text outside it") if args.change == "text"
             else ("A: token_budget fixed", "B: token_budget measured"))
    sides: dict[str, list[dict]] = {name: [] for name in names}
    with Engine.from_pretrained(model, progress=False) as engine, BackgroundServer(engine, ServerConfig(port=0)) as srv:
        _round(srv.url, bodies[:4], 4)  # warm-up
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                if args.change == "text":
                    engine.scheduler.stop_text_only = side.startswith("B")  # read as each request is queued
                else:
                    engine.scheduler.budget.mode = "measured" if side.startswith("B") else "fixed"
                engine.account(reset=True)
                ttft = _round(srv.url, bodies, args.concurrency)
                sides[side].append({**engine.account(), "ttft": ttft})
        ids = engine.encode(bodies[0]["prompt"])
        plain = list(ids)
        took: dict[str, list[float]] = {"encoded": [], "plain list": []}
        for _ in range(200):
            for name, arg in (("encoded", ids), ("plain list", plain)):
                t0 = time.perf_counter_ns()
                engine.encode(arg)
                took[name].append(time.perf_counter_ns() - t0)
        assert isinstance(ids, Encoded)
    for side, views in sides.items():
        def med(kind: str, part: str, views: list[dict] = views) -> float:
            return statistics.median(v[kind]["mean_s"][part] * 1e3 for v in views)

        walls = statistics.median(v["requests"]["wall_mean_s"] * 1e3 for v in views)
        print(f"{side}: step complete {med('steps', 'complete'):.3f} ms, hand_off {med('steps', 'hand_off'):.3f} ms, "
              f"forward {med('steps', 'forward'):.3f} ms; request loop {med('requests', 'loop'):.3f} ms, "
              f"detokenize {med('requests', 'detokenize'):.3f} ms, queue {med('requests', 'queue'):.1f} ms, wall "
              f"{walls:.1f} ms, client TTFT {statistics.median(v['ttft'] for v in views) * 1e3:.1f} ms, "
              f"{statistics.median(v['steps']['tokens_mean'] for v in views):.1f} tokens a step "
              f"(medians of {len(views)} rounds)")
    for name, ns in took.items():
        print(f"Engine.encode of {len(plain)} ids, {name}: median {statistics.median(ns) / 1e3:.1f} us")


if __name__ == "__main__":
    main()
