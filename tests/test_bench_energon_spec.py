"""benchmarks/energon_spec.py's workloads and models (benchmarks/spec_models.py): the widened fixture computes the
trained fixture's logits (transformers as the judge), the non-copying prompts' outputs copy nothing, and the
cells keep the format the report reads."""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks import energon_spec as es
from benchmarks.spec_models import copied, widen


def test_the_widened_fixture_computes_the_trained_fixtures_logits(tmp_path):
    from transformers import LlamaForCausalLM

    wide = widen(es.FIXTURE, tmp_path / "wide", hidden=512, layers=5, intermediate=384)
    small = LlamaForCausalLM.from_pretrained(es.FIXTURE, dtype=torch.float32).eval()
    big = LlamaForCausalLM.from_pretrained(wide, dtype=torch.float32).eval()
    assert big.config.num_hidden_layers == 5 and big.config.hidden_size == 512
    ids = torch.tensor(es.workload("copying", 3, 0))
    with torch.no_grad():
        want, got = small(ids).logits, big(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The work added is real: an added layer's readers are dense (its writers, zero, keep it out of the output).
    added = big.model.layers[4]
    assert float((added.mlp.gate_proj.weight != 0).float().mean()) > 0.99
    assert not added.mlp.down_proj.weight.any() and not added.self_attn.o_proj.weight.any()
    with pytest.raises(ValueError, match="hidden = 128 x a power of 4"):
        widen(es.FIXTURE, tmp_path / "bad", hidden=256, layers=4, intermediate=256)


def test_copied_counts_what_prompt_lookup_gets_right():
    prompt = es.workload("copying", 1, 3)[0]
    period = es.PERIOD
    continuation = [prompt[(len(prompt) + i) % period] for i in range(20)]  # the counting sequence, continued
    assert copied(prompt, continuation, **es.LOOKUP) == 20
    fresh = es.workload("fresh", 1, 3)[0]
    assert len(set(fresh)) == len(fresh) == es.FRESH_PROMPT
    new = random.Random(0).sample(sorted(set(range(es.VOCAB_LO, es.FRESH_VOCAB)) - set(fresh)), 20)
    assert copied(fresh, new, **es.LOOKUP) == 0  # no token repeats: nothing to look up
    assert copied([5, 6, 7], [8, 5, 6, 9], min_n=1, max_n=4) == 1  # after 5, lookup says 6: right once


def test_fresh_prompts_are_screened_on_the_plain_engines_output(tmp_path):
    from energon_infer.demo import write_random_llama
    from energon_infer.engine.engine import Engine
    from energon_infer.sampling import SamplingParams

    model = write_random_llama(tmp_path / "m", vocab=es.FRESH_VOCAB, hidden=32, layers=1, heads=2, kv_heads=1,
                               intermediate=64, max_positions=128)
    with Engine.from_pretrained(model, progress=False, threads_per_worker=1) as engine:
        prompts = es.fresh_prompts(engine, 3, 0, 16)
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(prompts) == 3
    assert all(copied(p, o.token_ids, **es.LOOKUP) == 0 for p, o in zip(prompts, outs))


def _run(tps, tokens, prompts, proposed=0, accepted=0):
    return {"tokens_per_s": tps, "tokens": tokens, "steps": 4, "proposed": proposed, "accepted": accepted,
            "prompts": prompts}


def test_cells_keep_the_format_the_report_reads():
    from benchmarks.report import _energon_spec

    prompt, out = [5, 6, 7], [[8, 9]]
    cell = es._cell({"plain": [_run(10.0, out, [prompt]), _run(11.0, out, [prompt])],
                     "ngram": [_run(12.0, out, [prompt], 4, 2), _run(13.0, out, [prompt], 4, 3)]})
    assert cell["ngram"]["acceptance"] == pytest.approx(5 / 8) and cell["ngram"]["greedy_equal"]
    assert cell["plain"]["copied"] == 0 and cell["ngram"]["vs_plain"]["median"] > 1
    cells = {f"{k}/b{b}": cell for k in ("copying", "fresh") for b in (1, 8)}
    md = es.markdown({"ram": cells})
    assert "| copied |" in md and "| fresh/b8 | ngram |" in md
    assert "greedy outputs identical" in _energon_spec({"ram": cells})
