"""The fused optimizer's state as a TorchRec ``KeyedOptimizer``, so ``DistributedModelParallel`` checkpoints hold it.

    sd = dmp.fused_optimizer.state_dict()      # {"state": {"<fqn>.embedding_bags.t0.weight": {"exp_avg": ...}}}
    dmp.fused_optimizer.load_state_dict(sd)    # rows and state go back where they live (slot or host)

The rows update inside the backward pass, so ``step`` and ``zero_grad`` do nothing, as for
TorchRec's own fused embedding kernels. State tensors are in id order (also for tables stored in
frequency order), named as the PyTorch optimizer names them (``sum``, ``exp_avg``, ``exp_avg_sq``),
plus ``step``.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrec.optim.fused import FusedOptimizer

__all__ = ["CachedFusedOptimizer"]


class CachedFusedOptimizer(FusedOptimizer):
    """A ``KeyedOptimizer`` view of a cached collection's fused optimizer state.

    Args:
        collection: the :class:`~torchrec_cache.modules.CachedCollection` (or its sharded local part).
        prefix: prepended to the parameter keys (``"embedding_bags.<table>.weight"``).

    Example:
        >>> ebc.fused_optimizer.state_dict()["state"]["embedding_bags.t0.weight"]["exp_avg"]  # doctest: +SKIP
    """

    def __init__(self, collection: Any, prefix: str = "") -> None:
        self._collection = collection
        tables = collection.host_tables()
        self._keys = {f"{prefix}{collection.tables_attr}.{name}.weight": name for name in tables}
        params = {key: tables[name].weight for key, name in self._keys.items()}
        opt = collection.cache_config().optimizer
        group: dict[str, Any] = {"params": list(params.values())}
        if opt is not None:
            group.update(kind=opt.kind, lr=opt.lr, eps=opt.eps, beta1=opt.beta1, beta2=opt.beta2)
        self._live: dict[Any, Any] = {}
        super().__init__(params, self._read(params), [group])

    def _read(self, params: dict[str, torch.Tensor]) -> dict[Any, Any]:
        state = self._collection.fused_optimizer_state()
        out: dict[Any, Any] = {}
        for key, name in self._keys.items():
            entry = dict(state[name])
            entry["step"] = torch.tensor(float(entry.get("step", 0)))
            out[params[key]] = entry
        return out

    @property  # type: ignore[override]
    def state(self) -> dict[Any, Any]:
        """Read fresh on every access (the rows train between reads); a load copies into the last read."""
        self._live = self._read(self.params)  # type: ignore[arg-type]
        return self._live

    @state.setter
    def state(self, value: dict[Any, Any]) -> None:
        self._live = value

    def post_load_state_dict(self) -> None:
        """After ``load_state_dict`` (also through TorchRec's ``CombinedOptimizer``) copied into the state
        tensors: put them where the rows live."""
        loaded = {}
        for key, name in self._keys.items():
            entry = dict(self._live[self.params[key]])
            entry["step"] = int(entry["step"])
            loaded[name] = entry
        self._collection.load_fused_optimizer_state(loaded)

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the rows were updated in the backward pass."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to do: fused rows keep no gradient."""
