"""Where a rank sits: ``replicas`` data-parallel copies of a pipeline of ``pipeline_ranks`` ranks.

Global rank = replica x ranks per pipeline + position, so each pipeline is a block of consecutive
ranks (``DeviceMesh`` dimensions ``("dp", "pp")``). :class:`Layout` is the arithmetic (pure, valid
before any process group exists); :func:`build_groups` makes the process groups once the world is up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from sky_strategy.config import SkyConfig

__all__ = ["Layout", "PipelineGroups", "build_groups"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One rank's place in ``replicas`` x ``pipeline_ranks``.

    Args:
        replicas: data-parallel copies of the pipeline.
        pipeline_ranks: ranks (stage devices) per pipeline.
        rank: this process's global rank.

    Example:
        >>> Layout.of(SkyConfig(data_parallel=2), world=4, rank=3)
        Layout(replicas=2, pipeline_ranks=2, rank=3)
        >>> Layout.of(SkyConfig(data_parallel=2), world=4, rank=3).replica_rank
        1
    """

    replicas: int
    pipeline_ranks: int
    rank: int

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.pipeline_ranks < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"Layout(replicas={self.replicas}, pipeline_ranks={self.pipeline_ranks}, rank={self.rank}):"
                             f" the rank must lie in 0..{self.world - 1} and both counts be >= 1")

    @classmethod
    def of(cls, config: SkyConfig, *, world: int, rank: int) -> Layout:
        """The layout ``config`` gives ``world`` ranks (raises as :meth:`SkyConfig.layout` does)."""
        replicas, ranks = config.layout(world)
        return cls(replicas=replicas, pipeline_ranks=ranks, rank=rank)

    @property
    def world(self) -> int:
        return self.replicas * self.pipeline_ranks

    @property
    def replica_rank(self) -> int:
        """Which copy of the pipeline this rank belongs to."""
        return self.rank // self.pipeline_ranks

    @property
    def pipeline_rank(self) -> int:
        """This rank's position inside its pipeline."""
        return self.rank % self.pipeline_ranks


@dataclass(frozen=True, kw_only=True)
class PipelineGroups:
    """The process groups of a layout (all ``None`` with one replica: the pipeline is the whole world).

    Args:
        device_mesh: the ``("dp", "pp")`` ``DeviceMesh``.
        pipeline: this rank's pipeline (the ranks of its replica).
        replicas: this rank's peers at the same position in the other replicas.
    """

    device_mesh: Any = None
    pipeline: dist.ProcessGroup | None = None
    replicas: dist.ProcessGroup | None = None


def build_groups(layout: Layout, device_type: str) -> PipelineGroups:
    """Collective (every rank calls it) when there are replicas; nothing to build for one pipeline."""
    if layout.replicas == 1:
        return PipelineGroups()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (layout.replicas, layout.pipeline_ranks), mesh_dim_names=("dp", "pp"))
    return PipelineGroups(device_mesh=mesh, pipeline=mesh.get_group("pp"), replicas=mesh.get_group("dp"))
