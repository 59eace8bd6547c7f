"""One incremental detokeniser per request: the text a full decode gives, each token decoded once over a window."""

from __future__ import annotations

from energon_infer.detokenizer import IncrementalDetokenizer
from energon_infer.gpt_checkpoint import ByteTokenizer
from energon_infer.sampling import SamplingParams
from energon_infer.scheduler import Request, Scheduler, SchedulerConfig

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
