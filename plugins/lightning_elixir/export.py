"""Consolidate a sharded Elixir checkpoint into one safetensors file the plain model loads without tightfit.

    python -m lightning_elixir.export runs/elixir_demo/last.ckpt -o model.safetensors

The checkpoint directory holds each rank's shards (``torch.distributed.checkpoint``); this reads them
in one process (no process group, no GPU), assembles the full tensors of the model state
(optimizer state is not read), strips the LightningModule's attribute prefix (``model.``) so the
names are the bare model's, and writes them with safetensors (no pickle: loading the file can run
no code). The hyperparameters go into the file's metadata as JSON when they are plain values.

Example:
    >>> from lightning_elixir.export import export_checkpoint
    >>> out = export_checkpoint("runs/elixir_demo/last.ckpt")                      # doctest: +SKIP
    >>> from safetensors.torch import load_file
    >>> model = GPT(GPTConfig(...)); model.load_state_dict(load_file(out))      # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_elixir.checkpoint import METADATA_FILENAME, is_checkpoint_dir, recover, verify_checkpoint

__all__ = ["load_model_state", "export_checkpoint", "main"]


def load_model_state(path: str | Path, *, key: str = "state_dict") -> dict[str, torch.Tensor]:
    """The full (unsharded) model state of a sharded checkpoint directory, on the CPU, in one process.

    Public ``torch.distributed.checkpoint`` APIs only: the reader's metadata says the name, shape and dtype
    of every saved tensor; empty tensors of those shapes are allocated for the model entries and
    ``torch.distributed.checkpoint.load(..., no_dist=True)`` fills them from the shards.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    recover(path)
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(
            f"{path} is not a complete Elixir checkpoint directory (it needs the torch.distributed.checkpoint "
            f"'.metadata' and Lightning's '{METADATA_FILENAME}'); give the directory ModelCheckpoint wrote, e.g. "
            "runs/elixir_demo/last.ckpt")
    verify_checkpoint(path)  # a flipped or truncated shard raises naming it, before any tensor is read
    reader = dcp.FileSystemReader(str(path))
    entries = reader.read_metadata().state_dict_metadata  # flattened names: "state_dict.model.wte.weight"
    head = key + "."
    state: dict[str, Any] = {
        name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for name, meta in entries.items() if name.startswith(head) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        roots = sorted({name.split(".", 1)[0] for name in entries})
        raise KeyError(f"{path} has no tensors under {key!r}; entries: {roots}")
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {name[len(head):]: t for name, t in state.items()}


def _common_prefix(names: list[str]) -> str:
    """``"model."`` when every name starts with the same first component (the LightningModule's attribute)."""
    firsts = {n.split(".", 1)[0] for n in names}
    if len(firsts) == 1 and all("." in n for n in names):
        return next(iter(firsts)) + "."
    return ""


def _hyperparameters(path: Path) -> dict[str, Any]:
    try:
        meta = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=True)
    except Exception:  # objects beyond plain values: skip them rather than unpickle arbitrary code
        return {}
    hp = meta.get("hyper_parameters") if isinstance(meta, dict) else None
    try:
        return json.loads(json.dumps(dict(hp or {})))
    except (TypeError, ValueError):
        return {}


def export_checkpoint(path: str | Path, out: str | Path | None = None, *, prefix: str | None = None,
                      dtype: torch.dtype | None = None) -> Path:
    """Write the model state of checkpoint ``path`` to one safetensors file; returns its path.

    Args:
        path: the checkpoint directory (what ``ModelCheckpoint`` / ``trainer.save_checkpoint`` wrote).
        out: output file (default: ``<path>.safetensors`` beside the directory).
        prefix: name prefix to strip (default: the LightningModule attribute all names share, e.g. ``"model."``;
            ``""`` keeps names as they are).
        dtype: cast floating-point tensors (e.g. ``torch.bfloat16`` to halve the file).
    """
    from safetensors.torch import save_file

    path = Path(path)
    state = load_model_state(path)
    strip = _common_prefix(list(state)) if prefix is None else prefix
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if strip and not name.startswith(strip):
            raise ValueError(f"prefix {strip!r} does not match parameter {name!r}; pass prefix='' to keep full names")
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        # Tied weights are separate tensors after loading; clone so none shares storage (safetensors refuses that).
        tensors[name[len(strip):]] = t.contiguous().clone()
    out = Path(out) if out is not None else path.with_name(path.name.removesuffix(".ckpt") + ".safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", "source": str(path), "exported_by": "lightning_elixir.export"}
    hp = _hyperparameters(path)
    if hp:
        metadata["hyper_parameters"] = json.dumps(hp)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the mode any file written here gets (safetensors creates it 0600)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_elixir.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="sharded checkpoint directory (e.g. runs/elixir_demo/last.ckpt)")
    parser.add_argument("-o", "--out", help="output .safetensors file (default: beside the checkpoint)")
    parser.add_argument("--prefix", help="name prefix to strip (default: the shared LightningModule attribute)")
    parser.add_argument("--bf16", action="store_true", help="write floating-point tensors as bfloat16")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, prefix=args.prefix,
                                dtype=torch.bfloat16 if args.bf16 else None)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"lightning_elixir.export: {exc}", file=sys.stderr)
        return 2
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        keys = list(f.keys())
    print(f"wrote {out} ({len(keys)} tensors, {out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
