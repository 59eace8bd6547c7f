"""The engine with real worker processes (spawn, gloo): equal to the single-process runtime at tp=2 and pp=2,
continuous batching that does not change any request's output, streams, aborts, backpressure, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from energon_infer import ModelRunner, SamplingParams
from energon_infer.engine.engine import Engine, EngineClosedError, QueueFullError
from tests.helpers.runif import RunIf

# Unequal lengths, one long prompt spanning several KV blocks, one single-token prompt.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 61)), [50], [3, 1, 4, 1, 5, 9, 2, 6], [100, 101, 102]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=6, ignore_eos=True) for i in range(len(PROMPTS))]
OPTS = dict(progress=False, threads_per_worker=1, block_size=4, kv_cache_tokens=2048)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from energon_infer.demo import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("engine") / "m", layers=4, hidden=32, heads=4, kv_heads=2,
                              intermediate=64, max_positions=256)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each prompt run alone through the single-process runtime: greedy, then seeded sampling."""
    runner = ModelRunner.from_pretrained(model_dir, progress=False, block_size=4)
    greedy = [runner.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    sampled = [runner.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, SAMPLED)]
    return {"greedy": greedy, "sampled": sampled}


@pytest.fixture(scope="module")
def engine(model_dir):
    # A small step budget (48 tokens) so prompts are admitted over several steps while others decode.
    with Engine.from_pretrained(model_dir, max_batch_tokens=48, max_running=6, max_queue=6, **OPTS) as eng:
        yield eng


def test_continuous_batching_gives_each_request_its_output_alone(engine, alone):
    steps0 = engine.metrics.steps
    first = [engine.submit(p, GREEDY) for p in PROMPTS[:3]]
    first[0].result(timeout=120)  # later requests join a batch that is already running
    rest = [engine.submit(p, GREEDY) for p in PROMPTS[3:]]
    out = [f.result(timeout=120) for f in first + rest]
    assert [c.token_ids for c in out] == alone["greedy"]
    assert all(c.finish_reason == "length" and c.latency_s > 0 and c.ttft_s is not None for c in out)
    # Requests shared steps: far fewer steps than the 6 x 8 tokens generated.
    assert engine.metrics.steps - steps0 < sum(len(c.token_ids) for c in out)
    # Seeded sampling draws from each request's own generator, whatever else is in the batch.
    sampled = engine.generate(PROMPTS, SAMPLED)
    assert [c.token_ids for c in sampled] == alone["sampled"]


def test_text_prompts_stream_and_listeners(engine):
    ref = engine.generate(["every rank holds a slice"], GREEDY)[0]
    assert ref.text is not None and ref.prompt_token_ids == engine.encode("every rank holds a slice")

    async def consume():
        return [e async for e in engine.stream("every rank holds a slice", GREEDY)]

    events = asyncio.run(consume())
    assert [e.token_id for e in events] == ref.token_ids
    assert events[-1].finish_reason == "length" and events[-1].completion.token_ids == ref.token_ids
    assert "".join(e.text for e in events) == ref.text
    seen: list[int] = []
    engine.submit(PROMPTS[0], GREEDY, listener=lambda e: seen.append(e.token_id)).result(timeout=60)
    assert seen == engine.generate([PROMPTS[0]], GREEDY)[0].token_ids


def test_abort_cancel_and_leaving_a_stream_free_the_request(engine):
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    started = threading.Event()
    fut = engine.submit(PROMPTS[1], long, request_id="long-1", listener=lambda e: started.set())
    assert started.wait(60)
    assert engine.abort("long-1") and not engine.abort("no-such-request")
    done = fut.result(timeout=60)
    assert done.finish_reason == "abort" and 0 < len(done.token_ids) < 150

    fut = engine.submit(PROMPTS[1], long)
    assert fut.cancel()  # cancelling the future aborts the request

    async def leave_early():
        async for event in engine.stream(PROMPTS[2], long):
            return event.token_id

    assert isinstance(asyncio.run(leave_early()), int)
    for _ in range(200):  # the aborts land at the next step boundary
        if engine.scheduler.num_running == 0:
            break
        threading.Event().wait(0.05)
    assert engine.scheduler.num_running == 0 and engine.scheduler.reserved == 0 and not engine._live
    assert engine.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "length"


def test_bounded_queue_rejects_or_waits(engine, alone):
    slow = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)  # none finishes while we submit
    accepted, rejected = [], 0
    for i in range(20):  # 6 running + 6 waiting fit; the rest find the queue full
        try:
            accepted.append(engine.submit(PROMPTS[i % 2], slow))
        except QueueFullError as exc:
            assert "max_queue=6" in str(exc)
            rejected += 1
    assert rejected >= 8 and len(accepted) + rejected == 20
    # Several at once: all or none; block=True waits until there is room for all of them (more than
    # max_queue never fit, so they are refused at once).
    with pytest.raises(QueueFullError, match="no room for 7 requests"):
        engine.submit_all([(PROMPTS[3], GREEDY)] * 7, block=True)
    before = engine.metrics.requests["rejected"]
    together = engine.submit_all([(PROMPTS[3], GREEDY)] * 3, block=True)
    assert engine.metrics.requests["rejected"] == before
    assert all(len(f.result(timeout=120).token_ids) == 120 for f in accepted)
    assert [f.result(timeout=120).token_ids for f in together] == [alone["greedy"][3]] * 3
    # generate waits for room instead of raising: all 20 complete, and none counts as rejected.
    before = engine.metrics.requests["rejected"]
    outs = engine.generate([PROMPTS[3]] * 20, GREEDY)
    assert [c.token_ids for c in outs] == [alone["greedy"][3]] * 20
    assert engine.metrics.requests["rejected"] == before


def test_invalid_requests_fail_in_the_caller(engine):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        engine.submit([1, 999])
    with pytest.raises(ValueError, match=r"more than max_batch_tokens=48"):
        engine.submit(list(range(50)))
    with pytest.raises(ValueError, match="already running"):
        engine.submit([1], SamplingParams(max_tokens=100, ignore_eos=True), request_id="dup")
        engine.submit([1], request_id="dup")
    engine.abort("dup")


def _equal_to_runtime(model_dir, alone, **layout):
    with Engine.from_pretrained(model_dir, **layout, **OPTS) as engine:
        assert engine.health()["status"] == "ready" and engine.health()["alive"] == 2
        greedy = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        sampled = [c.token_ids for c in engine.generate(PROMPTS, SAMPLED)]
        stats = engine.pipeline_stats()
        info = engine.worker_info
    assert greedy == alone["greedy"] and sampled == alone["sampled"]
    return stats, info


@RunIf(min_world=2)
def test_tp2_engine_with_pooled_layers_equals_the_runtime(model_dir, alone):
    stats, info = _equal_to_runtime(model_dir, alone, tp=2, memory_pool=0.5)
    assert [i["pool"]["pooled"] for i in info] == [[0, 2], [0, 2]]
    assert all(i["pool"]["pool_bytes"] > 0 for i in info)
    assert stats["groups"] == 1 and len(stats["ranks"]) == 2


@RunIf(min_world=2)
def test_pp2_engine_keeps_both_stages_busy_and_equals_the_runtime(model_dir, alone):
    stats, _ = _equal_to_runtime(model_dir, alone, pp=2)
    assert stats["groups"] == 2  # two steps in flight: one per stage
    assert len(stats["stages"]) == 2 and all(0 < u <= 1 for u in stats["stages"])
    assert all(r["steps"] > 0 for r in stats["ranks"])


@RunIf(lightning=True)
def test_engine_serves_a_lightning_checkpoint_of_the_example_gpt(tmp_path):
    from energon_infer import load_tightfit_gpt
    from tests.energon_infer.test_gpt_checkpoint import _train_lightning_checkpoint

    ckpt = tmp_path / "last.ckpt"
    _train_lightning_checkpoint(ckpt, layers=2)
    ref = load_tightfit_gpt(ckpt, progress=False, block_size=4).generate(["hello", "tightfit"], GREEDY)
    with Engine.from_lightning_checkpoint(ckpt, **OPTS) as engine:
        out = engine.generate(["hello", "tightfit"], GREEDY)
        assert engine.model_name == "last" and engine.vocab_size == 256
    assert [c.token_ids for c in out] == [g.token_ids for g in ref]
    assert [c.text for c in out] == [g.text for g in ref]  # the byte tokenizer for a 256-token vocabulary


def test_shutdown_cancels_and_refuses(model_dir):
    engine = Engine.from_pretrained(model_dir, **OPTS)
    pids = engine.health()["pids"]
    fut = engine.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    engine.shutdown(cancel=True)
    with pytest.raises(EngineClosedError, match="shut down before this request finished"):
        fut.result(timeout=60)
    with pytest.raises(EngineClosedError, match="the engine is shut down"):
        engine.submit(PROMPTS[0])
    assert engine.health()["status"] == "stopped" and engine.health()["alive"] == 0
    assert pids and not any(p.is_alive() for p in engine._group.procs)
    engine.shutdown()  # idempotent


def test_layout_errors_fail_before_spawning(model_dir):
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 4 attention heads"):
        Engine.from_pretrained(model_dir, tp=3)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_qeue'\]"):
        Engine.from_pretrained(model_dir, max_qeue=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine.from_pretrained(model_dir / "nope")


def test_engine_serves_exported_weights_with_the_config_beside_them(tmp_path):
    """What the Elixir example leaves in runs/elixir_demo/: model.safetensors + its GPTConfig as config.json."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from energon_infer import load_tightfit_gpt
    from tightfit.models import build_gpt

    torch_model = build_gpt("gpt2-tiny", layers=2)
    save_file({k: v.detach().clone().contiguous() for k, v in torch_model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dataclasses.asdict(torch_model.config)))
    ref = load_tightfit_gpt(tmp_path / "model.safetensors", gpt_config=torch_model.config, progress=False)
    expected = [g.token_ids for g in ref.generate(["hello"], GREEDY)]
    with Engine.from_lightning_checkpoint(tmp_path / "model.safetensors", **OPTS) as engine:
        assert [c.token_ids for c in engine.generate(["hello"], GREEDY)] == expected
    with pytest.raises(FileNotFoundError, match="export it first with `python -m lightning_elixir.export"):
        Engine.from_lightning_checkpoint(tmp_path)


def test_streamed_text_never_shows_a_stop_string(engine):
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = engine.generate(["every rank holds a slice"], long)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a 3-character string the output reaches midway
    assert len(stop) == 3

    async def consume():
        return [e async for e in engine.stream("every rank holds a slice", dataclasses.replace(long, stop=(stop,)))]

    events = asyncio.run(consume())
    streamed = "".join(e.text for e in events)
    final = events[-1].completion
    assert final.finish_reason == "stop" and final.text == full[: full.find(stop)]
    assert streamed == final.text and stop not in streamed
