"""docs/energon.md's "Serve from one controller" block runs as written (as a script: the workers are spawned and
import it)."""

from __future__ import annotations

from tests.helpers.docs import python_block, run_script
from tests.helpers.runif import RunIf


@RunIf(min_world=2)
def test_docs_engine_snippet_runs_on_two_workers(tmp_path):
    from energon_infer.demo import write_random_llama

    model = write_random_llama(tmp_path / "model", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    code = f"MODEL_DIR = {str(model)!r}\n" + python_block("docs/energon.md", "Serve from one controller") + "        assert len(outs) == 2 and outs[0].token_ids\n"
    out = run_script(code, tmp_path)
    assert "'stages': [" in out.stdout and "'groups': 1" in out.stdout
