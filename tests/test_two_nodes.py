"""Two "nodes" on 127.0.0.1: two `torchrun` launchers (`--nnodes 2`, c10d rendezvous), one process each,
training with `Trainer(strategy="elixir", num_nodes=2)` and `strategy="sky"`; losses equal one process's.

Elixir shards data-parallel: each node trains on its half of the global batch, so node r's loss at step k is the
single-process model's loss (trained on the whole global batch) on that half. Sky runs one pipeline over the two
nodes (a stage on each): both see the whole batch, and the loss is the single-process loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers.multiprocess import free_port, unlaunched_env
from tests.helpers.runif import RunIf

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "helpers" / "two_nodes_train.py"


def _launch_two_nodes(strategy: str, out: Path) -> list[dict]:
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = unlaunched_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--max-restarts", "0", str(SCRIPT), "--strategy", strategy, "--out", str(out)]
    # Two launchers, as on two hosts: neither knows the other's process, only the rendezvous endpoint.
    nodes = [subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=400)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    written = all((out / f"{strategy}-rank{r}.json").exists() for r in range(2))
    for node, log in zip(nodes, logs):
        # The c10d rendezvous lives in the store of the launcher that bound the endpoint: a launcher that finishes
        # after it may find the store gone when it shuts the rendezvous down, and exit 1 with both ranks done
        # (seen in a loaded make test run). The results are checked against one process below either way.
        teardown_only = written and "failed to shutdown the rendezvous" in log
        assert node.returncode == 0 or teardown_only, log[-4000:]
    return [json.loads((out / f"{strategy}-rank{r}.json").read_text()) for r in range(2)]


def _reference(replicas: int, steps: int) -> list:
    """One process trains on the global batch (every replica's batch together); per step, the loss on each
    replica's share and on the whole. Shares are dealt as Lightning's DistributedSampler deals them
    (shuffled with seed 0, epoch 0; replica r takes every replicas-th index from r)."""
    import torch
    from torch.utils.data import DistributedSampler

    from tests.helpers.two_nodes_train import BATCH, Net, dataset

    model, data = Net(), dataset()
    shares = [list(DistributedSampler(data, num_replicas=replicas, rank=r, shuffle=True, seed=0))
              for r in range(replicas)]
    opt = model.configure_optimizers()
    out = []
    for k in range(steps):
        parts = [torch.tensor(share[k * BATCH:(k + 1) * BATCH]) for share in shares]
        with torch.no_grad():
            each = [float(model.loss_fn(model(data.tensors[0][i]), data.tensors[1][i])) for i in parts]
        idx = torch.cat(parts)
        loss = model.loss_fn(model(data.tensors[0][idx]), data.tensors[1][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append((each, float(loss.detach())))
    return out


@RunIf(lightning=True)
@pytest.mark.parametrize("strategy", ["elixir", "sky"])
def test_two_torchrun_nodes_train_like_one_process(tmp_path, strategy):
    from tests.helpers.two_nodes_train import STEPS

    ranks = _launch_two_nodes(strategy, tmp_path)
    assert sorted(r["node_rank"] for r in ranks) == [0, 1]
    assert all(r["world_size"] == 2 and r["num_nodes"] == 2 for r in ranks)
    assert all(len(r["losses"]) == STEPS for r in ranks)
    if strategy == "elixir":
        assert all(r["strategy"] == "ElixirStrategy" for r in ranks)
        ref = _reference(2, STEPS)  # data parallel: two nodes x BATCH samples per step
        for r in ranks:
            expected = [halves[r["global_rank"]] for halves, _ in ref]
            assert r["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-5), (r, expected)
    else:
        assert all(r["strategy"] == "SkyStrategy" for r in ranks)
        ref = _reference(1, STEPS)  # one pipeline: both nodes see the same BATCH samples
        expected = [whole for _, whole in ref]
        for r in ranks:
            assert r["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-5), (r, expected)
