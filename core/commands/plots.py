"""Pictures for ``--plot FILE``: a model profile's activation memory and an Elixir plan's units.

matplotlib is imported here only (Agg backend: no display needed), so core imports without it.
The file type follows the extension (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tightfit.commands.args import UsageError

__all__ = ["plot_model_profile", "plot_elixir_plan"]

_MIB = 2**20


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib (or drop --plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _block_levels(profile: Any, checkpointed: set[str]) -> tuple[list[str], list[float], list[float]]:
    """Activation bytes kept after each block's forward, and while its backward runs (the step model of
    ``tightfit.profiler.memory.estimate_peak``: what earlier blocks keep + this block's own peak)."""
    names, fwd, bwd = [], [], []
    prefix = 0
    prefixes = []
    for b in profile.blocks:
        prefixes.append(prefix)
        prefix += b.checkpoint_bytes if b.name in checkpointed else b.saved_bytes
        names.append(b.name)
        fwd.append(prefix / _MIB)
    for i, b in enumerate(profile.blocks):
        whole = b.backward_transient_bytes
        extra = max(whole, b.fwd_transient_bytes) if b.name in checkpointed else whole
        bwd.append((prefixes[i] + b.saved_bytes + extra) / _MIB)
    return names, fwd, bwd


def plot_model_profile(profile: Any, path: str | Path) -> Path:
    """Two panels: the traced activation-memory timeline of one step, then the level by block without
    and with checkpointing (the blocks ``--checkpointing`` chose, or every checkpointable block)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5))
    xs = range(len(profile.timeline))
    ys = [e.bytes / _MIB for e in profile.timeline]
    top.plot(xs, ys, lw=1.2, color="tab:blue")
    backward = [i for i, e in enumerate(profile.timeline) if e.phase == "backward"]
    if backward:
        top.axvspan(backward[0], backward[-1], color="tab:orange", alpha=0.08, label="backward")
    top.set_title(f"{profile.model}: activation memory during one {profile.step} step "
                  f"(peak {profile.activation_peak_bytes / _MIB:,.1f} MiB)")
    top.set_xlabel("traced operation")
    top.set_ylabel("MiB live")
    if backward:
        top.legend(loc="upper left")
    chosen = set(profile.checkpointed) or {b.name for b in profile.blocks if b.checkpointable}
    names, fwd, bwd = _block_levels(profile, set())
    _, cfwd, cbwd = _block_levels(profile, chosen)
    idx = range(len(names))
    bottom.plot(idx, fwd, "-o", ms=3, color="tab:blue", label="kept after forward")
    bottom.plot(idx, bwd, ":", color="tab:blue", label="during backward")
    bottom.plot(idx, cfwd, "-o", ms=3, color="tab:green", label=f"kept after forward, {len(chosen)} checkpointed")
    bottom.plot(idx, cbwd, ":", color="tab:green", label="during backward, checkpointed")
    step = max(1, len(names) // 24)  # about 24 labels whatever the depth
    bottom.set_xticks(list(idx)[::step], names[::step], rotation=60, ha="right", fontsize=7)
    bottom.set_ylabel("MiB of activations")
    bottom.set_title("by block (first-use order)")
    bottom.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# By UnitPlan.tier: device, host, optimizer state on disk, master weights and parameters (and gradients) too.
_TIER_COLOURS = ("tab:blue", "tab:orange", "tab:red", "darkred", "darkred")


def plot_elixir_plan(plan: Any, path: str | Path) -> Path:
    """Three panels over the plan's units: predicted time (recomputing units hatched), memory on the
    device, on the host and on disk, and the share of blocks recomputed; colour says where the state lives
    (``UnitPlan.tier``: device, host, disk; darker where the parameters wait on disk too)."""
    plt = _pyplot()
    units = plan.units
    idx = list(range(len(units)))
    colour = [_TIER_COLOURS[u.tier] for u in units]
    fig, (t_ax, m_ax, c_ax) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True)
    bars = t_ax.bar(idx, [u.time_s * 1e3 for u in units], color=colour)
    for bar, u in zip(bars, units):
        if u.checkpoint:
            bar.set_hatch("//")
    t_ax.set_ylabel("predicted ms")
    t_ax.set_title(f"Elixir plan for {plan.model} on {plan.world_size} rank(s): step {plan.step_time_s:.3f} s, "
                   f"peak {plan.peak_bytes / 2**30:.2f} of {plan.budget_bytes / 2**30:.2f} GiB "
                   "(blue: state on the device, orange: on the host, red: optimizer state on disk, dark red: "
                   "master weights and parameters too; hatched: recomputes)")
    t_ax.title.set_fontsize(9)
    m_ax.bar(idx, [u.device_bytes / _MIB for u in units], color="tab:blue", label="sharded state on the device")
    m_ax.bar(idx, [u.host_bytes / _MIB for u in units], bottom=[u.device_bytes / _MIB for u in units],
             color="tab:orange", label="state on the host")
    disk = [getattr(u, "disk_bytes", 0) / _MIB for u in units]
    if any(disk):
        m_ax.bar(idx, disk, bottom=[(u.device_bytes + u.host_bytes) / _MIB for u in units], color="tab:red",
                 label="optimizer state on disk (dark red units: master weights too)")
    m_ax.plot(idx, [u.gathered_bytes / _MIB for u in units], "k.-", lw=0.8, label="gathered while it runs")
    m_ax.set_ylabel("MiB per rank")
    tallest = max([(u.device_bytes + u.host_bytes + getattr(u, "disk_bytes", 0)) / _MIB for u in units] + [u.gathered_bytes / _MIB for u in units])
    m_ax.set_ylim(0, max(tallest, 1e-3) * 1.35)  # headroom: the legend sits above the bars, not on them
    m_ax.legend(fontsize=8, loc="upper center", ncol=3)
    c_ax.bar(idx, [len(u.checkpoint) / max(1, len(u.blocks)) for u in units], color="tab:green")
    c_ax.set_ylabel("blocks recomputed")
    c_ax.set_ylim(0, 1.05)
    step = max(1, len(units) // 24)
    c_ax.set_xticks(idx[::step], [f"{i}: {u.blocks[0]}" for i, u in enumerate(units)][::step], rotation=60,
                    ha="right", fontsize=7)
    c_ax.set_xlabel("unit: first block")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
