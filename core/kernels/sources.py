"""The native kernels' C sources: ``cpu/`` holds the libraries that :mod:`tightfit.kernels.native` builds on first use
and loads with ``ctypes``.

Each library is one ``cpu/<name>.c`` (C99 on raw pointers, no PyTorch headers); code that two libraries share,
or that a library splits into parts, lives in ``cpu/*.h`` files it includes with ``#include "file.h"``.
:func:`cpu_source` returns a library's text with those local includes inlined, so the build needs no include
path and the cache key (a hash of that text) changes whenever the ``.c`` file or any header it includes does.

Formatting: ``clang-format`` with the repository's ``.clang-format``; every source compiles with
``-Wall -Wextra -Werror`` (``tests/core/test_kernel_sources.py``).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

__all__ = ["CPU_DIR", "cpu_libraries", "cpu_source", "read_source"]

CPU_DIR = Path(__file__).resolve().parent / "cpu"
# Every file the libraries are built from: benchmarks record these beside the imported modules as the code a
# figure measured (benchmarks/common.py, imported_sources).
__source_files__ = tuple(sorted(str(p) for p in (*CPU_DIR.glob("*.c"), *CPU_DIR.glob("*.h"))))
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def cpu_libraries() -> list[str]:
    """The names of the C libraries in ``cpu/`` (one per ``.c`` file), sorted."""
    return sorted(p.stem for p in CPU_DIR.glob("*.c"))


def read_source(path: Path) -> str:
    """The text of the C file ``path`` with each ``#include "file.h"`` line replaced by that file's text (a header
    beside the including file, itself read the same way); ``#include <...>`` lines are left to the compiler."""
    return _inline(Path(path), ())


def _inline(path: Path, seen: tuple[Path, ...]) -> str:
    if path in seen:
        raise ValueError(f"{path.name} includes itself through {' -> '.join(p.name for p in seen)}: "
                         "a header in kernels/cpu/ must not include one of the files that include it")

    def include(match: re.Match[str]) -> str:
        header = path.parent / match.group(1)
        if not header.is_file():
            raise FileNotFoundError(f"{path.name} includes {match.group(1)!r}, which is not in {path.parent}: "
                                    "local includes must name a header beside the source")
        return _inline(header, (*seen, path)).rstrip("\n")

    return _LOCAL_INCLUDE.sub(include, path.read_text())


@functools.cache
def cpu_source(name: str) -> str:
    """The C text of library ``name`` (``cpu/<name>.c``) with its ``#include "..."`` headers inlined."""
    path = CPU_DIR / f"{name}.c"
    if not path.is_file():
        raise ValueError(f"no C library {name!r} in {CPU_DIR}: known ones are {cpu_libraries()}")
    return read_source(path)
