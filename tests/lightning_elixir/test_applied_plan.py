"""An applied Elixir plan, read back from FSDP2's own state, is the plan: every unit, every mode, the root too.

Losses do not depend on resharding, offload placement or prefetch order, so the training tests cannot see
a unit applied with the wrong settings. Here three hand-written plans -- together every mode for the
root's own unit and for ordinary units, offloaded or not, single- and multi-module groups, checkpointed
blocks, two prefetch depths, fp32 and bf16 mixed precision -- are applied on two gloo ranks and every
FSDP2 group's ``reshard_after_forward``, offload policy, mesh layout, checkpointing, forward/backward
prefetch targets and ``MixedPrecisionPolicy`` are compared with the plan's.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

DIM = 8
BLOCKS = ("", "layers.0", "layers.1", "layers.2", "layers.3", "head")

# (precision, forward prefetch, backward prefetch, units as (blocks, mode, offload, checkpointed blocks))
PLANS = [
    ("32-true", 2, 1, [(("",), "reshard", False, ()),
                       (("layers.0",), "reshard", False, ("layers.0",)),
                       (("layers.1", "layers.2"), "keep", True, ("layers.2",)),
                       (("layers.3",), "replicate", False, ()),
                       (("head",), "replicate", True, ())]),
    ("bf16-mixed", 1, 2, [(("",), "keep", True, ()),
                          (("layers.0", "layers.1"), "replicate", True, ("layers.1",)),
                          (("layers.2",), "reshard", True, ()),
                          (("layers.3",), "keep", False, ("layers.3",)),
                          (("head",), "reshard", False, ())]),
    ("bf16-mixed", 1, 1, [(("",), "replicate", False, ()),
                          (("layers.0",), "keep", False, ()),
                          (("layers.1",), "reshard", False, ()),
                          (("layers.2", "layers.3"), "replicate", False, ()),
                          (("head",), "keep", True, ())]),
]


class Net(nn.Module):
    """A root parameter of its own (the root's unit ``""``), four layers and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM))
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _plan(index: int, world: int):
    from tightfit.planner.elixir import UnitPlan, estimate
    from tightfit.profiler.types import BlockProfile, ClusterSpec, DeviceProfile, ModelProfile, ParamInfo

    precision, df, db, units = PLANS[index]
    numel = {"": DIM, "head": DIM * 4 + 4}
    params, blocks = [], []
    for i, name in enumerate(BLOCKS):
        n = numel.get(name, DIM * DIM + DIM)
        pname = f"{name}.weight" if name else "scale"
        params.append(ParamInfo(name=pname, shape=(n,), dtype="float32", numel=n, bytes=4 * n, block=name))
        blocks.append(BlockProfile(name=name, type="Block", index=i, params=(pname,), param_numel=n, param_bytes=4 * n,
                                   fwd_flops=1e6, bwd_flops=2e6, saved_bytes=1024, checkpoint_bytes=128,
                                   transient_bytes=0, output_bytes=128, checkpointable=name != ""))
    profile = ModelProfile(
        model="net", step="train", inputs={"x": [2, DIM]}, params=tuple(params), blocks=tuple(blocks),
        forward_order=tuple(p.name for p in params), backward_order=tuple(p.name for p in reversed(params)),
        timeline=(), activation_peak_bytes=0, peak_bytes=0, fwd_flops=6e6, bwd_flops=1.2e7, param_dtype="float32")
    device = DeviceProfile(name="cpu", kind="cpu", memory_bytes=2**30, free_bytes=2**30,
                           matmul_flops={"float32": 1e10})
    plan_units = [UnitPlan(blocks=b, mode=m, tier=o, checkpoint=c) for b, m, o, c in units]
    return estimate(profile, ClusterSpec.uniform(device, world), plan_units, forward_prefetch=df,
                    backward_prefetch=db, precision=precision)


def _read_back(rank: int, world: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from lightning_elixir.apply import apply_plan, inspect_units

    out = []
    for index in range(len(PLANS)):
        torch.manual_seed(0)
        model = Net()
        apply_plan(model, _plan(index, world), init_device_mesh("cpu", (world,)))
        names = {id(m): n for n, m in model.named_modules()}
        groups = {}
        for s in inspect_units(model):
            groups[s.names] = (s.reshard_after_forward, s.offload, s.param_device, s.replicated,
                               tuple(sorted(s.checkpointed)))
        prefetch, precision = {}, {}
        for name, m in model.named_modules():
            if not isinstance(m, FSDPModule):
                continue
            state = m._get_fsdp_state()
            prefetch[name] = ([names[id(s._modules[0])] for s in state._states_to_forward_prefetch],
                              [names[id(s._modules[0])] for s in state._states_to_backward_prefetch])
            mp = state._fsdp_param_group.mp_policy
            precision[name] = (str(mp.param_dtype), str(mp.reduce_dtype))
        y = model(torch.randn(2, DIM))  # the applied model runs: forward and backward on both meshes
        y.float().sum().backward()
        out.append({"groups": groups, "prefetch": prefetch, "precision": precision})
    return out


@RunIf(min_world=2)
def test_every_units_fsdp2_settings_read_back_equal_the_plan():
    results = run_distributed(_read_back, 2, timeout=300)
    for index, (precision, df, db, units) in enumerate(PLANS):
        plan = _plan(index, 2)
        # Written from the table, not from the plan's properties: only "keep" stays gathered after forward;
        # "replicate" reshards like "reshard" (on its (world, 1) mesh). The root's own unit is the root group
        # (named ""); every other unit is the group of its blocks.
        expected = {blocks: (mode != "keep", offload, "cpu", mode == "replicate", tuple(sorted(ckpt)))
                    for blocks, mode, offload, ckpt in units}
        # Prefetch: the non-root units in plan order, each naming the first module of its group; unit i
        # gathers the next df in forward and the previous db (nearest first) in backward.
        firsts = [u.blocks[0] for u in plan.units if u.blocks != ("",)]
        want_prefetch = {f: (firsts[i + 1:i + 1 + df], firsts[max(0, i - db):i][::-1])
                         for i, f in enumerate(firsts)}
        mp = ("None", "None") if precision == "32-true" else ("torch.bfloat16", "torch.float32")
        for rank, got in enumerate(results):
            r = got[index]
            assert r["groups"] == expected, (index, rank, r["groups"], expected)
            for first, want in want_prefetch.items():
                assert tuple(map(list, r["prefetch"][first])) == tuple(map(list, want)), (index, rank, first)
            assert r["prefetch"][""] == ([], []), (index, rank)  # the root runs first: nothing to prefetch
            assert set(r["precision"].values()) == {mp}, (index, rank, r["precision"])
