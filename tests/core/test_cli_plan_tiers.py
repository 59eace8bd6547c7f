"""`tightfit plan elixir` with the three tiers: `--host-budget` (or `--host-memory`, the host's memory) and a disk tier (`--disk-dir`, `--disk-preset`,
`--disk-space`) reach the search; a short host names itself and the disk that would fix it."""

from __future__ import annotations

import pytest

from tightfit.cli import main
from tightfit.planner.elixir import ElixirPlan

# GPT-2 small (124 M parameters, ~1.9 GiB of fp32 AdamW state) on a 1.5 GiB device with a 1.5 GiB host budget:
# offloading every unit still leaves 1.85 GiB on the host, so only a disk for the optimizer state makes it fit.
BASE = ["plan", "elixir", "--model", "gpt2", "--preset", "a100-40g", "--device-memory", "1536MiB",
        "--host-budget", "1536MiB", "--batch", "1", "--seq", "128"]


def test_a_short_host_names_the_host_tier_and_the_disk_fix(capsys):
    assert main(BASE) == 3
    err = capsys.readouterr().err
    assert "host memory budget is 1.50 GiB, the least-memory plan needs 1.85 GiB" in err
    assert "give a disk directory (disk_dir)" in err


def test_a_disk_preset_lets_units_keep_their_optimizer_state_on_disk(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*BASE, "--disk-preset", "nvme-gen4", "--disk-space", "100GiB", "--json", str(out)]) == 0
    plan = ElixirPlan.from_json(out)
    assert plan.disk_units and plan.disk_bytes_per_rank > 0
    assert all(plan.units[i].offload and plan.units[i].tier.state_on == "disk" for i in plan.disk_units)
    assert "disk I/O" in capsys.readouterr().out


def test_disk_flags_are_checked_before_any_planning(tmp_path, capsys):
    assert main([*BASE, "--disk-dir", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    assert main([*BASE, "--host-budget", "lots"]) == 2
    assert "argument --host-budget: cannot read memory size 'lots'" in capsys.readouterr().err


def test_host_memory_as_the_issue_spells_it_plans_the_disk_tier(tmp_path, capsys):
    # `--host-memory 4GiB` is the host's memory (the budget is x0.8 / ranks per node, as for a measured host):
    # 1.9 GiB of AdamW state on a 1.5 GiB device and a 1.5 GiB host needs the disk; without a disk tier it fails.
    spelled = [x if x != "--host-budget" else "--host-memory" for x in BASE]
    spelled[spelled.index("--host-memory") + 1] = "1920MiB"
    assert main(spelled) == 3
    assert "give a disk directory (disk_dir)" in capsys.readouterr().err
    out = tmp_path / "plan.json"
    assert main([*spelled, "--disk-preset", "nvme-gen4", "--disk-space", "100GiB", "--json", str(out)]) == 0
    plan = ElixirPlan.from_json(out)
    assert plan.disk_units and plan.host_bytes_per_rank <= int(1920 * 2**20 * 0.8)


def test_the_plot_shows_each_unit_s_tier(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.svg"
    assert main(["-q", *BASE, "--disk-preset", "nvme-gen4", "--disk-space", "100GiB", "--plot", str(out)]) == 0
    svg = out.read_text()
    assert "red: optimizer state on disk" in svg and "optimizer state on disk" in svg.replace(
        "red: optimizer state on disk", "", 1)


def test_a_host_too_small_for_the_master_weights_puts_them_and_the_parameters_on_disk(tmp_path, capsys):
    # 900 MiB of host for ~1.9 GiB of state: optimizer state on disk alone leaves the fp32 master weights and
    # gradients (~0.93 GiB) and the staging area on the host; tier 3 keeps only the gradients (and two parameter
    # shards while used) there, and explain shows each unit's tiers.
    small = [*BASE[:BASE.index("--host-budget")], "--host-budget", "900MiB", *BASE[BASE.index("--host-budget") + 2:]]
    out = tmp_path / "plan.json"
    assert main([*small, "--disk-preset", "nvme-gen4", "--disk-space", "100GiB", "--json", str(out)]) == 0
    plan = ElixirPlan.from_json(out)
    assert plan.param_disk_units and plan.host_bytes_per_rank <= 900 * 2**20
    assert all(plan.units[i].tier.params_on == "disk" for i in plan.param_disk_units)
    text = capsys.readouterr().out
    assert "params wait on" in text and "master weights on disk" in text
