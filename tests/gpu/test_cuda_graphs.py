"""energon_infer decode steps replayed from CUDA graphs on one GPU: the same outputs as eager steps.

The CPU suite (tests/energon_infer/test_cuda_graphs.py) checks the padding and static buffers with the
capture left out; here the graphs are captured (buckets 1, 2, 4, 8, and the defaults) and replayed
with the Triton kernels chosen by ``auto``, against a runner with ``cuda_graphs=False``: logits within
tolerance, identical greedy tokens, the same KV-cache contents, and a returned output that the next
replay of the same graph does not overwrite. The engine's worker on CUDA (tests/gpu/test_energon.py) runs
with graphs on, as it is by default, every bucket captured at load.
"""

from __future__ import annotations

import pytest
import torch

from tests.energon_infer.test_cuda_graphs import PROMPTS, STEPS, run_both
from tests.gpu.common import cuda
from tests.helpers.runif import RunIf

pytestmark = RunIf(cuda=True, transformers=True)
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.energon_infer.tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("gpu_graphs") / "llama")


def _runners(path, device: torch.device, dtype: str, graphs):
    from energon_infer import ModelRunner

    kw = dict(device=str(device), dtype=dtype, block_size=4, kv_cache_tokens=512, progress=False)
    return (ModelRunner.from_pretrained(path, cuda_graphs=False, **kw),
            ModelRunner.from_pretrained(path, cuda_graphs=graphs, **kw))


def check_captured_decode(path, device: torch.device, dtype: str) -> None:
    eager, graphed = _runners(path, device, dtype, BUCKETS)
    assert eager.decode_graphs is None and graphed.decode_graphs is not None
    outs = run_both(eager, graphed, STEPS)
    graphs = graphed.decode_graphs
    assert graphs.failed is None and graphs.captured == BUCKETS, (graphs.failed, graphs.captured)
    scale = max(w.abs().max().item() for w, _ in outs)
    err = max((w.float() - g.float()).abs().max().item() for w, g in outs)
    agree = [w.argmax(-1).tolist() == g.argmax(-1).tolist() for w, g in outs]
    n = graphed.cache.num_blocks
    kv_err = (graphed.cache.k[:, :n].float() - eager.cache.k[:, :n].float()).abs().max().item()
    if dtype == "float32":  # the Triton kernels run fp32 in IEEE mode: only the matmul shapes differ
        assert err <= 1e-4 and all(agree) and kv_err <= 1e-4, (err, agree, kv_err)
    else:
        assert err <= 0.05 * scale and sum(agree) >= len(agree) - 1 and kv_err <= 0.05 * scale, (err, scale, agree)


def test_captured_decode_equals_eager_fp32(llama_dir):
    check_captured_decode(llama_dir, cuda(), "float32")


def test_captured_decode_tracks_eager_bf16(llama_dir):
    check_captured_decode(llama_dir, cuda(), "bfloat16")


def test_graphs_on_by_default_and_generate_gives_the_eager_tokens(llama_dir):
    from energon_infer import SamplingParams
    from energon_infer.worker.cuda_graphs import default_buckets

    eager, graphed = _runners(llama_dir, cuda(), "float32", None)
    graphs = graphed.decode_graphs
    assert graphs is not None and graphs.buckets == default_buckets(256)
    assert graphs.capture_all() == graphs.buckets, graphs.failed  # what the engine's workers do at load
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True) for i in range(7)]
    for p in (params, seeded):
        assert [g.token_ids for g in graphed.generate(PROMPTS, p)] == \
            [g.token_ids for g in eager.generate(PROMPTS, p)]
    assert graphs.failed is None and sum(graphs.padded_steps.values()) > 0


def test_an_output_survives_the_next_replay_of_its_graph(llama_dir):
    _, graphed = _runners(llama_dir, cuda(), "float32", BUCKETS)
    graphed.forward(list(enumerate(PROMPTS)))
    first = graphed.forward([(0, [5]), (1, [6]), (2, [7])])  # bucket 4
    kept = first.clone()
    graphed.forward([(3, [8]), (4, [9]), (5, [10])])  # bucket 4 again: the graph's output buffer is rewritten
    torch.cuda.synchronize()
    assert torch.equal(first, kept)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.padded_steps[4] == 2
