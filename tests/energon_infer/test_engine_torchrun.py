"""Joining a torchrun world: rank 0 holds the controller, rank 1 runs ``run_worker()``; pp=2 across the two ranks
(the result rank is rank 1, so answers travel back over the control channel), tokens equal the runtime's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.multiprocess import free_port, unlaunched_env
from tests.helpers.runif import RunIf

SCRIPT = '''
import json, os, sys
from energon_infer import Engine, SamplingParams
from energon_infer.worker.torchrun import run_worker

path, expected = sys.argv[1], json.loads(sys.argv[2])
if int(os.environ["RANK"]) == 0:
    with Engine.from_pretrained(path, pp=2, launcher="torchrun", progress=False) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
        assert got == expected, (got, expected)
        stats = engine.pipeline_stats()
        assert stats["groups"] == 2 and len(stats["ranks"]) == 2 and all(r["steps"] > 0 for r in stats["ranks"])
        assert engine.health()["pids"][1] != os.getpid()
    print("CONTROLLER OK", flush=True)
else:
    run_worker()
    print("WORKER OK", flush=True)
'''

PROMPTS = [[5, 6, 7, 8, 9], [12, 13], list(range(20, 50)), [50]]


@RunIf(min_world=2)
def test_engine_joins_a_torchrun_world(tmp_path):
    from energon_infer import ModelRunner, SamplingParams
    from energon_infer.demo import write_random_llama

    path = write_random_llama(tmp_path / "m", layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64)
    runner = ModelRunner.from_pretrained(path, progress=False)
    expected = [g.token_ids for g in runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True))]
    script = tmp_path / "serve_it.py"
    script.write_text(f"PROMPTS = {PROMPTS!r}\n" + SCRIPT)
    env = unlaunched_env(OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(path),
                          json.dumps(expected)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "CONTROLLER OK" in out.stdout and "WORKER OK" in out.stdout
