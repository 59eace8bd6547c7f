"""Human-readable views of an :class:`~tightfit.planner.elixir.ElixirPlan`: the plan table and the
translation to the closest DeepSpeed ZeRO configuration (part of :mod:`tightfit.planner.elixir`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tightfit.planner.elixir.disk import Tier
from tightfit.units import format_bytes, format_table

if TYPE_CHECKING:
    from tightfit.planner.elixir.plan import ElixirPlan, UnitPlan

__all__ = ["explain", "deepspeed_config"]


def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _span(units: list[UnitPlan]) -> str:
    first, last = units[0].blocks[0], units[-1].blocks[-1]
    return first if first == last else f"{first or '<root>'} .. {last or '<root>'}"


def explain(plan: ElixirPlan, *, full: bool = False) -> str:
    step = plan.step_time_s
    tokens = plan.tokens_per_step
    lines = [
        f"Elixir plan for {plan.model} ({_count(plan.param_numel)} parameters, inputs {plan.inputs} per rank) on "
        f"{plan.device}, {plan.precision} (params {plan.param_dtype}, reduce {plan.reduce_dtype}), {plan.optimizer}",
        f"predicted step {step:.3f} s ({tokens / step:,.0f} tokens/s over {plan.world_size} rank(s)), peak "
        f"{format_bytes(plan.peak_bytes)} of {format_bytes(plan.budget_bytes)} per device, host state "
        f"{format_bytes(plan.host_bytes_per_rank)} per rank"
        + (f", disk state {format_bytes(plan.disk_bytes_per_rank)} per rank in {plan.disk_path or 'the disk tier'}"
           if plan.disk_units else "")
        + f"; prefetch {plan.forward_prefetch} (forward) / "
        f"{plan.backward_prefetch} (backward) units",
        "",
    ]
    # Fold runs of consecutive units with the same choices (24 identical layers read as one row).
    groups: list[list[UnitPlan]] = []
    for u in plan.units:
        if not full and groups and _sig(groups[-1][-1]) == _sig(u):
            groups[-1].append(u)
        else:
            groups.append([u])
    disk = bool(plan.disk_units)
    params_disk = bool(plan.param_disk_units)  # a column for where master weights and parameters wait
    grads_disk = bool(plan.grad_disk_units)  # and one for where gradients wait between backward and the step
    rows = []
    index = 0
    for g in groups:
        ids = f"{index}" if len(g) == 1 else f"{index}-{index + len(g) - 1}"
        index += len(g)
        blocks = sum(len(u.blocks) for u in g)
        ck = sum(len(u.checkpoint) for u in g)
        share = sum(u.time_s for u in g) / step * 100 if step > 0 else 0.0
        tier = g[0].tier
        rows.append((ids, _span(g), g[0].mode, tier.state_on, *((tier.params_on,) if params_disk else ()),
                     *((tier.grads_on,) if grads_disk else ()), f"{ck}/{blocks}",
                     _count(sum(u.param_numel for u in g)), format_bytes(sum(u.device_bytes for u in g)),
                     format_bytes(sum(u.host_bytes for u in g)),
                     *((format_bytes(sum(u.disk_bytes for u in g)),) if disk else ()),
                     format_bytes(g[0].gathered_bytes), f"{share:.1f}%"))
    rows.append(("total", f"{sum(len(u.blocks) for u in plan.units)} blocks", "", "", *(("",) if params_disk else ()),
                 *(("",) if grads_disk else ()),
                 f"{len(plan.checkpointed_blocks)}", _count(plan.param_numel),
                 format_bytes(sum(u.device_bytes for u in plan.units)), format_bytes(plan.host_bytes_per_rank),
                 *((format_bytes(plan.disk_bytes_per_rank),) if disk else ()),
                 "", f"{sum(u.time_s for u in plan.units) / step * 100:.1f}%" if step > 0 else ""))
    header = ("unit", "blocks", "mode", "state on", *(("params wait on",) if params_disk else ()),
              *(("grads wait on",) if grads_disk else ()), "ckpt", "params",
              "device state", "host state", *(("disk state",) if disk else ()), "gathered", "time")
    left = 4 + params_disk + grads_disk
    lines.append(format_table(rows, header, align="l" * left + "r" * (len(header) - left)))
    m, b = plan.memory, plan.breakdown
    lines += [
        "",
        f"peak memory: {m.phase} of {m.block or '<root>'}: sharded state {format_bytes(m.state_bytes)} + parameters "
        f"and gradients {format_bytes(m.params_bytes)} + activations {format_bytes(m.activation_bytes)} + margin "
        f"{format_bytes(m.margin_bytes)} (fragmentation, reserve) = {format_bytes(plan.peak_bytes)}",
        f"step time: compute {b.compute_s:.3f} s + recompute {b.recompute_s:.3f} s + exposed communication "
        f"{b.exposed_comm_s:.3f} s + optimizer {b.optimizer_s:.3f} s"
        + (f" (disk I/O {b.disk_io_s:.3f} s of reads and write-backs, overlapped with the host step)"
           if disk else "") + f" = {step:.3f} s",
    ]
    lines += _process_budget(plan)
    if params_disk:
        lines.append(f"units {_ids(plan.param_disk_units)}: fp32 master weights on disk with the optimizer state "
                     "(streamed together in the step); parameters wait on disk between uses and are read one unit "
                     f"ahead of forward and backward ({b.param_io_s:.3f} s of reads a step before overlap)")
    if grads_disk:
        lines.append(f"units {_ids(plan.grad_disk_units)}: gradients on disk from backward to the step (written "
                     "behind each unit's backward, read by the step with the state); under gradient accumulation "
                     + ("the micro-batches' sums stay in RAM (they fit the host budget)" if plan.grads_accumulate_on_host
                        else "each micro-batch reads, adds and writes the sums back (they do not fit the host budget)"))
    if plan.runner_ups:
        lines += ["", "runner-ups (the best plan of each other grouping into units):"]
        lines.append(format_table(
            [(r.family, f"{r.step_time_s:.3f} s", format_bytes(r.peak_bytes), r.offloaded, r.checkpointed, r.why)
             for r in plan.runner_ups],
            ("units", "step", "peak", "offloaded", "ckpt", "slower by / why"), align="lrrrrl"))
        lines.append(f"why this plan: it beats the runner-up by {plan.runner_ups[0].why}")
    lines.append(f"cost model: {plan.cost_model}")
    lines.append(f"search: {plan.search_method}, {plan.candidates_evaluated:,} plans priced in "
                 f"{plan.search_seconds:.2f} s")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _process_budget(plan: ElixirPlan) -> list[str]:
    """The whole process per device against its budget, line by line: what the process held before the plan (the
    reserve), the plan's state, in-flight parameters and temporaries (the disk tier's staging buffers named),
    activations, the allocator's slack, and what is left."""
    m = plan.memory
    slack = max(0, m.margin_bytes - m.reserved_bytes)
    source = f" ({plan.budget_source})" if plan.budget_source else ""
    in_flight = "parameters and gradients in flight" if m.phase != "optimizer" else "optimizer-step temporaries"
    rows = [
        ("reserve: held outside the plan (interpreter, libraries, data; a CUDA context)", m.reserved_bytes),
        ("training state (parameters, gradients, optimizer state)", m.state_bytes),
        (in_flight + (f" (disk-tier staging buffers {format_bytes(m.staging_bytes)})" if m.staging_bytes else ""),
         m.params_bytes),
        ("activations", m.activation_bytes),
        ("allocator slack (fragmentation margin)", slack),
    ]
    width = max(len(label) for label, _ in rows)
    out = [f"whole process per device, at the peak ({m.phase} of {m.block or '<root>'}), budget "
           f"{format_bytes(plan.budget_bytes)}{source}:"]
    out += [f"  {label:<{width}}  {format_bytes(value):>11}" for label, value in rows]
    left = plan.budget_bytes - plan.peak_bytes
    out.append(f"  {'= predicted peak':<{width}}  {format_bytes(plan.peak_bytes):>11}  "
               + (f"({format_bytes(left)} left of the budget)" if left >= 0 else
                  f"({format_bytes(-left)} over the budget)"))
    return out


def _ids(ids: tuple[int, ...]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and list(ids) == list(range(ids[0], ids[-1] + 1)) else \
        ", ".join(map(str, ids))


def _sig(u: UnitPlan) -> tuple[object, ...]:
    return (u.mode, u.tier, len(u.checkpoint) == len(u.blocks), bool(u.checkpoint), len(u.blocks),
            u.param_numel)


def deepspeed_config(plan: ElixirPlan) -> tuple[dict, tuple[str, ...]]:
    """(closest DeepSpeed config, what it cannot express).

    Mapping: any resharded unit -> stage 3 (DeepSpeed has one reshard policy for all parameters);
    else any kept unit -> stage 2; all replicated -> stage 0. Offloaded fraction of parameter
    elements ``f``: ``offload_optimizer`` with ``ratio = f`` (partial offload is a stage-3 feature,
    ZeRO-Offload++), ``offload_param`` only when every unit is offloaded. Prefetch depth -> the
    largest sum of parameter elements over ``backward_prefetch`` consecutive units
    (``stage3_prefetch_bucket_size`` counts elements).
    """
    units = plan.units
    total = max(1, plan.param_numel)
    modes = {u.mode for u in units}
    gaps: list[str] = []
    stage = 3 if "reshard" in modes else 2 if "keep" in modes else 0
    if len(modes) > 1:
        gaps.append(f"per-unit modes ({', '.join(sorted(modes))}): DeepSpeed applies one ZeRO stage ({stage}) to "
                    "every parameter")
    if stage == 2:
        gaps.append("kept units are sharded at rest in FSDP2; DeepSpeed stage 2 keeps a full parameter copy on "
                    "every rank, so its memory is higher than the plan predicts")
    off_elems = sum(u.param_numel for u in units if u.offload)
    frac = off_elems / total
    zero: dict[str, object] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if off_elems:
        opt: dict[str, object] = {"device": "cpu", "pin_memory": True}
        disk_elems = sum(u.param_numel for u in units if u.tier >= Tier.DISK)
        if disk_elems:
            # ZeRO-Infinity puts all offloaded optimizer state on NVMe or none of it.
            opt = {"device": "nvme", "nvme_path": plan.disk_path or "<disk_dir>", "pin_memory": True}
            if disk_elems < off_elems:
                gaps.append(f"optimizer state on disk for {disk_elems / off_elems:.2f} of the offloaded parameters: "
                            "DeepSpeed puts all offloaded optimizer state on NVMe; all of it goes there")
        if frac < 1:
            if stage == 3:
                opt["ratio"] = round(frac, 4)
                gaps.append(f"which units are offloaded: DeepSpeed offloads a fraction ({frac:.2f}) of optimizer "
                            "states, not chosen units")
            else:
                gaps.append(f"partial offload ({frac:.2f} of parameters): DeepSpeed's ratio needs stage 3; "
                            "offloading all optimizer state instead")
        zero["offload_optimizer"] = opt
        param_elems = sum(u.param_numel for u in units if u.tier >= Tier.DISK_PARAMS)
        if frac >= 1 and stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            if param_elems:
                # ZeRO-Infinity's offload_param on NVMe: all parameters or none (master weights go with the
                # optimizer state in offload_optimizer already).
                zero["offload_param"] = {"device": "nvme", "nvme_path": plan.disk_path or "<disk_dir>",
                                         "pin_memory": True}
                if param_elems < off_elems:
                    gaps.append(f"parameters on disk for {param_elems / off_elems:.2f} of the offloaded parameters: "
                                "DeepSpeed's offload_param puts all of them on NVMe or none")
        elif frac < 1:
            gaps.append("parameters of offloaded units stay on the device: DeepSpeed offloads all parameters "
                        "(offload_param) or none")
        if plan.grad_disk_units:
            gaps.append("gradients on disk between backward and the step (tier DISK_GRADS): ZeRO-Infinity has no such "
                        "setting; its gradients stay in host memory")
    if stage == 3:
        window = max(1, plan.backward_prefetch)
        sizes = [u.param_numel for u in units]
        bucket = max(sum(sizes[i:i + window]) for i in range(len(sizes)))
        zero["stage3_prefetch_bucket_size"] = int(bucket)
        zero["stage3_max_live_parameters"] = int(max(bucket, max(sizes)) * 2)
        zero["stage3_param_persistence_threshold"] = 0 if "replicate" not in modes else int(
            max(u.param_numel for u in units if u.mode == "replicate"))
        if "replicate" in modes:
            gaps.append("replicated units: DeepSpeed keeps parameters below stage3_param_persistence_threshold "
                        "(elements) unpartitioned, by size, not by unit")
    cfg: dict[str, object] = {"zero_optimization": zero}
    shapes = list(plan.inputs.values())
    if shapes and shapes[0]:
        cfg["train_micro_batch_size_per_gpu"] = int(shapes[0][0])
    if plan.precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    elif plan.precision.startswith("16"):
        cfg["fp16"] = {"enabled": True}
    ck = plan.checkpointed_blocks
    if ck:
        cfg["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False, "number_checkpoints": len(ck)}
        gaps.append(f"which blocks are checkpointed ({len(ck)} of {len(plan.blocks)}): DeepSpeed's config only "
                    "configures deepspeed.checkpointing; the model must wrap those blocks itself")
    if plan.forward_prefetch != plan.backward_prefetch:
        gaps.append(f"separate forward ({plan.forward_prefetch}) and backward ({plan.backward_prefetch}) prefetch "
                    "depths: DeepSpeed has one prefetch bucket")
    return cfg, tuple(gaps)
