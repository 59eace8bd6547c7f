"""CUDA-graph decode without the capture (``capture=False``): the padded static-buffer path on CPU.

A decode step of ``b`` sequences runs in the smallest bucket ``>= b`` with padding rows pointed at the
cache's scratch block; these tests hold it to the unpadded eager step (same logits, same greedy
tokens, same KV-cache contents in every real block) for batch sizes on and between buckets. The
capture itself is tested on a GPU (tests/gpu/test_cuda_graphs.py).
"""

from __future__ import annotations

import pytest
import torch

from energon_infer import ModelRunner, SamplingParams
from energon_infer.worker.cuda_graphs import DecodeGraphs, default_buckets
from energon_infer.worker.runtime import RuntimeConfig
from energon_infer.worker.workers import StageTimer
from tests.helpers.multiprocess import run_distributed
from tests.helpers.runif import RunIf

BUCKETS = (1, 2, 4, 8)
# Seven sequences of unequal lengths: several spanning more than one block of 4 tokens.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 41)), [50], [3, 4, 5], list(range(60, 70)), [7] * 5]
# Which sequences decode in each step: on buckets (1, 2) and between them (3, 5, 6, 7), in shuffled order.
STEPS = [[0], [0, 1, 2], [0, 1, 2, 3, 4], [1, 2], list(range(7)), [6, 5, 4, 3, 2, 1], [3], [0, 2, 4, 6, 1]]


def _pair(path: str, *, capture: bool = False, **kw) -> tuple[ModelRunner, ModelRunner]:
    eager = ModelRunner.from_pretrained(path, block_size=4, kv_cache_tokens=256, progress=False, **kw)
    padded = ModelRunner.from_pretrained(path, block_size=4, kv_cache_tokens=256, progress=False, **kw)
    assert eager.decode_graphs is None  # CPU: graphs off by default
    padded.decode_graphs = DecodeGraphs(padded.stage, padded.cache, buckets=BUCKETS, max_context=padded.max_context,
                                        capture=capture)
    return eager, padded


def run_both(eager: ModelRunner, padded: ModelRunner, steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill PROMPTS on both, then the decode ``steps`` fed the eager runner's greedy tokens."""
    prompts = list(enumerate(PROMPTS))
    outs = [(eager.forward(prompts), padded.forward(prompts))]
    last = dict(zip(range(len(PROMPTS)), outs[0][0].argmax(-1).tolist()))
    for seqs in steps:
        items = [(s, [last[s]]) for s in seqs]
        want, got = eager.forward(items), padded.forward(items)
        outs.append((want, got))
        last.update(zip(seqs, want.argmax(-1).tolist()))
    return outs


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # learned positions; rotary with grouped key/value heads
def test_padded_decode_equals_the_unpadded_step_and_leaves_other_kv_alone(tiny_dirs, family):
    eager, padded = _pair(tiny_dirs[family])
    outs = run_both(eager, padded, STEPS)
    for i, (want, got) in enumerate(outs):
        assert got.shape == want.shape, i
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {i}")
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), i
    graphs = padded.decode_graphs
    assert isinstance(graphs, DecodeGraphs)
    # Widths 1, 3, 5, 2, 7, 6, 1, 5 ran in buckets 1, 4, 8, 2, 8, 8, 1, 8; the prefill ran eagerly.
    widths = [len(s) for s in STEPS]
    assert graphs.padded_steps == {b: sum(1 for w in widths if b == min(x for x in BUCKETS if x >= w))
                                   for b in BUCKETS}
    assert graphs.eager_steps == 1
    n = padded.cache.num_blocks
    # Every real block holds what the eager runner wrote (same allocation order on both; a padding row
    # written into one would be off by O(1), not by float rounding of another matmul shape).
    torch.testing.assert_close(padded.cache.k[:, :n], eager.cache.k[:, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded.cache.v[:, :n], eager.cache.v[:, :n], atol=1e-5, rtol=1e-5)
    scratch = padded.cache.scratch_block
    assert scratch == n and all(scratch not in padded.cache.block_table(s) for s in range(len(PROMPTS)))
    assert padded.cache.k[:, scratch].abs().sum() > 0  # the padding rows did run, and wrote there


def test_steps_outside_the_buckets_run_eagerly(tiny_dirs):
    eager, padded = _pair(tiny_dirs["gpt2"])
    graphs = padded.decode_graphs
    assert isinstance(graphs, DecodeGraphs)
    run_both(eager, padded, [])
    nine = [(i + 100, [i + 3]) for i in range(2)] + [(s, [4]) for s in range(7)]  # 9 one-token rows > 8
    mixed = [(200, [5, 6, 7]), (0, [8])]  # a prompt beside a decode row
    for items in (nine, mixed):
        before = graphs.eager_steps
        torch.testing.assert_close(padded.forward(items), eager.forward(items), atol=1e-5, rtol=1e-5)
        assert graphs.eager_steps == before + 1
    assert sum(graphs.padded_steps.values()) == 0
    full = padded.forward([(0, [9]), (1, [9])], all_logits=True)  # all_logits: eager too
    assert full.shape[0] == 2 and graphs.eager_steps == 4


def test_generate_through_the_padded_path_gives_the_eager_tokens(tiny_dirs):
    eager, padded = _pair(tiny_dirs["llama"])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=6, ignore_eos=True) for i in range(7)]
    for p in (params, seeded):
        assert [g.token_ids for g in padded.generate(PROMPTS, p)] == [g.token_ids for g in eager.generate(PROMPTS, p)]
    graphs = padded.decode_graphs
    assert isinstance(graphs, DecodeGraphs) and graphs.padded_steps[8] > 0


def test_a_failed_capture_warns_once_and_decodes_eagerly(tiny_dirs):
    # capture=True on a CPU: no CUDA stream to capture on; the step must still come out right.
    eager, padded = _pair(tiny_dirs["gpt2"], capture=True)
    with pytest.warns(RuntimeWarning, match="CUDA graph capture of the decode step at batch 1 failed"):
        outs = run_both(eager, padded, STEPS[:2])
    for want, got in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    graphs = padded.decode_graphs
    assert isinstance(graphs, DecodeGraphs)
    assert graphs.failed and graphs.captured == () and sum(graphs.padded_steps.values()) == 0
    assert graphs.eager_steps == 3  # the prefill, the step whose capture failed, and the one after


def test_the_stage_timer_sees_padded_and_eager_steps(tiny_dirs):
    _, padded = _pair(tiny_dirs["gpt2"])
    assert padded.decode_graphs is not None
    timer = StageTimer(padded.decode_graphs, torch.device("cpu"))
    padded.forward([(0, [5, 6, 7])])
    padded.forward([(0, [8])])
    assert timer.snapshot()["steps"] == 2


def test_config_rules_name_the_value_and_the_fix(tiny_dirs):
    assert RuntimeConfig().cuda_graphs is None
    assert RuntimeConfig(cuda_graphs=[8, 2, 2]).cuda_graphs == (2, 8)
    with pytest.raises(ValueError, match=r"cuda_graphs=True asks for CUDA graphs but device='cpu'.*use a CUDA"):
        RuntimeConfig(device="cpu", cuda_graphs=True)
    with pytest.raises(ValueError, match=r"cuda_graphs=\(1, 2\) with tp=2.*only at tp=1"):
        RuntimeConfig(tp=2, cuda_graphs=[1, 2])
    for bad in ([0, 4], [], "8", [2.5], [True]):
        with pytest.raises(ValueError, match="list of decode batch sizes >= 1"):
            RuntimeConfig(cuda_graphs=bad)
    assert RuntimeConfig(device="cpu", cuda_graphs=False).cuda_graphs is False
    if not torch.cuda.is_available():  # device=None resolves to the CPU only when the runner loads
        with pytest.raises(ValueError, match="asks for CUDA graphs but device='cpu'"):
            ModelRunner.from_pretrained(tiny_dirs["gpt2"], cuda_graphs=True, progress=False)
    assert default_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96)
    assert default_buckets(1) == (1,)


def _pp2(rank: int, world: int, path: str) -> dict:
    # Two micro-batches per step: a decode step of 5 runs as 3 + 2 rows (buckets 4 and 2) on each stage,
    # token ids into stage 0's buffers, received hidden states into stage 1's.
    eager, padded = _pair(path, pp=2, microbatches=2)
    outs = run_both_pp(eager, padded)
    graphs = padded.decode_graphs
    assert isinstance(graphs, DecodeGraphs)
    err = max((w - g).abs().max().item() for w, g in outs) if outs else None  # logits: last stage only
    same = all(w.argmax(-1).tolist() == g.argmax(-1).tolist() for w, g in outs)
    n = padded.cache.num_blocks
    kv_err = (padded.cache.k[:, :n] - eager.cache.k[:, :n]).abs().max().item()
    return {"first": padded.grid.first, "err": err, "same": same, "kv_err": kv_err, "padded": graphs.padded_steps}


def run_both_pp(eager: ModelRunner, padded: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Both ranks run the same calls; the greedy feed comes from a broadcast so stage 0 knows it too.
    prompts = list(enumerate(PROMPTS))
    want, got = eager.forward(prompts, broadcast=True), padded.forward(prompts, broadcast=True)
    outs = [(want, got)]
    last = dict(zip(range(len(PROMPTS)), want.argmax(-1).tolist()))
    for seqs in STEPS:
        items = [(s, [last[s]]) for s in seqs]
        want, got = eager.forward(items, broadcast=True), padded.forward(items, broadcast=True)
        outs.append((want, got))
        last.update(zip(seqs, want.argmax(-1).tolist()))
    return outs if eager.grid.last else []


@RunIf(min_world=2)
def test_padded_decode_at_pp2_feeds_hidden_states_through_the_static_buffers(tiny_dirs):
    first, last = run_distributed(_pp2, 2, args=(tiny_dirs["llama"],), timeout=300)
    assert first["first"] and not last["first"]
    assert last["err"] <= 1e-5 and last["same"], last
    assert first["kv_err"] <= 1e-5 and last["kv_err"] <= 1e-5, (first, last)
    # Every decode step was split in two micro-batches, each padded to its bucket, on both stages.
    assert first["padded"] == last["padded"] and sum(last["padded"].values()) == 2 * len(STEPS) - 2  # [0], [3]


def test_pooling_layers_in_host_memory_turns_graphs_off(tiny_dirs):
    # A graph would replay the weights' old addresses; pooled layers are copied into slots every step.
    from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool

    eager, padded = _pair(tiny_dirs["gpt2"])
    pool, plan = apply_memory_pool(padded, MemoryPoolConfig(fraction=1.0, lookahead=1))
    try:
        assert plan.pooled and padded.decode_graphs is None
        for want, got in run_both(eager, padded, STEPS[:2]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        pool.close()


def test_capture_all_is_a_no_op_without_capture_and_fails_softly_on_a_cpu(tiny_dirs):
    _, padded = _pair(tiny_dirs["gpt2"])
    assert padded.decode_graphs is not None and padded.decode_graphs.capture_all() == ()
    _, capturing = _pair(tiny_dirs["gpt2"], capture=True)
    graphs = capturing.decode_graphs
    assert graphs is not None
    with pytest.warns(RuntimeWarning, match="at batch 8 failed") as caught:  # largest first
        assert graphs.capture_all() == ()
    assert graphs.failed and len(caught) == 1  # one warning, then no more attempts
