"""The README's energon example runs as written: a script (the workers are spawned and import it), given a model
directory, generating on two tensor-parallel workers."""

from __future__ import annotations

from tests.helpers.docs import python_block, run_script
from tests.helpers.runif import RunIf


@RunIf(min_world=2)
def test_readme_energon_example_generates_on_two_workers(tmp_path):
    from energon_infer.demo import write_random_llama

    model = write_random_llama(tmp_path / "model", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    out = run_script(python_block("README.md", "EnergonAI: serve a model"), tmp_path, args=[str(model)])
    printed = [ln for ln in out.stdout.splitlines() if ln.endswith((" length", " stop"))]
    assert len(printed) == 2, out.stdout[-2000:]  # one line per prompt: its text and why it finished
