"""docs/elixir.md's examples run as written: Lightning launches the ranks itself, so each runs as a script."""

from __future__ import annotations

from tests.helpers.docs import python_block, run_script
from tests.helpers.multiprocess import unlaunched_env
from tests.helpers.runif import RunIf


@RunIf(lightning=True, min_world=2)
def test_train_example_runs_on_two_processes(tmp_path):
    code = python_block("docs/elixir.md", 'Train a model with `strategy="elixir"`')
    code += "\n    assert trainer.global_step == 20\n    print('PLAN_UNITS', len(trainer.strategy.plan.units))\n"
    out = run_script(code, tmp_path, env=unlaunched_env())
    assert "Elixir plan for LitGPT" in out.stdout and "PLAN_UNITS" in out.stdout
    assert (tmp_path / "lightning_logs" / "version_0" / "plan.json").is_file()


@RunIf(lightning=True)
def test_disk_tier_example_trains_with_optimizer_state_on_disk(tmp_path):
    first = python_block("docs/elixir.md", 'Train a model with `strategy="elixir"`')
    disk = python_block("docs/elixir.md", "State on disk")  # continues the first block, as the page says
    out = run_script(first.split('if __name__ == "__main__":')[0] + disk, tmp_path, env=unlaunched_env())
    assert "units with optimizer state on disk: (0," in out.stdout
