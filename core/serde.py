"""JSON round-trips for frozen dataclasses (profiles and plans).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class P:
    ...     a: int
    ...     b: tuple[int, ...] = ()
    >>> from_jsonable(P, to_jsonable(P(1, (2, 3))))
    P(a=1, b=(2, 3))
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["to_jsonable", "from_jsonable", "dump_json", "load_json", "SCHEMA_KEY"]

T = TypeVar("T")
SCHEMA_KEY = "__type__"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses -> dicts (with their type name), tuples -> lists, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {SCHEMA_KEY: type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = to_jsonable(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def _convert(tp: Any, value: Any, where: str) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        for a in non_none:
            try:
                return _convert(a, value, where)
            except (TypeError, ValueError, KeyError):
                continue
        raise ValueError(f"{where}: {value!r} matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        return from_jsonable(tp, value, where=where)  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if value not in {m.value for m in tp}:
            raise ValueError(f"{where}: {value!r} is not a {tp.__name__}; use one of {[m.value for m in tp]}")
        return tp(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if args:
            return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return tuple(value)
    if origin is list:
        return [_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        kt, vt = args if args else (str, Any)
        return {_convert(kt, k, where): _convert(vt, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    if tp is int and isinstance(value, str):
        return int(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise TypeError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_jsonable(cls: type[T], data: dict[str, Any], *, where: str | None = None) -> T:
    """Rebuild ``cls`` from :func:`to_jsonable` output; unknown or missing fields raise naming them."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise TypeError(f"{where}: expected a JSON object for {cls.__name__}, got {type(data).__name__}")
    tag = data.get(SCHEMA_KEY)
    if tag is not None and tag != cls.__name__:
        raise ValueError(f"{where}: this JSON holds a {tag}, not a {cls.__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields) - {SCHEMA_KEY}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} for {cls.__name__} (made by a newer tightfit?)")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], f"{where}.{name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}: missing field {name!r} for {cls.__name__}")
    return cls(**kwargs)


def dump_json(obj: Any, path: str | Path | None = None, *, indent: int | None = 2) -> str:
    """Serialise; with ``path``, write atomically (a temporary file, then a rename)."""
    text = json.dumps(to_jsonable(obj), indent=indent)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers of one path each rename their own
        tmp.write_text(text)
        tmp.replace(path)
    return text


def load_json(cls: type[T], source: str | Path, *, upgrade: Callable[[Any], Any] | None = None) -> T:
    """``source`` is a path to a JSON file or a JSON string; ``upgrade`` rewrites an older form's parsed JSON."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"{cls.__name__} file {str(path)!r} does not exist")
        text = path.read_text()
    data = json.loads(text)
    return from_jsonable(cls, upgrade(data) if upgrade else data)
