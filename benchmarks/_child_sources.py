"""Which project files a benchmark's child processes ran.

A benchmark that measures in subprocesses (under a memory limit, in a peer's venv) cannot see what they import, and
declaring whole folders (``core``, ``plugins``) as measured would make any change there stale its result. Each child adds
the files it imported to the JSON it prints (:func:`tag`), and the parent passes their union to
``write_result(measures=...)`` (:func:`collect`): the result goes stale when code a child ran changes, and only then.
Children that run the same code form a group (the repeats of one contender); a group none of whose children
printed anything (all killed, e.g. by the memory limit) reported nothing, and then ``fallback`` (the folders its
code comes from) counts whole.

    print(json.dumps(tag(result)))                                       # in the child, last
    measures = collect([disk_runs, ram_runs], fallback=("core",))        # in the parent
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from benchmarks.common import imported_sources

__all__ = ["SOURCES_KEY", "tag", "collect"]

SOURCES_KEY = "measured_sources"


def tag(out: dict) -> dict:
    """``out`` with the project files this process imported under :data:`SOURCES_KEY`."""
    out[SOURCES_KEY] = imported_sources()
    return out


def collect(groups: Iterable[Iterable[dict]], fallback: Sequence[str]) -> tuple[str, ...]:
    """The union of the files the children in ``groups`` reported, taken out of their outputs; ``fallback``
    besides where a whole group reported none."""
    found: set[str] = set()
    for group in groups:
        reported = [out.pop(SOURCES_KEY) for out in group if SOURCES_KEY in out]
        for sources in reported or [list(fallback)]:
            found.update(sources)
    return tuple(sorted(found))
