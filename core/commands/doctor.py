"""``tightfit doctor``: versions of the stack and what is usable on this machine.

Each framework is imported in a child process with a time limit, so a library that crashes on
import (a CUDA build of FBGEMM on a CPU torch, DeepSpeed's JIT ops) is reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from importlib import metadata

from tightfit.units import format_table

# (label, distribution, import name, what it enables)
CHECKS = [
    ("torch", "torch", "torch", "everything"),
    ("Triton", "triton", "triton", "tightfit.cuda kernels on CUDA; interpreter tests on CPU"),
    ("Lightning", "lightning", "lightning", 'Trainer(strategy="elixir" | "sky")'),
    ("TorchRec", "torchrec", "torchrec", "torchrec_cache"),
    ("FBGEMM (CPU)", "fbgemm-gpu-cpu", "fbgemm_gpu", "TorchRec's kernels"),
    ("DeepSpeed", "deepspeed", "deepspeed", 'ElixirDeepSpeedStrategy (strategy="elixir_deepspeed"), baselines'),
    ("transformers", "transformers", "transformers", "reference models for energon_infer tests"),
    ("safetensors", "safetensors", "safetensors", "loading model weights"),
    ("FastAPI", "fastapi", "fastapi", "tightfit serve"),
    ("uvicorn", "uvicorn", "uvicorn", "tightfit serve"),
]

_PROBE = """
import json, sys, time
t = time.time()
import {module} as m
print(json.dumps({{"ok": True, "seconds": round(time.time() - t, 2)}}))
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per import (default 120)")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _probe(module: str, timeout: float) -> tuple[bool, str]:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE.format(module=module)],
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, f"import did not finish in {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return False, (lines[-1] if lines else f"import exited with code {proc.returncode}")[:160]
    return True, "imports"


def _torch_facts() -> dict[str, object]:
    import torch

    facts: dict[str, object] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "cpu_threads": torch.get_num_threads(),
        "devices": [],
    }
    if torch.cuda.is_available():
        facts["devices"] = [
            f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())
        ]
    return facts


def facts_devices(report: dict[str, object]) -> list[str]:
    devices = report.get("devices")
    return [str(d) for d in devices] if isinstance(devices, list) else []


def run(args: argparse.Namespace) -> int:
    rows = []
    report: dict[str, object] = {"python": sys.version.split()[0]}
    for i, (label, dist, module, enables) in enumerate(CHECKS, 1):
        print(f"[doctor] {i}/{len(CHECKS)} checking {label} ...", file=sys.stderr, flush=True)
        version = _version(dist)
        if version is None:
            ok, detail = False, "not installed (pip install 'tightfit[all]')"
        else:
            ok, detail = _probe(module, args.timeout)
        rows.append((label, version or "-", "yes" if ok else "no", enables if ok else detail))
        report[label] = {"version": version, "usable": ok, "detail": detail}
    report.update(_torch_facts())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"python {report['python']}, torch {report['torch']}, CUDA available: {report['cuda_available']}"
          f" (CUDA {report['cuda_version']}), gloo: {report['gloo']}, NCCL: {report['nccl']},"
          f" CPU threads: {report['cpu_threads']}")
    for dev in facts_devices(report):
        print(f"  device: {dev}")
    print(format_table(rows, ("package", "version", "usable", "enables / why not")))
    return 0
