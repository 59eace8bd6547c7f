"""Split a model into blocks: the repeated layers, then everything else as its own blocks.

A *block* (see :mod:`tightfit.profiler.types`) is a candidate FSDP2 unit, checkpoint region or
pipeline layer. The rule:

1. **Repeated layers**: every ``nn.ModuleList`` / ``nn.Sequential`` (the root included) with at
   least two children of one class that own parameters is a *layer container*; containers nested
   inside another container's layer are ignored (the MLP ``Sequential`` inside a transformer layer
   is part of that layer). Each child of a container is a block (``"transformer.h.3"``).
2. **The rest**: walking down from the root towards the containers, every child that is not on
   the way to a container becomes a block whole (``"transformer.wte"``, ``"lm_head"``); parameters
   registered directly on a module on the way form a block named after that module (``""`` for
   the root).
3. If no container exists, the root's children are the blocks.

Blocks are later ordered by first use in the traced forward, and a tied parameter belongs to the
block that uses it first, so every parameter is owned exactly once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

__all__ = ["BlockSpec", "find_blocks", "layer_containers"]


@dataclass(frozen=True)
class BlockSpec:
    """A block before tracing: its name, the module that runs it, and the parameters it holds.

    ``module`` is ``None`` for a block of parameters registered directly on a module on the way to
    the containers (they have no forward of their own). ``params`` are (name, Parameter) pairs;
    a tied parameter appears in every block that registers it (the trace keeps the first user).
    """

    name: str
    type: str
    module: nn.Module | None
    params: tuple[tuple[str, nn.Parameter], ...]


def _is_container(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    counts = Counter(type(c) for c in module.children() if any(True for _ in c.parameters()))
    return bool(counts) and counts.most_common(1)[0][1] >= 2


def layer_containers(model: nn.Module) -> list[str]:
    """Names of the outermost layer containers (``""`` when the root itself is one)."""
    found: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        if _is_container(module):
            found.append(name)
            return  # layers inside a layer are part of it
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return found


def find_blocks(model: nn.Module) -> list[BlockSpec]:
    """Blocks in module-definition order (the trace reorders them by first use)."""
    containers = layer_containers(model)
    if not containers:
        containers_set: set[str] = set()
        on_path: set[str] = {""}
    else:
        containers_set = set(containers)
        on_path = set()
        for c in containers:
            parts = c.split(".") if c else []
            on_path.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    blocks: list[BlockSpec] = []

    def own_params(prefix: str, module: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
        return tuple((f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False))

    def whole(name: str, module: nn.Module) -> BlockSpec:
        return BlockSpec(name, type(module).__name__, module,
                         tuple((f"{name}.{n}" if name else n, p) for n, p in module.named_parameters(remove_duplicate=False)))

    def visit(name: str, module: nn.Module) -> None:
        direct = own_params(name, module)
        if direct:
            blocks.append(BlockSpec(name, type(module).__name__, None, direct))
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if name in containers_set or (not containers_set and module is model):
                blocks.append(whole(full, child))
            elif full in on_path:
                visit(full, child)
            else:
                blocks.append(whole(full, child))

    visit("", model)
    return blocks
