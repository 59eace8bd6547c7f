"""Host <-> device row moves of the cache that do not stall the step on CUDA.

Host -> device: rows go through a pinned staging buffer per purpose, reused across batches (grown
when a batch needs more) and guarded by an event, then a ``non_blocking`` copy. Device -> host
(write-backs, the updates of rows read from host memory): an asynchronous copy into pinned memory
and an event; the host-side function runs before the next host read of the tables
(:meth:`RowMover.apply_pending`). On a CPU device both are plain calls.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RowMover"]


class RowMover:
    """Pinned staging buffers and pending host updates of one cache."""

    def __init__(self) -> None:
        self._staging: dict[str, torch.Tensor] = {}
        self._events: dict[str, Any] = {}
        self._pending: list[tuple[Any, Any, torch.Tensor]] = []

    def to_device(self, t: torch.Tensor, device: torch.device, tag: str) -> torch.Tensor:
        """Host rows ``t`` on ``device`` (through the staging buffer ``tag`` on CUDA)."""
        if device.type != "cuda":
            return t
        buf = self._staging.get(tag)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 2 * (buf.numel() if buf is not None else 0)), dtype=t.dtype,
                              pin_memory=True)
            self._staging[tag] = buf
        event = self._events.get(tag)
        if event is not None:
            event.synchronize()  # the previous copy out of this buffer has finished
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t)
        out = view.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[tag] = event
        return out

    def on_host(self, fn: Any, rows: torch.Tensor) -> None:
        """Run ``fn(rows on the host)``: at once on a CPU, after an asynchronous copy on CUDA."""
        if rows.device.type != "cuda":
            fn(rows)
            return
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, fn, host))

    def to_host_later(self, rows: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor) -> None:
        """``dst[pos] = rows`` (device rows into a host table)."""
        self.on_host(lambda r: dst.index_copy_(0, pos, r.to(dst.dtype)), rows)

    def apply_pending(self) -> None:
        """Finish every pending host update (before the host tables are read)."""
        for event, fn, host in self._pending:
            event.synchronize()
            fn(host)
        self._pending.clear()
