"""How long a user waits before tightfit answers: help texts, and a small model's server until it serves.

Question: does ``tightfit --help`` / ``tightfit serve --help`` answer in under a second, and is a small model's
server ready within 3 s of its imports? Targets: help < 1 s (median); server ready minus imports < 3 s (median).

Each round runs, as a user would from a shell (a fresh process each, all the cores this process has, in an order
rotated by one every round):
    * ``tightfit --help`` and ``tightfit serve --help``: wall time to exit.
    * imports: ``python -c "import energon_infer.serving.serve, energon_infer.engine.engine,
      energon_infer.serving.server"``, the modules a server start loads before it reads the model.
    * serve: ``tightfit serve DIR --port P`` on a random LLaMA (2 layers, width 64, written once by
      ``energon_infer.demo.write_random_llama``), wall time from the spawn until ``GET /health`` answers 200;
      then the server is stopped with SIGINT. "ready after imports" is serve minus the round's imports.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.common import ROOT, parser, summarize, write_result

NAME = "energon_startup"
TIGHTFIT = str(Path(sys.executable).with_name("tightfit"))
IMPORTS = "import energon_infer.serving.serve, energon_infer.engine.engine, energon_infer.serving.server"
HELP_TARGET_S, READY_TARGET_S = 1.0, 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return time.perf_counter() - start


def _serve_until_ready(model: Path) -> float:
    port = _free_port()
    start = time.perf_counter()
    proc = subprocess.Popen([TIGHTFIT, "serve", str(model), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tightfit serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.02)
            if time.perf_counter() - start > 300:
                raise TimeoutError("tightfit serve was not ready within 300 s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _measured() -> list[str]:
    """The code the timed processes run: energon and core (the CLI, plugin discovery, what the engine imports)."""
    return sorted(str(p.relative_to(ROOT)) for d in ("plugins/energon_infer", "core") for p in (ROOT / d).rglob("*.py"))


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 9)
    from energon_infer.demo import write_random_llama

    contenders = {
        "tightfit --help": lambda: _timed([TIGHTFIT, "--help"]),
        "tightfit serve --help": lambda: _timed([TIGHTFIT, "serve", "--help"]),
        "imports": lambda: _timed([sys.executable, "-c", IMPORTS]),
        "serve until ready": lambda: _serve_until_ready(model),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_llama(Path(tmp) / "small-llama", layers=2, hidden=64, heads=4, kv_heads=2,
                                   intermediate=128)
        names = list(contenders)
        for r in range(repeats + 1):  # round 0 warms the page cache and is not kept
            for name in names[r % len(names):] + names[:r % len(names)]:
                t = contenders[name]()
                if r:
                    times[name].append(t)
            print(f"[{NAME}] round {r}/{repeats}: " + ", ".join(
                f"{k} {v[-1]:.2f} s" for k, v in times.items() if v and r), flush=True)
    ready = [s - i for s, i in zip(times["serve until ready"], times["imports"])]
    stats = {k: summarize(v) for k, v in times.items()} | {"ready after imports": summarize(ready)}
    met = {
        "tightfit --help": stats["tightfit --help"]["median"] < HELP_TARGET_S,
        "tightfit serve --help": stats["tightfit serve --help"]["median"] < HELP_TARGET_S,
        "ready after imports": stats["ready after imports"]["median"] < READY_TARGET_S,
    }
    targets = {"tightfit --help": HELP_TARGET_S, "tightfit serve --help": HELP_TARGET_S,
               "ready after imports": READY_TARGET_S}
    rows = []
    for k, s in stats.items():
        target = (f"< {targets[k]:.0f} s: {'met' if met[k] else 'missed'}") if k in targets else ""
        rows.append(f"| {k} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} | {target} |")
    markdown = "\n".join([
        f"Wall seconds per start, {repeats} rounds (fresh processes, order rotated each round; round 0 not kept), "
        f"{os.cpu_count()} CPUs. The server serves a random 2-layer LLaMA of width 64.",
        "",
        "| what | median s | min-max s | target |",
        "|---|---|---|---|",
        *rows,
    ])
    write_result(NAME, title="Startup: help texts and a small model's server until ready",
                 params={"repeats": repeats, "imports": IMPORTS, "cwd": str(ROOT)},
                 results={"seconds": times, "stats": stats, "targets_met": met,
                          "ready_after_imports_median": statistics.median(ready)},
                 markdown=markdown, measures=_measured())
    return 0


if __name__ == "__main__":
    sys.exit(main())
