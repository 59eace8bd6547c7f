"""The expert-popularity profile of an MoE model: per layer, how many routed tokens each expert took.

Counted on a calibration set or carried over from serving (:meth:`ExpertPopularity.add` with each step's router
indices), merged across runs or ranks (:meth:`~ExpertPopularity.merge`), and saved beside the model as
``<model dir>/tightfit-expert-popularity.json``; the expert placement planner
(:func:`tightfit.planner.experts.plan_experts`) keeps each layer's most used experts in the fastest tier.

The file is JSON (never a pickle) with a CRC-32 over its content, written atomically (a temporary file in the
same directory, flushed to the disk, then renamed over the old one: a process killed mid-write leaves the old
file or the new one, never a mix). Loading checks everything (kind, version, checksum, shapes, non-negative whole
counts) and the model it was counted for, and refuses anything else in one line naming the file, what is wrong and
the fix.

Example:
    >>> pop = ExpertPopularity(num_layers=2, num_experts=4, experts_per_token=2)
    >>> pop.add(0, [1, 3, 1, 2])  # two tokens' top-2 experts
    >>> pop.counts(0), pop.shares(0), pop.token_probabilities(0)
    ((0, 2, 1, 1), (0.0, 0.5, 0.25, 0.25), (0.0, 1.0, 0.5, 0.5))
    >>> pop.shares(1)  # nothing counted: uniform
    (0.25, 0.25, 0.25, 0.25)
    >>> ExpertPopularity.from_json(pop.to_json()) == pop
    True
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tightfit.checks import check_number
from tightfit.profiler.types import ProfileError

__all__ = ["POPULARITY_FILE", "ExpertPopularity"]

POPULARITY_FILE = "tightfit-expert-popularity.json"
_KIND = "tightfit-expert-popularity"
_VERSION = 1
_FIELDS = ("kind", "version", "model", "num_layers", "num_experts", "experts_per_token", "counts", "crc32")
_FIX = "delete it and count again (ExpertPopularity.add over a calibration set), or give the model it was counted for"


class ExpertPopularity:
    """Routed-token counts per MoE layer and expert.

    Args:
        num_layers: MoE layers.
        num_experts: routed experts per layer.
        experts_per_token: experts the router picks per token (top-k).
        model: a name for the model the counts belong to (checked on load when given; ``""``: not recorded).
        counts: starting counts, ``num_layers`` rows of ``num_experts`` whole numbers >= 0 (``None``: zeros).
    """

    def __init__(self, *, num_layers: int, num_experts: int, experts_per_token: int, model: str = "",
                 counts: Iterable[Iterable[int]] | None = None) -> None:
        where = "ExpertPopularity"
        check_number(num_layers, "num_layers", where=where, integer=True, low=1, error=ProfileError,
                     fix="give the model's MoE layers")
        check_number(num_experts, "num_experts", where=where, integer=True, low=1, error=ProfileError,
                     fix="give the experts per layer")
        check_number(experts_per_token, "experts_per_token", where=where, integer=True, low=1, high=num_experts,
                     error=ProfileError, fix="give the router's top-k")
        if not isinstance(model, str):
            raise ProfileError(f"{where}: model={model!r} must be a string (a name for the model, or '')")
        self.num_layers, self.num_experts = int(num_layers), int(num_experts)
        self.experts_per_token, self.model = int(experts_per_token), model
        self._counts = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        if counts is not None:
            rows = [list(r) for r in counts]
            if len(rows) != self.num_layers or any(len(r) != self.num_experts for r in rows):
                raise ProfileError(f"{where}: counts must be {self.num_layers} rows of {self.num_experts} counts, got "
                                   f"{[len(r) for r in rows]}; give one count per layer and expert")
            for i, row in enumerate(rows):
                for j, c in enumerate(row):
                    check_number(c, f"counts[{i}][{j}]", where=where, integer=True, low=0, high=2**62,
                                 error=ProfileError, fix="counts are routed tokens")
            self._counts[:] = np.array(rows, dtype=np.int64)

    def add(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Count one use of each of ``expert_ids`` (a step's router indices, every token's top-k, flattened)."""
        check_number(layer, "layer", where="ExpertPopularity.add", integer=True, low=0, high=self.num_layers - 1,
                     error=ProfileError, fix=f"give an MoE layer index below num_layers={self.num_layers}")
        ids = np.asarray(expert_ids.tolist() if hasattr(expert_ids, "tolist") else list(expert_ids)).reshape(-1)
        if ids.size == 0:
            return
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.num_experts:
            bad = next((e for e in ids.tolist() if not (type(e) is int and 0 <= e < self.num_experts)), ids[0])
            raise ProfileError(f"ExpertPopularity.add (layer {layer}): expert {bad!r} must be a whole number in "
                               f"[0, {self.num_experts}); give the router's indices")
        self._counts[layer] += np.bincount(ids.astype(np.int64), minlength=self.num_experts)

    def merge(self, other: ExpertPopularity) -> ExpertPopularity:
        """A new profile with both profiles' counts (same model shape and name)."""
        mine, theirs = self._identity(), other._identity()
        if mine != theirs:
            raise ProfileError(f"ExpertPopularity.merge: profiles of different models ({_describe(mine)} vs "
                               f"{_describe(theirs)}); merge counts of one model only")
        return ExpertPopularity(num_layers=self.num_layers, num_experts=self.num_experts,
                                experts_per_token=self.experts_per_token, model=self.model,
                                counts=(self._counts + other._counts).tolist())

    def counts(self, layer: int) -> tuple[int, ...]:
        return tuple(int(c) for c in self._counts[layer])

    def shares(self, layer: int) -> tuple[float, ...]:
        """Each expert's share of the layer's routed uses (sums to 1; uniform where nothing was counted)."""
        row = self._counts[layer]
        total = int(row.sum())
        if total == 0:
            return (1.0 / self.num_experts,) * self.num_experts
        return tuple(float(c) / total for c in row)

    def token_probabilities(self, layer: int) -> tuple[float, ...]:
        """Each expert's chance of being among one token's picks: ``min(1, experts_per_token * share)``."""
        return tuple(min(1.0, self.experts_per_token * s) for s in self.shares(layer))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPopularity):
            return NotImplemented
        return self._identity() == other._identity() and bool(np.array_equal(self._counts, other._counts))

    __hash__ = None  # type: ignore[assignment]  # mutable: counts grow

    def __repr__(self) -> str:
        return f"ExpertPopularity({_describe(self._identity())}, {int(self._counts.sum())} uses)"

    def _identity(self) -> tuple[str, int, int, int]:
        return (self.model, self.num_layers, self.num_experts, self.experts_per_token)

    def to_json(self) -> str:
        body = {"kind": _KIND, "version": _VERSION, "model": self.model, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
                "counts": self._counts.tolist()}
        return json.dumps({**body, "crc32": _crc(body)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, source: str = "expert popularity JSON") -> ExpertPopularity:
        """Parse and check a profile (see the module docstring); ``source`` names it in errors."""
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise ProfileError(f"{source}: not valid JSON ({err}); {_FIX}") from None
        return _from_raw(raw, source)

    def save(self, model_dir: str | os.PathLike[str]) -> Path:
        """Write ``<model_dir>/tightfit-expert-popularity.json`` atomically; returns its path."""
        path = Path(model_dir) / POPULARITY_FILE
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{POPULARITY_FILE}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)
        return path

    @classmethod
    def load(cls, model_dir: str | os.PathLike[str], *, num_layers: int | None = None, num_experts: int | None = None,
             experts_per_token: int | None = None, model: str | None = None) -> ExpertPopularity:
        """Read the profile saved beside a model, checked, and checked against the model's shape where given."""
        path = Path(model_dir) / POPULARITY_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no expert popularity profile at {path}; count one (ExpertPopularity.add, then "
                                    ".save(model_dir)) or plan with uniform popularity")
        pop = cls.from_json(path.read_text(errors="replace"), source=str(path))
        have = pop._identity()
        want = (have[0] if model is None else model, have[1] if num_layers is None else num_layers,
                have[2] if num_experts is None else num_experts,
                have[3] if experts_per_token is None else experts_per_token)
        if want != have:
            raise ProfileError(f"{path}: counted for {_describe(pop._identity())}, the model has {_describe(want)}; "
                               f"{_FIX}")
        return pop


def _describe(identity: tuple[str, int, int, int]) -> str:
    model, layers, experts, k = identity
    return f"{model + ': ' if model else ''}{layers} layers of {experts} experts, top-{k}"


def _crc(body: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _from_raw(raw: Any, source: str) -> ExpertPopularity:
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ProfileError(f"{source}: must be a JSON object with the fields {sorted(_FIELDS)}, got {got}; {_FIX}")
    if raw["kind"] != _KIND:
        raise ProfileError(f"{source}: kind={raw['kind']!r} is not {_KIND!r}; {_FIX}")
    if type(raw["version"]) is not int or raw["version"] != _VERSION:
        raise ProfileError(f"{source}: version={raw['version']!r}, this tightfit reads version {_VERSION}; {_FIX}")
    body = {k: raw[k] for k in _FIELDS if k != "crc32"}
    if type(raw["crc32"]) is not int or raw["crc32"] != _crc(body):
        raise ProfileError(f"{source}: checksum mismatch (crc32={raw['crc32']!r}, content gives {_crc(body)}): the "
                           f"file is corrupt; {_FIX}")
    for name in ("num_layers", "num_experts", "experts_per_token"):
        if type(raw[name]) is not int:
            raise ProfileError(f"{source}: {name}={raw[name]!r} must be a whole number; {_FIX}")
    counts = raw["counts"]
    if not isinstance(counts, list) or not all(isinstance(r, list) for r in counts):
        raise ProfileError(f"{source}: counts must be a list of per-layer lists; {_FIX}")
    for i, row in enumerate(counts):
        for j, c in enumerate(row):
            if type(c) is not int:  # bools and floats are not counts
                raise ProfileError(f"{source}: counts[{i}][{j}]={c!r} must be a whole number >= 0; {_FIX}")
    try:
        return ExpertPopularity(num_layers=raw["num_layers"], num_experts=raw["num_experts"],
                                experts_per_token=raw["experts_per_token"], model=raw["model"], counts=counts)
    except ValueError as err:
        raise ProfileError(f"{source}: {err}; {_FIX}") from None
