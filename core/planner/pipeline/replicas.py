"""Data-parallel replicas of one pipeline: the devices and links the shared plan is made for.

Every replica runs the same plan and they step together (their gradients are averaged before each
optimizer step), so pipeline position ``j`` is paced by the slowest of its copies and must fit the
smallest of them; the link between positions ``a`` and ``b`` is as slow as the slowest replica's.
Ranks are numbered replica by replica: global rank ``replica * ranks_per_pipeline + position``.

Example:
    >>> from tightfit.planner.pipeline import DeviceSpec
    >>> devs = [DeviceSpec(name=f"r{i}", speed=s, memory_bytes=m)
    ...         for i, (s, m) in enumerate([(1.0, 8), (1.0, 8), (1.0, 4), (0.25, 8)])]
    >>> merged, links = merge_replicas(devs, 1e9, replicas=2)
    >>> [(d.name, d.speed, d.memory_bytes) for d in merged], links
    ([('r0/r2', 1.0, 4), ('r1/r3', 0.25, 8)], 1000000000.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tightfit.planner.errors import PlanError
from tightfit.planner.pipeline.problem import DeviceSpec

__all__ = ["merge_replicas", "merge_latency"]

Links = float | Sequence[Sequence[float]] | None


def merge_replicas(devices: Sequence[DeviceSpec], links: Links, *,
                   replicas: int) -> tuple[list[DeviceSpec], Links]:
    """One pipeline's devices and links from every rank's.

    Args:
        devices: one per global rank (``replicas * ranks_per_pipeline`` of them).
        links: ``None``, one bandwidth, or a matrix over global ranks.
        replicas: how many copies of the pipeline the ranks form.

    Returns ``(devices, links)`` per pipeline position: position ``j`` has the speed of the slowest of
    ranks ``j, j + P, j + 2P, ...``, the smallest of their memories, and their names joined by ``/``;
    measured ``layer_seconds`` keep each layer's slowest copy, ``optimizer_bytes_per_s`` the slowest;
    a link matrix keeps, for each pair of positions, the slowest of the replicas' links (a latency
    matrix, :func:`merge_latency`, the largest).
    """
    world = len(devices)
    if replicas < 1 or world % replicas:
        raise PlanError(f"{world} devices cannot form {replicas} equal replicas of a pipeline; give a replica "
                        f"count that divides {world}")
    if replicas == 1:
        return list(devices), links
    ranks = world // replicas
    merged = []
    for j in range(ranks):
        copies = [devices[k * ranks + j] for k in range(replicas)]
        slowest = min(copies, key=lambda d: d.speed)
        timed = [d.layer_seconds for d in copies if d.layer_seconds is not None]
        rates = [d.optimizer_bytes_per_s for d in copies if d.optimizer_bytes_per_s is not None]
        merged.append(dataclasses.replace(
            slowest, name="/".join(d.name for d in copies), memory_bytes=min(d.memory_bytes for d in copies),
            layer_seconds=tuple(max(ts) for ts in zip(*timed)) if len(timed) == len(copies) else None,
            optimizer_bytes_per_s=min(rates) if len(rates) == len(copies) else None))
    if links is None or isinstance(links, (int, float)):
        return merged, links
    if len(links) != world or any(len(row) != world for row in links):
        raise PlanError(f"links must be a {world}x{world} matrix over the global ranks to merge replicas; got "
                        f"{len(links)} rows")
    merged_links = [[min(links[k * ranks + a][k * ranks + b] for k in range(replicas)) for b in range(ranks)]
                    for a in range(ranks)]
    return merged, merged_links


def merge_latency(latency: Links, *, replicas: int) -> Links:
    """Per-message latency between pipeline positions: the largest over the replicas (as for links,
    where the slowest is kept); ``None`` or one number pass through."""
    if latency is None or isinstance(latency, (int, float)) or replicas == 1:
        return latency
    world = len(latency)
    if replicas < 1 or world % replicas:
        raise PlanError(f"a {world}x{world} latency matrix cannot form {replicas} equal replicas")
    ranks = world // replicas
    return [[max(latency[k * ranks + a][k * ranks + b] for k in range(replicas)) for b in range(ranks)]
            for a in range(ranks)]
