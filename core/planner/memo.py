"""Memos for the planners' budget-independent work, keyed by value.

A planner is a pure function of its inputs, so a result computed once can be reused whenever the inputs are
equal. :func:`frozen` turns the inputs (frozen dataclasses holding tuples, dicts and floats) into a hashable
value that is equal exactly when they are; :class:`LruMemo` keeps the last few results under such keys.

Example:
    >>> memo = LruMemo(2)
    >>> key = frozen({"all_gather": {1 << 20: 1e9}})
    >>> memo.get(key) is None
    True
    >>> memo.put(key, 42)
    >>> memo.get(frozen({"all_gather": {1 << 20: 1e9}})), memo.info()
    (42, MemoInfo(hits=1, misses=1, size=1))
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import fields, is_dataclass
from typing import Any, NamedTuple

__all__ = ["frozen", "LruMemo", "MemoInfo"]


def frozen(value: object) -> object:
    """``value`` as a hashable value equal for equal inputs: a dataclass field by field (with its type's name),
    a dict as its items in order, a list or tuple as a tuple, an object with a ``memo_key()`` method as what
    that returns; anything else stands for itself (a float, a string; an unknown object by its identity)."""
    memo_key = getattr(value, "memo_key", None)
    if callable(memo_key) and not isinstance(value, type):
        return memo_key()
    if is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, *(frozen(getattr(value, f.name)) for f in fields(value)))
    if isinstance(value, dict):
        return ("dict", *((frozen(k), frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    return value


class MemoInfo(NamedTuple):
    """Results reused, results computed (a miss is followed by its :meth:`LruMemo.put`), results kept now."""

    hits: int
    misses: int
    size: int


class LruMemo:
    """At most ``size`` results by key, the least recently used dropped first; safe to share between threads.

    Args:
        size: results kept.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[object, Any] = OrderedDict()
        self._hits = self._misses = 0
        self._lock = threading.Lock()

    def get(self, key: object) -> Any | None:
        """The result stored under ``key`` (counted as a hit), or ``None`` (a miss)."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self._misses += 1
            else:
                self._items.move_to_end(key)
                self._hits += 1
            return value

    def put(self, key: object, value: Any) -> None:
        """Keep ``value`` under ``key`` (not ``None``), dropping the least recently used beyond ``size``."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def info(self) -> MemoInfo:
        """Hits, misses and size (as ``functools.lru_cache``'s ``cache_info``)."""
        with self._lock:
            return MemoInfo(self._hits, self._misses, len(self._items))

    def clear(self) -> None:
        """Drop every result and zero the counts."""
        with self._lock:
            self._items.clear()
            self._hits = self._misses = 0
