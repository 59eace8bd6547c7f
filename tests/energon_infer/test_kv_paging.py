"""On-demand KV blocks, preemption, prefix caching and chunked prefill, each forced on: the same tokens
(and, for shared prefixes, the same logits as transformers) as a run without them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer import ModelRunner, SamplingParams
from energon_infer.scheduling.blocks import BlockManager
from tests.energon_infer.conftest import GREEDY_TOKENS
from tests.energon_infer.tiny import PROMPTS, hf_logits
from tests.helpers.runif import RunIf

GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=i, max_tokens=GREEDY_TOKENS, ignore_eos=True)
          for i in range(len(PROMPTS))]
BASE = list(range(20, 41))
# One prompt, then others sharing its prefix: more tokens after it, a prompt that is all cached full
# blocks (copy-on-write of its last block), and one diverging inside a block (a partial block copy).
SHARED = [BASE + [5, 6], BASE + [7], BASE[:12], BASE[:10] + [99, 98]]


def _runner(d: str, **kw) -> ModelRunner:
    return ModelRunner.from_pretrained(d, block_size=4, progress=False, **kw)


def _tokens(runner: ModelRunner, prompts, params, **kw) -> tuple[list[list[int]], dict[str, int]]:
    stats: dict[str, int] = {}
    out = [g.token_ids for g in runner.generate(prompts, params, stats=stats, **kw)]
    assert runner.cache.free_blocks == runner.cache.num_blocks
    return out, stats


def test_preemption_under_a_small_cache_keeps_greedy_and_seeded_outputs(tiny_dirs, hf_refs):
    # 10 blocks of 4 tokens: all four prompts start (10 blocks), then growing needs more and the newest
    # running request is preempted, recomputed later from its prompt + the tokens it had.
    small = _runner(tiny_dirs["gpt2"], kv_cache_tokens=40)
    greedy, stats = _tokens(small, PROMPTS, GREEDY, kv_admission="on_demand")
    assert greedy == hf_refs["gpt2"]["greedy"] and stats["preemptions"] > 0
    big = _runner(tiny_dirs["gpt2"])
    alone = [_tokens(big, [p], sp)[0][0] for p, sp in zip(PROMPTS, SEEDED)]
    seeded, stats = _tokens(small, PROMPTS, SEEDED, kv_admission="on_demand")
    assert seeded == alone and stats["preemptions"] > 0


def test_on_demand_blocks_run_more_requests_at_once_than_reservation(tiny_dirs):
    # max_tokens=16 makes reservation take 6 blocks for the 7-token prompt though it finishes early.
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(2,))
    runs = {}
    for mode in ("reserve", "on_demand"):
        r = _runner(tiny_dirs["gpt2"], kv_cache_tokens=40)
        width = []
        step = r.step

        def spy(items, p=None, _width=width, _step=step):
            _width.append(len(items))
            return _step(items, p)

        r.step = spy  # type: ignore[method-assign]
        runs[mode] = (_tokens(r, PROMPTS, params, kv_admission=mode)[0], max(width))
    assert runs["on_demand"][0] == runs["reserve"][0]
    assert runs["on_demand"][1] > runs["reserve"][1]


def test_prefix_caching_shares_blocks_and_keeps_outputs(tiny_dirs):
    plain = _runner(tiny_dirs["llama"], max_batch_tokens=24)
    ref, _ = _tokens(plain, SHARED, GREEDY)
    cached, stats = _tokens(plain, SHARED, GREEDY, prefix_caching=True, kv_admission="on_demand")
    assert cached == ref
    # 20 + 11 + 10 tokens found cached (the first prompt runs alone in the first step: 23 of 24 tokens).
    assert stats["prefix_hit_tokens"] == 41
    seeded_ref, _ = _tokens(plain, SHARED, SEEDED)
    assert _tokens(plain, SHARED, SEEDED, prefix_caching=True)[0] == seeded_ref
    off = _tokens(plain, SHARED, GREEDY, prefix_caching=False, kv_admission="on_demand")[1]
    assert off["prefix_hit_tokens"] == 0


def test_shared_and_copied_blocks_give_the_logits_of_transformers(tiny_dirs):
    d = tiny_dirs["gpt2"]
    runner = _runner(d)
    mgr = BlockManager(runner.cache.num_blocks, 4, blocks=runner.cache.free_block_ids())
    refs = hf_logits(d, SHARED)
    found = []
    for seq, prompt in enumerate(SHARED, start=1):
        hit = mgr.start(seq, prompt)
        mgr.grow(seq, len(prompt))
        runner.assign_blocks({seq: mgr.tables[seq]}, {seq: hit.start}, hit.copies)
        out = runner.forward([(seq, prompt[hit.start:])], all_logits=True)
        mgr.commit(seq, prompt)
        assert (out - refs[seq - 1][hit.start:]).abs().max().item() <= 1e-4
        found.append((hit.start, len(hit.copies)))
    assert found == [(0, 0), (20, 0), (11, 1), (10, 1)]
    for seq in range(1, 5):
        runner.free(seq)
        mgr.free(seq)
    assert runner.cache.free_blocks == runner.cache.num_blocks


def test_chunked_prefill_bounds_every_step_and_keeps_outputs(tiny_dirs, hf_refs):
    runner = _runner(tiny_dirs["gpt2"], max_batch_tokens=8)
    sizes = []
    step = runner.step

    def spy(items, p=None):
        sizes.append(sum(len(t) for _, t in items))
        return step(items, p)

    runner.step = spy  # type: ignore[method-assign]
    greedy, _ = _tokens(runner, PROMPTS, GREEDY, chunked_prefill=True)
    assert greedy == hf_refs["gpt2"]["greedy"]
    assert max(sizes) == 8  # the 21-token prompt ran in chunks of at most the budget
    seeded_ref = _tokens(_runner(tiny_dirs["gpt2"]), PROMPTS, SEEDED)[0]
    assert _tokens(runner, PROMPTS, SEEDED, chunked_prefill=True)[0] == seeded_ref
    # All three together under a small cache.
    tight = _runner(tiny_dirs["gpt2"], max_batch_tokens=8, kv_cache_tokens=40)
    both, stats = _tokens(tight, PROMPTS, GREEDY, chunked_prefill=True, prefix_caching=True, kv_admission="on_demand")
    assert both == hf_refs["gpt2"]["greedy"] and stats["preemptions"] > 0


@pytest.mark.parametrize("rows", [1, 5])
def test_batched_sampling_draws_each_row_as_if_alone(rows):
    from energon_infer.sampling import Sampler

    torch.manual_seed(0)
    logits = torch.randn(rows, 50)
    params = [SamplingParams(temperature=0.5 + 0.2 * i, top_k=(0, 5, 30)[i % 3], top_p=(1.0, 0.8)[i % 2], seed=i)
              for i in range(rows)]
    batch = Sampler().sample(logits, list(range(rows)), params, [7] * rows)
    alone = [Sampler().sample(logits[i:i + 1], [i], [params[i]], [7])[0] for i in range(rows)]
    assert batch == alone
    # The draw depends on the position: another position gives other tokens somewhere over many draws.
    draws = {tuple(Sampler().sample(logits, list(range(rows)), params, [p] * rows)) for p in range(20)}
    assert len(draws) > 1


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=RunIf(min_world=2))])
def test_engine_with_preemption_prefix_caching_and_chunks_equals_the_runtime(tiny_dirs, pp):
    from energon_infer.engine.engine import Engine

    prompts = PROMPTS + SHARED
    params = [GREEDY] * len(PROMPTS) + SEEDED
    ref = _tokens(_runner(tiny_dirs["llama"]), prompts, params)[0]
    with Engine.from_pretrained(tiny_dirs["llama"], pp=pp, max_batch_tokens=8, kv_cache_tokens=48, block_size=4,
                                chunked_prefill=True, prefix_caching=True, kv_admission="on_demand",
                                progress=False, threads_per_worker=1) as engine:
        out = [c.token_ids for c in engine.generate(prompts, params)]
        assert out == ref
        assert engine.scheduler.preemptions > 0 and engine.scheduler.blocks.hit_tokens > 0


def test_penalties_count_the_same_tokens_through_chunks_preemption_and_shared_prefixes(tiny_dirs):
    # The penalties need every token of the prompt and the output even when a chunk, a shared prefix or a
    # recompute means they are not all fed in one step: the scheduler sends a new sequence's history.
    penalised = [SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, repetition_penalty=1.5,
                                frequency_penalty=0.7, presence_penalty=0.4),
                 SamplingParams(temperature=0.8, seed=3, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                                repetition_penalty=1.3, frequency_penalty=0.5)] * 2
    prompts = SHARED
    ref = _tokens(_runner(tiny_dirs["gpt2"]), prompts, penalised)[0]
    plain = _tokens(_runner(tiny_dirs["gpt2"]), prompts, [SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS,
                                                                        ignore_eos=True)] * 4)[0]
    assert ref != plain  # the penalties change the tokens
    tight = _runner(tiny_dirs["gpt2"], max_batch_tokens=8, kv_cache_tokens=48)
    out, stats = _tokens(tight, prompts, penalised, chunked_prefill=True, prefix_caching=True,
                         kv_admission="on_demand")
    assert out == ref and stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_preemption_by_swap_to_host_keeps_greedy_and_seeded_outputs(tiny_dirs, hf_refs, mode):
    # The same small cache as above, with host swap space: victims' blocks go to host memory and come
    # back into fresh blocks; they resume where they stopped, so the tokens are those of an unpreempted run.
    small = _runner(tiny_dirs["gpt2"], kv_cache_tokens=40, swap_space_tokens=64)
    greedy, stats = _tokens(small, PROMPTS, GREEDY, kv_admission="on_demand", preemption=mode)
    assert greedy == hf_refs["gpt2"]["greedy"] and stats["preemptions"] > 0
    if mode == "swap":
        assert stats["swaps"] == stats["preemptions"]
    big = _runner(tiny_dirs["gpt2"])
    alone = [_tokens(big, [p], sp)[0][0] for p, sp in zip(PROMPTS, SEEDED)]
    seeded, stats = _tokens(small, PROMPTS, SEEDED, kv_admission="on_demand", preemption=mode)
    assert seeded == alone and stats["preemptions"] > 0


def test_swap_or_recompute_is_chosen_by_the_measured_costs():
    from energon_infer.scheduling.swap import SwapSpace

    space = SwapSpace(4, mode="auto", swap_s_per_block=1e-3, recompute_s_per_token=1e-4)
    assert space.choose(blocks=2, tokens=64)  # 2 ms of copies < 6.4 ms of prefill
    assert not space.choose(blocks=2, tokens=8)  # 0.8 ms of prefill is cheaper
    assert not space.choose(blocks=5, tokens=1000)  # more blocks than the swap space holds
    assert SwapSpace(4, mode="swap").choose(blocks=1, tokens=1)
    assert not SwapSpace(4, mode="recompute").choose(blocks=1, tokens=10**6)
    with pytest.raises(ValueError, match="preemption='swap' needs host swap space"):
        from energon_infer.scheduling.scheduler import SchedulerConfig

        SchedulerConfig(kv_blocks=8, block_size=4, max_context=64, preemption="swap")


def test_engine_swaps_preempted_requests_out_and_back_with_the_same_tokens(tiny_dirs, hf_refs):
    # Through the worker process (steps planned two ahead): swap-out copies run before the step that
    # reuses the victim's blocks, swap-in copies before the step that resumes it.
    from energon_infer.engine.engine import Engine

    big = _runner(tiny_dirs["gpt2"])
    alone = [_tokens(big, [p], sp)[0][0] for p, sp in zip(PROMPTS, SEEDED)]
    with Engine.from_pretrained(tiny_dirs["gpt2"], block_size=4, kv_cache_tokens=40, swap_space_tokens=64,
                                preemption="swap", progress=False, threads_per_worker=1) as engine:
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == hf_refs["gpt2"]["greedy"]
        assert [c.token_ids for c in engine.generate(PROMPTS, SEEDED)] == alone
        assert engine.scheduler.swap.swaps == engine.scheduler.preemptions > 0
    with pytest.raises(ValueError, match="needs host swap space"):
        Engine.from_pretrained(tiny_dirs["gpt2"], preemption="swap", progress=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3)), min_size=1, max_size=20), st.sampled_from([1, 4, 16]),
       st.integers(0, 2**16))
def test_decode_step_metadata_equals_the_general_layout(seqs, block_size, seed):
    """A decode-only step's metadata is built from host lists; it must equal the general tensor-op layout."""
    import random

    from energon_infer.worker.kv_cache import KVCache

    g = random.Random(seed)
    cache = KVCache(n_layers=1, num_blocks=64, block_size=block_size, n_kv_heads=1, head_dim=2,
                    dtype=torch.float32, device="cpu")
    starts = [start for start, _ in seqs]
    # Each table covers its token at `start`, sometimes with blocks to spare (assigned ahead).
    tables = [[g.randrange(64) for _ in range(start // block_size + 1 + extra)] for start, extra in seqs]
    width = max(len(t) for t in tables)
    general = cache._packed_metadata(starts, [1] * len(seqs), tables, [len(t) for t in tables], width, len(seqs))
    assert torch.equal(cache._decode_metadata(starts, tables, width), general)
    meta = cache._metadata(starts, [1] * len(seqs), tables, "cpu")
    assert meta.n_tokens == len(seqs) and meta.max_q_len == 1
    assert meta.slot_mapping.tolist() == [t[s // block_size] * block_size + s % block_size
                                          for s, t in zip(starts, tables)]


def test_the_cache_holds_block_tables_and_the_runner_allocates_with_a_block_manager(tiny_dirs):
    from energon_infer.worker.kv_cache import KVCache, UnknownSequenceError

    cache = KVCache(n_layers=1, num_blocks=4, block_size=4, n_kv_heads=1, head_dim=2, dtype=torch.float32)
    with pytest.raises(UnknownSequenceError):
        cache.prepare([(1, 2)], "cpu")  # no table given: the cache never picks a block itself
    cache.assign(1, [2])
    assert cache.prepare([(1, 4)], "cpu").slot_mapping.tolist() == [8, 9, 10, 11]
    with pytest.raises(RuntimeError, match="assigned 1 blocks, too few for 5 tokens"):
        cache.prepare([(1, 1)], "cpu")
    assert cache.free_block_ids() == [0, 1, 3] and cache.free_blocks == 3
    runner = _runner(tiny_dirs["gpt2"], kv_cache_tokens=16)
    assert isinstance(runner.allocator, BlockManager)
    runner.prefill({0: [1] * 6}, SamplingParams(temperature=0))  # the step-level API: the runner's own blocks
    assert runner.cache.block_table(0) == runner.allocator.tables[0] == [0, 1]
    runner.free(0)
    assert runner.allocator.num_free == runner.cache.free_blocks == 4
