"""The native kernels' C sources (``core/kernels/cpu/``): each compiles with warnings as errors on every
instruction-set path it has, is formatted by ``clang-format`` with the repository's ``.clang-format``, ships in
the package data, and is what the first-use loader builds (a changed header changes the cache key)."""

from __future__ import annotations

import fnmatch
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tightfit.kernels import native
from tightfit.kernels.sources import CPU_DIR, cpu_libraries, cpu_source, read_source

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(CPU_DIR.glob("*.c"))
FILES = sorted([*SOURCES, *CPU_DIR.glob("*.h")])
WARNINGS = ("-Wall", "-Wextra", "-Werror")
# -march=native is what the loader builds with; the others reach each #if path whatever this CPU has: no SIMD
# beyond SSE2, AVX2 + FMA (the AVX2 kernels), AVX-512 with VNNI (the int8-activation kernels).
X86_TARGETS = ("-march=x86-64", "-march=haswell", "-march=icelake-server")
TARGETS = ("-march=native", *(X86_TARGETS if platform.machine() in ("x86_64", "AMD64") else ()))
_CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
needs_cc = pytest.mark.skipif(_CC is None, reason="no C compiler (cc, gcc or clang) on PATH")


def test_every_library_has_a_source_and_the_loader_builds_its_file():
    assert cpu_libraries() == ["elementwise", "gelu_mul", "grouped_experts", "gumbel", "head_norm",
                               "paged_attention", "quant_linear"]
    # Local headers are inlined: the built text holds no #include "..." and carries each header's code.
    text = cpu_source("quant_linear")
    assert '#include "' not in text
    assert "a8v_quantize_b128" in text and "tf_a8_available" in text and "tf_on_fork_child" in text
    assert cpu_source("head_norm") == (CPU_DIR / "head_norm.c").read_text()


@needs_cc
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("openmp", [False, True], ids=["threads", "openmp"])
@pytest.mark.parametrize("source", SOURCES, ids=[p.stem for p in SOURCES])
def test_source_compiles_with_warnings_as_errors(source, target, openmp, tmp_path):
    flags = [f for f in native.FLAGS if not f.startswith("-march=")]
    cmd = [_CC, *flags, target, *WARNINGS, *(["-fopenmp"] if openmp else []), "-c", "-o", str(tmp_path / "k.o"),
           str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr}"


def _clang_format() -> str | None:
    return shutil.which("clang-format", path=str(Path(sys.executable).parent)) or shutil.which("clang-format")


@pytest.mark.skipif(_clang_format() is None, reason="clang-format not installed (pip install clang-format)")
def test_sources_are_clang_formatted():
    cmd = [_clang_format(), "--dry-run", "--Werror", f"--style=file:{ROOT / '.clang-format'}", *map(str, FILES)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, ("run `.venv/bin/clang-format -i core/kernels/cpu/*.c core/kernels/cpu/*.h`:\n"
                                  + done.stderr[-3000:])


def test_package_data_ships_every_source():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "tightfit.kernels" in data["packages"]
    patterns = data["package-data"]["tightfit.kernels"]
    kernels = CPU_DIR.parent
    for path in FILES:
        rel = path.relative_to(kernels).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not matched by {patterns}"


def test_read_source_inlines_local_headers_and_refuses_bad_ones(tmp_path):
    (tmp_path / "inc.h").write_text("#define K 3\n")
    (tmp_path / "a.c").write_text('#include <stdint.h>\n#include "inc.h"\nint f(int a) { return a + K; }\n')
    assert read_source(tmp_path / "a.c") == "#include <stdint.h>\n#define K 3\nint f(int a) { return a + K; }\n"
    (tmp_path / "b.c").write_text('#include "missing.h"\n')
    with pytest.raises(FileNotFoundError, match=r"b.c includes 'missing.h', which is not in .*beside the source"):
        read_source(tmp_path / "b.c")
    (tmp_path / "loop.h").write_text('#include "c.c"\n')
    (tmp_path / "c.c").write_text('#include "loop.h"\n')
    with pytest.raises(ValueError, match="c.c includes itself through c.c -> loop.h"):
        read_source(tmp_path / "c.c")
    with pytest.raises(ValueError, match="no C library 'nope' in .*known ones are \\['elementwise'"):
        cpu_source("nope")


@needs_cc
def test_a_changed_header_changes_the_built_library(tmp_path, monkeypatch):
    """The cache key is a hash of the inlined text: editing only a header builds (and loads) a new library."""
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(native.NATIVE_ENV_VAR, "1")
    (tmp_path / "k.c").write_text('#include <stdint.h>\n#include "k.h"\nint64_t tf_k(void) { return K; }\n')
    values = []
    for k in (7, 11):
        (tmp_path / "k.h").write_text(f"#define K {k}\n")
        lib = native.load_functions("t_header_key", read_source(tmp_path / "k.c"), (("tf_k", native.ctypes.c_int64, ()),))
        assert lib is not None, native.native_error("t_header_key")
        values.append(lib.tf_k())
    assert values == [7, 11]
    assert len(list((tmp_path / "cache" / "native").glob("t_header_key-*.so"))) == 2
