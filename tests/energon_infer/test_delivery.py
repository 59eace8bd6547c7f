"""One incremental detokeniser per request: the text a full decode gives, each token decoded once over a window."""

from __future__ import annotations

from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.detokenizer import IncrementalDetokenizer
from energon_infer.scheduling.scheduler import Request, Scheduler, SchedulerConfig
from energon_infer.worker.gpt_checkpoint import ByteTokenizer

from .tiny import CORPUS, build_tokenizer


class Counting:
    """A tokenizer's decode that counts how many token ids it was given in all."""

    def __init__(self, decode):
        self.inner, self.tokens = decode, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return self.inner(list(ids))


def _stream(decode, ids):
    d = IncrementalDetokenizer(decode)
    deltas = [d.add(t) for t in ids]
    return d, deltas


def test_bpe_metaspace_text_equals_the_full_decode(tmp_path):
    from tokenizers import Tokenizer

    build_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = " ".join(CORPUS)
    ids = tok.encode(text).ids
    counting = Counting(tok.decode)
    d, deltas = _stream(counting, ids)
    assert "".join(deltas) == d.text == d.finish() == tok.decode(ids)
    # Two short windows per token, not the whole output: a full decode per token would cost n * (n + 1) / 2.
    n = len(ids)
    assert n > 50 and counting.tokens <= 6 * n


def test_bytes_wait_for_a_whole_character():
    decode = ByteTokenizer().decode
    ids = list("añ€😀!".encode())
    d, deltas = _stream(decode, ids)
    assert "".join(deltas) == "añ€😀!" and "\ufffd" not in "".join(deltas)
    assert deltas[:3] == ["a", "", "ñ"]  # the second byte of ñ completes it
    cut = IncrementalDetokenizer(decode)
    for t in "é".encode()[:1]:
        assert cut.add(t) == ""
    assert cut.finish() == "\ufffd"  # an unfinished character at the end shows as the replacement character


def test_scheduler_and_stream_share_one_detokeniser():
    decode = Counting(ByteTokenizer().decode)
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, max_batch_tokens=16), decode=decode)
    req = s.add(Request("r", [1, 2], SamplingParams(max_tokens=20, stop=["lo w"])))
    assert req.detok is not None
    out = "hello world"
    for ch in out:
        plan = s.schedule(0)
        if plan is None:
            break
        s.complete(plan, [ord(ch)])
    assert req.finish_reason == "stop" and req.text == "hel" and req.detok.text == "hello w"
    # One window of at most 2 tokens (+ the 1-token one before it) per token: 1 + 6 * 3 = 19 ids; the scheduler
    # and the stream each decoding the whole output per token took 2 * (1 + 2 + ... + 7) = 56.
    assert decode.tokens == 19


def test_the_frontend_owns_the_output_state_and_leaves_the_schedulers_request_alone():
    from concurrent.futures import Future

    import pytest

    from energon_infer.engine.delivery import Delivery
    from energon_infer.engine.metrics import EngineMetrics

    # The scheduler's request carries what batching needs, nothing of the caller's side.
    fields = set(Request.__dataclass_fields__)
    assert not fields & {"future", "listener", "sent_text", "arrival", "first_token", "finished", "last_token_at"}
    t = [10.0]
    frontend = Delivery(EngineMetrics(model_name="m"), has_text=True, clock=lambda: t[0])
    events = []
    fut = frontend.open("r", events.append)
    assert isinstance(fut, Future)
    with pytest.raises(ValueError, match="request id 'r' is already running"):
        frontend.open("r")
    s = Scheduler(SchedulerConfig(kv_blocks=64, block_size=4, max_context=64, max_batch_tokens=16),
                  decode=ByteTokenizer().decode)
    req = s.add(Request("r", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True)))
    for ch, now in (("h", 10.5), ("i", 11.0)):
        t[0] = now
        out = s.complete(s.schedule(0), [ord(ch)])
        before = (list(req.generated), req.text, req.state, req.finish_reason)
        frontend.notify(out)
        assert (list(req.generated), req.text, req.state, req.finish_reason) == before  # read, never written
    done = fut.result(timeout=0)
    assert [e.text for e in events] == ["h", "i"] and events[-1].finish_reason == "length"
    assert (done.arrival, done.first_token, done.finished, done.text) == (10.0, 10.5, 11.0, "hi")
    assert "r" not in frontend.outputs  # forgotten once finished: the id can be used again
    frontend.open("r")


def test_the_scheduler_never_imports_the_frontend():
    from tests.test_layout import import_graph

    graph = import_graph("energon_infer")
    assert "energon_infer.engine.delivery" not in graph["energon_infer.scheduling.scheduler"]
    assert "energon_infer.scheduling.scheduler" not in graph["energon_infer.engine.delivery"]
