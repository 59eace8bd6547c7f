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


@RunIf(lightning=True, min_world=2)
def test_fabric_example_runs_on_two_processes_and_its_checkpoint_loads(tmp_path):
    code = python_block("docs/elixir.md", 'Or write the loop: `Fabric(strategy="elixir")`')
    code += ("\n    assert state['step'] == 20 and loss.item() < 5.4, loss.item()  # below ln(256) = 5.55: it learns"
             "\n    resumed = {'model': model, 'optimizer': optimizer, 'step': 0}"
             "\n    fabric.load('checkpoint', resumed)"
             "\n    assert resumed['step'] == 20"
             "\n    fabric.print('FABRIC_DONE', strategy.runtime, len(strategy.plan.units))\n")
    out = run_script(code, tmp_path, env=unlaunched_env())
    assert "Elixir plan for GPT" in out.stdout and "FABRIC_DONE" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "checkpoint" / "meta.pt").is_file()
