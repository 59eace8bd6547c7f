"""Checkpoints survive a save killed at any stage, and a damaged shard is named at load and export (issue 18)."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from lightning_elixir import checkpoint as ckpt

STAGES = ("shards", "metadata", "checksums", "swap", "between-renames", "cleanup")


def _save(path, value: float) -> None:
    state = {"state_dict": {"model.w": torch.full((64,), value), "model.b": torch.arange(8.0) * value}}
    ckpt.atomic_save(state, {"epoch": int(value)}, path, rank=0, barrier=lambda: None, broadcast=lambda x: x)


def _load(path) -> float:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return float(state["state_dict"]["model.w"][0])


def _killed_save(path, value: float, at: str) -> None:
    def stage(name: str) -> None:
        if name == at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: what a power cut or OOM kill leaves

    ckpt._stage = stage
    _save(path, value)
    os._exit(3)  # the stage was never reached


@pytest.mark.parametrize("stage", STAGES)
def test_a_save_killed_at_each_stage_leaves_a_complete_verified_checkpoint(tmp_path, stage):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    proc = multiprocessing.get_context("fork").Process(target=_killed_save, args=(path, 2.0, stage))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, f"the save was not killed at {stage!r} (exit code {proc.exitcode})"
    ckpt.recover(path)  # what load and export run first
    assert ckpt.is_checkpoint_dir(path) and ckpt.verify_checkpoint(path)
    # Before the new directory is renamed in, the old checkpoint is what loads; after, the new one.
    assert _load(path) == (2.0 if stage == "cleanup" else 1.0)
    _save(path, 3.0)  # the next save clears what the killed one left
    assert _load(path) == 3.0 and ckpt.verify_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _shard(path):
    shards = sorted(path.glob("*.distcp"))
    assert shards, "torch.distributed.checkpoint wrote no .distcp shard"
    return shards[0]


def test_two_flipped_bits_in_a_shard_are_named_at_export(tmp_path, capsys):
    from lightning_elixir.export import export_checkpoint, main

    path = tmp_path / "last.ckpt"
    _save(path, 1.5)
    assert export_checkpoint(path).is_file()  # a sound checkpoint exports
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0b0100_0000  # two bits, as a failing disk or a bad copy flips them
    data[len(data) // 2 + 3] ^= 0b0000_0010
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard.name} .* does not match the SHA-256"):
        ckpt.verify_checkpoint(path)
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard.name}.*truncated or corrupt"):
        export_checkpoint(path, tmp_path / "out.safetensors")
    assert main([str(path), "-o", str(tmp_path / "out.safetensors")]) == 2
    assert shard.name in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_a_truncated_or_missing_shard_is_named(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    shard = _shard(path)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard.name} \(100 bytes\) does not match"):
        ckpt.verify_checkpoint(path)
    shard.unlink()
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard.name} is missing"):
        ckpt.verify_checkpoint(path)


def test_checksums_cover_every_file_and_old_checkpoints_still_load(tmp_path):
    import json

    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    listed = set(json.loads((path / ckpt.CHECKSUMS_FILENAME).read_text())["files"])
    on_disk = {p.name for p in path.iterdir()} - {ckpt.CHECKSUMS_FILENAME}
    assert listed == on_disk and {".metadata", ckpt.METADATA_FILENAME} <= listed
    (path / ckpt.CHECKSUMS_FILENAME).unlink()  # saved before checksums existed: nothing to verify, still loads
    assert ckpt.verify_checkpoint(path) is False and _load(path) == 1.0


def test_files_and_directories_are_fsynced_before_the_swap_and_the_rename_after(tmp_path, monkeypatch):
    """Issue 18: the rename was atomic but not durable (no fsync), so a power loss could still lose the save."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst)

    path = tmp_path / "last.ckpt"
    _save(path, 1.0)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _save(path, 2.0)
    swap = next(i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(f"-> {path}"))
    synced_before = {os.path.basename(p) for kind, p in events[:swap] if kind == "fsync"}
    tmp_name = events[swap][1].split(" -> ")[0]
    # every shard, meta.pt, checksums.json and the temporary directory itself, before it is renamed in
    assert {ckpt.METADATA_FILENAME, ckpt.CHECKSUMS_FILENAME, os.path.basename(tmp_name)} <= synced_before
    assert any(name.endswith(".distcp") for name in synced_before)
    assert ("fsync", str(tmp_path)) in events[swap:]  # the parent directory: the rename itself is durable
    assert _load(path) == 2.0
