"""A process and its descendants, read from ``/proc`` (Linux): what the benchmarks sum a counter over.

``benchmarks.peers`` sums CPU seconds over a peer's process tree (to wait until it is idle), and
``benchmarks._offload_children`` sums bytes read from the block device over a contender's. Standard library
only: the offload children import this from ``.venv-offload``'s python too.

    for pid in descendants(os.getpid()) or []: ...
"""

from __future__ import annotations

import os

__all__ = ["descendants", "stat_fields"]


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state, ``[1]`` the parent's
    pid, ``[11]``/``[12]`` user/system CPU ticks); ``None`` where the process is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int] | None:
    """``pid`` and every live descendant of it (``pid`` first); ``None`` where ``pid`` is gone or there is no
    ``/proc`` (not Linux)."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    alive = False
    for e in entries:
        fields = stat_fields(e)
        if fields is None:
            continue  # exited while we read
        alive = alive or e == pid
        children.setdefault(int(fields[1]), []).append(e)
    if not alive:
        return None
    tree, todo = [pid], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        tree += kids
        todo += kids
    return tree
