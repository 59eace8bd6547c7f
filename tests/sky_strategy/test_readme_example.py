"""The README's Sky example runs as written: a script that Lightning relaunches as two CPU processes, which plan a
partition for a 3x slower rank 1 and train four steps."""

from __future__ import annotations

from tests.helpers.docs import python_block, run_script
from tests.helpers.multiprocess import free_port, unlaunched_env
from tests.helpers.runif import RunIf


@RunIf(min_world=2)
def test_readme_sky_example_trains_on_two_processes(tmp_path):
    # Lightning starts the ranks itself (no rank variables inherited), on a free port: other tests' ranks may hold
    # the one it would pick.
    env = unlaunched_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = run_script(python_block("README.md", "Sky: pipelines balanced"), tmp_path, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert "balanced partition of 7 layers over 2 devices" in text, text[-3000:]
    assert "`max_steps=4` reached" in text, text[-3000:]
