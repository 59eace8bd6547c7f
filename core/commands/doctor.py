"""``tightfit doctor``: versions of the stack and what is usable on this machine.

By default nothing heavy is imported (versions from package metadata, importability from the
module finders, the CUDA build from ``torch/version.py``, GPUs from ``nvidia-smi -L``), so it answers
in about a second. ``--imports`` also imports each framework in a child process, one after another in
the order of :data:`CHECKS` (torch first, which most of them import in turn: it is loaded once), each with
a time limit (a library that crashes the child on import, such as a CUDA build of FBGEMM on a CPU torch,
or hangs, is reported, not fatal, and a new child goes on with the packages after it) and asks torch for
CUDA, gloo and NCCL: thorough, and slower.

The disk tier's row shows the cached disk profile (``tightfit profile disk PATH``) of the disk holding the
cache directory, or of ``--disk-dir D``: read and write speed, filesystem, free space now. Nothing is measured
here; without a cached profile the row says how to measure one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import IO

from tightfit.commands.args import UsageError
from tightfit.console import log, terminal_width
from tightfit.memory_limit import read_memory
from tightfit.units import format_bytes, format_table

__all__ = ["CHECKS", "add_arguments", "run"]

# (label, distribution, import name, what it enables)
CHECKS = [
    ("torch", "torch", "torch", "everything"),
    ("Triton", "triton", "triton", "tightfit's kernels on CUDA; interpreter tests on CPU"),
    ("Lightning", "lightning", "lightning", 'Trainer(strategy="elixir" | "sky")'),
    ("TorchRec", "torchrec", "torchrec", "torchrec_cache"),
    ("FBGEMM (CPU)", "fbgemm-gpu-cpu", "fbgemm_gpu", "TorchRec's kernels"),
    ("DeepSpeed", "deepspeed", "deepspeed", 'ElixirDeepSpeedStrategy (strategy="elixir_deepspeed"), baselines'),
    ("transformers", "transformers", "transformers", "reference models for energon_infer tests"),
    ("safetensors", "safetensors", "safetensors", "loading model weights"),
    ("tokenizers", "tokenizers", "tokenizers", "tightfit serve: text in and out"),
    ("Jinja2", "jinja2", "jinja2", "tightfit serve: chat templates (/v1/chat/completions)"),
    ("FastAPI", "fastapi", "fastapi", "tightfit serve"),
    ("uvicorn", "uvicorn", "uvicorn", "tightfit serve"),
    ("matplotlib", "matplotlib", "matplotlib", "--plot FILE, benchmark plots"),
    ("tqdm", "tqdm", "tqdm", "progress bars on a terminal"),
]

# The child's lines on stdout, each prefixed (a package that prints while it imports is not read as one).
_SAID = "[tightfit doctor probe] "
_PROBE = f"""
import importlib, sys
for module in sys.argv[1:]:
    print({_SAID!r} + "start " + module, flush=True)
    importlib.import_module(module)
    print({_SAID!r} + "ok " + module, flush=True)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    parser.add_argument("--imports", action="store_true",
                        help="also import each package in a child process and ask torch about CUDA, gloo and "
                             "NCCL (thorough, slower)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per import with --imports")
    parser.add_argument("--disk-dir", default=None, metavar="DIR",
                        help="show the cached disk profile of this directory's disk (default: the cache "
                             "directory's, ~/.cache/tightfit or $TIGHTFIT_CACHE_DIR)")


def _cache_dir() -> Path:
    # tightfit.profiler.device.cache_dir, repeated: importing tightfit.profiler imports torch (~3 s).
    env = os.environ.get("TIGHTFIT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tightfit"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (the cache directory may not exist yet: its disk does)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _read_disk_profile(f: Path, device: int) -> dict | None:
    """The fields the row shows from a cached DiskProfile file measured on ``device``; None for any other file."""
    try:
        text = f.read_text()
        if '"DiskProfile"' not in text[:200]:
            return None
        data = json.loads(text)
        path, key = data["path"], data.get("key", "")
        if not isinstance(path, str) or not path or not isinstance(key, str):
            return None
        # profile_disk's key starts with the filesystem's device ("disk 254:0 | ext4 ..."): it still names the
        # disk when the measured directory is gone (a temporary one)
        if not key.startswith(f"disk {os.major(device)}:{os.minor(device)} |") and (
                not os.path.exists(path) or os.stat(path).st_dev != device):
            return None  # measured on another disk
        read, write = float(data["read_fit"][1]), float(data["write_fit"][1])
        fs = data.get("filesystem", "")
    except (OSError, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return None  # unreadable: a cache file is skipped, never a crash
    if not (0 < read < float("inf") and 0 < write < float("inf")) or not isinstance(fs, str):
        return None
    return {"path": path, "read": read, "write": write, "filesystem": fs}


def _cached_disk(target: Path) -> tuple[dict | None, Path | None]:
    """The newest cached DiskProfile measured on the same filesystem as ``target`` (that directory's first)."""
    cache = _cache_dir()
    device = os.stat(target).st_dev
    found: list[tuple[bool, float, dict, Path]] = []
    for f in sorted(cache.glob("*.json")) if cache.is_dir() else ():
        data = _read_disk_profile(f, device)
        if data is not None:
            exact = os.path.realpath(data["path"]) == os.path.realpath(target)
            found.append((exact, f.stat().st_mtime, data, f))
    if not found:
        return None, None
    _, _, data, f = max(found, key=lambda x: (x[0], x[1]))
    return data, f


def _disk(disk_dir: str | None) -> tuple[tuple[str, str, str, str], dict[str, object]]:
    """The disk tier's row and JSON entry: a cached profile of ``disk_dir`` (default: the cache dir), or how to get one."""
    if disk_dir is not None and not Path(disk_dir).is_dir():
        raise UsageError(f"tightfit doctor: --disk-dir {disk_dir!r} is not a directory; give an existing directory "
                         "on the disk to report")
    target = _existing(Path(disk_dir) if disk_dir else _cache_dir())
    free = shutil.disk_usage(target).free
    data, f = _cached_disk(target)
    entry: dict[str, object] = {"path": str(target), "free_bytes": free, "measured": data is not None}
    if data is None:
        detail = (f"{format_bytes(free)} free in {target}; not measured: `tightfit profile disk {target} --quick` "
                  "(a few seconds) caches its speed")
        return ("disk tier", "-", "no", detail), {**entry, "detail": detail}
    fs, read, write = data["filesystem"] or "?", data["read"], data["write"]
    ram = ", RAM: saves no memory" if fs in ("tmpfs", "ramfs") else ""
    detail = (f"read {read / 1e9:.2f} GB/s, write {write / 1e9:.2f} GB/s, {fs}{ram}, {format_bytes(free)} free "
              f"in {target} (profile {f})")
    entry.update({"filesystem": fs, "read_bytes_per_s": read, "write_bytes_per_s": write, "profile": str(f),
                  "profiled_path": data["path"], "detail": detail})
    return ("disk tier", fs, "yes", detail), entry


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _lines_into(stream: IO[str] | None, lines: queue.Queue[str | None]) -> None:
    """Each line of ``stream`` into ``lines``, then None at its end."""
    for line in stream or ():
        lines.put(line)
    lines.put(None)


def _probe(modules: list[str], timeout: float, started: Callable[[str], None]) -> dict[str, tuple[bool, str]]:
    """``{module: (imports, detail)}``: ``modules`` imported in order in one child, ``started(module)`` called as
    each begins; where the child dies or ``timeout`` seconds pass inside one import, that module is reported and
    a new child takes the rest."""
    results: dict[str, tuple[bool, str]] = {}
    while len(results) < len(modules):
        rest = [m for m in modules if m not in results]
        proc = subprocess.Popen([sys.executable, "-c", _PROBE, *rest], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        said: queue.Queue[str | None] = queue.Queue()
        err: list[str] = []
        readers = [threading.Thread(target=_lines_into, args=(proc.stdout, said), daemon=True),
                   threading.Thread(target=err.extend, args=(proc.stderr or (),), daemon=True)]
        for t in readers:
            t.start()
        current = rest[0]  # before its first line the child is starting, which counts against the first import
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    line = said.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    results[current] = (False, f"import did not finish in {timeout:.0f} s")
                    break
                if line is None:  # the child is gone: it died inside ``current`` (or finished every import)
                    proc.wait()
                    readers[1].join()
                    if current not in results:
                        lines = [ln for ln in "".join(err).splitlines() if ln.strip()]
                        results[current] = (False, (lines[-1] if lines else
                                                    f"import exited with code {proc.returncode}")[:160])
                    break
                if line.startswith(_SAID):
                    word, module = line[len(_SAID):].split()
                    if word == "start":
                        current, deadline = module, time.monotonic() + timeout
                        started(module)
                    else:
                        results[module] = (True, "imports")
                        if all(m in results for m in rest):
                            break  # not waiting for its exit: a thread a package left running may hold it up
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _torch_build() -> dict[str, object]:
    """torch's version and CUDA build read from ``torch/version.py`` (importing torch takes ~3 s)."""
    facts: dict[str, object] = {"torch": _version("torch"), "cuda_version": None}
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        found = re.search(r"^__version__ = '([^']+)'", text, re.M)
        cuda = re.search(r"^cuda(?:: [^=]+)? = '([^']+)'", text, re.M)
        facts["torch"] = found.group(1) if found else facts["torch"]
        facts["cuda_version"] = cuda.group(1) if cuda else None
    return facts


def _gpus() -> list[str]:
    """GPU names from ``nvidia-smi -L`` (empty without it)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10)
    except (subprocess.TimeoutExpired, OSError):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.startswith("GPU")]


def _native(imports: bool) -> tuple[str, bool, str]:
    """``(compiler version, usable, detail)`` for the native CPU kernels (:mod:`tightfit.kernels.native`).

    Without ``--imports`` only the compiler is looked for (importing ``tightfit.kernels`` imports torch); with
    it the kernels are built (or found in the cache) as a first call would.
    """
    import os

    if os.environ.get("TIGHTFIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "-", False, "turned off (TIGHTFIT_NATIVE=0): the PyTorch reference runs on CPU"
    name = os.environ.get("CC", "cc")
    cc = shutil.which(name)
    if cc is None:
        return "-", False, f"no C compiler ({name} not found): install gcc or clang, or set CC; else the reference runs"
    try:
        line = (subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
                or [""])[0]
    except (OSError, subprocess.SubprocessError) as exc:
        return "-", False, f"{cc} --version failed ({exc})"
    found = re.search(r"\d+\.\d+(\.\d+)?", line)
    version = found.group(0) if found else "?"
    if imports:
        from tightfit.kernels.varlen_attention_cpu import native_attention_error

        why = native_attention_error()
        if why:
            return version, False, f"the kernels do not build: {why}"
    return version, True, "native CPU kernels: paged attention, SwiGLU, RMSNorm, rotary, KV store"


def _torch_facts() -> dict[str, object]:
    import torch

    from tightfit.kernels.packed_linear import packing_available

    facts: dict[str, object] = {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "cpu_threads": torch.get_num_threads(),
        # oneDNN-packed CPU linear weights (energon's projections): PyTorch built with oneDNN, not turned off
        "onednn_packing": packing_available(),
        "devices": [],
    }
    if torch.cuda.is_available():
        facts["devices"] = [
            f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())
        ]
    return facts


def run(args: argparse.Namespace) -> int:
    rows = []
    report: dict[str, object] = {"python": sys.version.split()[0], "imports_checked": args.imports}
    versions = {dist: _version(dist) for _, dist, _, _ in CHECKS}
    probed: dict[str, tuple[bool, str]] = {}
    if args.imports:
        number = {module: (i, label) for i, (label, _, module, _) in enumerate(CHECKS, 1)}

        def started(module: str) -> None:
            i, label = number[module]
            log.info("[doctor] %d/%d importing %s ...", i, len(CHECKS), label)

        probed = _probe([module for _, dist, module, _ in CHECKS if versions[dist] is not None], args.timeout,
                        started)
    for label, dist, module, enables in CHECKS:
        version = versions[dist]
        if version is None:
            ok, detail = False, f"not installed (pip install {dist})"
        elif args.imports:
            ok, detail = probed[module]
        else:
            ok = _findable(module)
            detail = "installed" if ok else f"metadata says {version} but `import {module}` finds nothing"
        rows.append((label, version or "-", "yes" if ok else "no", enables if ok else detail))
        report[label] = {"version": version, "usable": ok, "detail": detail}
    cc_version, cc_ok, cc_detail = _native(args.imports)
    rows.append(("C compiler", cc_version, "yes" if cc_ok else "no", cc_detail))
    report["C compiler"] = {"version": cc_version, "usable": cc_ok, "detail": cc_detail}
    disk_row, report["disk"] = _disk(args.disk_dir)
    rows.append(disk_row)
    memory = read_memory()  # the one reading every planner uses: a container's limit, not the machine's RAM
    rows.append(("memory", format_bytes(memory.capacity), "yes", memory.describe()))
    report["memory"] = memory.to_dict()
    if args.imports:
        report.update(_torch_facts())
    else:
        report.update(_torch_build())
        report["devices"] = _gpus()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if args.imports:
        print(f"python {report['python']}, torch {report['torch']}, CUDA available: {report['cuda_available']}"
              f" (CUDA {report['cuda_version']}), gloo: {report['gloo']}, NCCL: {report['nccl']},"
              f" CPU threads: {report['cpu_threads']}, oneDNN weight packing: {report['onednn_packing']}")
    else:
        print(f"python {report['python']}, torch {report['torch']} (CUDA build: {report['cuda_version'] or 'none'}),"
              f" GPUs found by nvidia-smi: {len(report['devices'])}")  # type: ignore[arg-type]
    for dev in report["devices"]:  # type: ignore[attr-defined]
        print(f"  device: {dev}")
    print(format_table(rows, ("package", "version", "usable", "enables / why not"), max_width=terminal_width()))
    if not args.imports:
        print("usable = installed and importable by name; `tightfit doctor --imports` imports each one (slower)")
    return 0
