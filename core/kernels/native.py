"""Compile a small C source with the system's C compiler on first use and load it with ``ctypes``.

The CPU backend of a kernel (``backend="native"``, see :mod:`tightfit.kernels.dispatch`) is plain C99
on raw pointers: no PyTorch headers, so a build is one short compiler run (no ``torch.utils.cpp_extension``
build and its file lock), and ``ctypes`` releases the GIL during the call.

    lib = load_kernel("paged_attention", signatures)  # tightfit/kernels/cpu/paged_attention.c: ctypes.CDLL or None
    lib = load_library("t_add", "int f(int a) { return a + 1; }")  # any C text
    native_error("paged_attention")                   # why not ('' when it loaded)

The kernels' sources are ``.c`` files in :mod:`tightfit.kernels` (``kernels/cpu/``); :func:`load_kernel` reads
one with :func:`tightfit.kernels.sources.cpu_source` (its local headers inlined) and builds that text.

Where the library lives: ``$TIGHTFIT_CACHE/native/`` (default ``~/.cache/tightfit/native/``), one file per
hash of the source, the compiler's version, the flags and this CPU's instruction-set flags, so a cache
shared between machines never loads code built for another CPU. A build goes to a temporary file renamed
into place, so processes that build at once cannot load a half-written library.

The compiler is ``$CC`` (default ``cc``), compiling with ``-O3 -march=native -ffast-math`` and linking
without it (so loading a library never switches the process to flush-to-zero). A library that asks for
``openmp`` is built with ``-fopenmp`` where PyTorch's GNU OpenMP runtime is already in the process
(:func:`torch_openmp`): the loader then binds it to that same ``libgomp.so.1``, so its parallel regions run on
PyTorch's threads; where that build fails it is built without. ``TIGHTFIT_NATIVE=0`` disables every native library (each kernel then runs its PyTorch reference). A missing or failing compiler is
not an error: :func:`load_library` returns ``None``, logs the reason once on ``tightfit.kernels.native`` and
the dispatcher uses the reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tightfit.kernels.sources import cpu_source

__all__ = ["NATIVE_ENV_VAR", "native_enabled", "load_library", "load_functions", "load_kernel", "native_error",
           "cache_dir", "torch_openmp"]

NATIVE_ENV_VAR = "TIGHTFIT_NATIVE"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c99")
# Linked in a second command without -ffast-math: given at link time it adds crtfastmath.o, whose
# constructor sets flush-to-zero for the whole process once the library loads (subnormals vanish from
# every later float operation, PyTorch's and Python's included).
LIBS = ("-lm", "-lpthread")
log = logging.getLogger(__name__)
_ERRORS: dict[str, str] = {}


def native_enabled() -> bool:
    """Whether native CPU kernels may be used (``TIGHTFIT_NATIVE``, default on; ``0`` turns them off)."""
    return os.environ.get(NATIVE_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built libraries are kept (``$TIGHTFIT_CACHE/native`` or ``~/.cache/tightfit/native``)."""
    root = os.environ.get("TIGHTFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tightfit")
    return Path(root) / "native"


def _cpu_flags() -> str:
    # -march=native bakes this CPU's instruction set in: the cache key must change with it.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def _compiler() -> tuple[str, str] | None:
    """``(path, version line)`` of ``$CC`` (default ``cc``), or ``None`` when there is none."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return cc, (out.stdout.splitlines() or [""])[0]


def _unavailable(name: str, why: str) -> None:
    _ERRORS[name] = why
    log.info("native kernel %s unavailable: %s", name, why)


def native_error(name: str) -> str:
    """Why the library ``name`` is unavailable ('' when it loaded or was never asked for)."""
    return _ERRORS.get(name, "")


def torch_openmp() -> bool:
    """Whether this process has GNU OpenMP loaded (PyTorch's CPU wheels bring their own ``libgomp.so.1`` and
    run their ops on it): a library built with ``-fopenmp`` then binds to that same runtime, so its parallel
    regions run on the threads PyTorch's ops use, sized by ``torch.set_num_threads``."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:
        return False


def _build(cc: str, path: Path, name: str, source: str, flags: Sequence[str], libs: Sequence[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{name}-") as tmp:
        src, obj, out = (Path(tmp) / f"{name}{ext}" for ext in (".c", ".o", ".so"))
        src.write_text(source)
        for cmd in ([cc, *flags, "-c", "-o", str(obj), str(src)], [cc, "-shared", "-o", str(out), str(obj), *libs]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise OSError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, path)  # atomic: a concurrent builder's identical file may win; both are fine


@functools.cache
def load_library(name: str, source: str, openmp: bool = False) -> ctypes.CDLL | None:
    """The library built from ``source`` (built on first use, then cached on disk); ``None`` if it cannot be.

    ``openmp``: build with ``-fopenmp`` where :func:`torch_openmp` (the source's ``#ifdef _OPENMP`` paths then
    run on PyTorch's team); where that build or its loading fails, the library is built without it."""
    if not native_enabled():
        _ERRORS[name] = f"{NATIVE_ENV_VAR}=0"
        return None
    compiler = _compiler()
    if compiler is None:
        _unavailable(name, f"no C compiler ({os.environ.get('CC', 'cc')} not found); install gcc or clang, or set "
                           "CC, to use the native CPU kernels")
        return None
    cc, version = compiler
    variants: list[tuple[tuple[str, ...], tuple[str, ...]]] = [(FLAGS, LIBS)]
    if openmp and torch_openmp():
        variants.insert(0, ((*FLAGS, "-fopenmp"), (*LIBS, "-fopenmp")))
    failure = ""
    for flags, libs in variants:
        key = hashlib.sha256("\0".join((source, version, *flags, *libs, _cpu_flags())).encode()).hexdigest()[:16]
        path = cache_dir() / f"{name}-{key}.so"
        try:
            if not path.exists():
                _build(cc, path, name, source, flags, libs)
            return ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
            log.info("native kernel %s: build with %s failed (%s)", name, " ".join(flags), failure)
    _unavailable(name, failure)
    return None


def load_functions(name: str, source: str, signatures: Sequence[tuple[str, Any, Sequence[Any]]],
                   openmp: bool = False) -> Any:
    """:func:`load_library`, with each ``(function, restype, argtypes)`` of ``signatures`` declared; ``None``
    where the library cannot be built."""
    lib = load_library(name, source, openmp)
    if lib is not None:
        for fn, restype, argtypes in signatures:
            getattr(lib, fn).restype = restype
            getattr(lib, fn).argtypes = list(argtypes)
    return lib


def load_kernel(name: str, signatures: Sequence[tuple[str, Any, Sequence[Any]]], openmp: bool = False) -> Any:
    """:func:`load_functions` on the C library ``tightfit/kernels/cpu/<name>.c`` (its local headers inlined)."""
    return load_functions(name, cpu_source(name), signatures, openmp)
