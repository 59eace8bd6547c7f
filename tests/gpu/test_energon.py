"""energon_infer on one GPU: the runtime and the engine against transformers on CUDA.

Logits of every prompt position and greedy tokens, with the paged KV cache in small pages (prompts
span several), the Triton kernels chosen by ``auto`` (each passes its first-use check), weights pooled
in pinned host memory and prefetched on a side stream, and the engine's worker process on ``cuda:0``.
fp32 is compared tightly; bf16 against transformers in bf16 by top-1 agreement and error relative to
the logits' scale.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import cuda
from tests.helpers.runif import RunIf

pytestmark = RunIf(cuda=True, transformers=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 41)), [50]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.energon_infer.tiny import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("gpu_energon") / "llama")


def hf_reference(path, device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([p], device=device)).logits[0].float() for p in PROMPTS])
        greedy = []
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), device=device,
                                 dtype=torch.long), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            greedy.append(ids[0, len(p):].tolist())
    return {"logits": logits, "greedy": greedy}


def runner_outputs(runner) -> dict:
    from energon_infer import SamplingParams

    logits = runner.forward(list(enumerate(PROMPTS)), all_logits=True).float()
    for i in range(len(PROMPTS)):
        runner.free(i)
    gen = runner.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    return {"logits": logits, "greedy": [g.token_ids for g in gen]}


def check_runtime_fp32(path, device: torch.device) -> None:
    from energon_infer import ModelRunner

    ref = hf_reference(path, device, torch.float32)
    runner = ModelRunner.from_pretrained(path, device=str(device), block_size=4, progress=False)
    got = runner_outputs(runner)
    err = (got["logits"].cpu() - ref["logits"].cpu()).abs().max().item()
    assert err <= 1e-3, f"fp32 logits differ from transformers by {err}"
    assert got["greedy"] == ref["greedy"]


def test_runtime_fp32_equals_transformers_on_cuda(llama_dir):
    from tightfit.kernels.dispatch import kernel_checks, reset_kernel_checks

    reset_kernel_checks()
    check_runtime_fp32(llama_dir, cuda())
    checked = {v.kernel: v.passed for v in kernel_checks()}
    assert checked.get("paged_attention") is True, checked  # auto sent the attention to Triton, and it held


def test_runtime_bf16_tracks_transformers_bf16_on_cuda(llama_dir):
    from energon_infer import ModelRunner

    ref = hf_reference(llama_dir, cuda(), torch.bfloat16)
    runner = ModelRunner.from_pretrained(llama_dir, device=str(cuda()), dtype="bfloat16", block_size=4, progress=False)
    got = runner_outputs(runner)
    scale = ref["logits"].abs().max().item()
    err = (got["logits"] - ref["logits"]).abs().max().item()
    agree = (got["logits"].argmax(-1) == ref["logits"].argmax(-1)).float().mean().item()
    assert err <= 0.05 * scale and agree >= 0.9, (err, scale, agree)


def check_pooled_weights(path, device: torch.device) -> None:
    from energon_infer import ModelRunner
    from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool

    ref = runner_outputs(ModelRunner.from_pretrained(path, device=str(device), block_size=4, progress=False))
    runner = ModelRunner.from_pretrained(path, device=str(device), block_size=4, progress=False)
    pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=1.0, lookahead=1))
    try:
        assert plan.pooled and all(runner.stage.layers[str(i)].qkv.weight.device.type == "meta" for i in plan.pooled)
        got = runner_outputs(runner)
        assert torch.allclose(got["logits"], ref["logits"], atol=1e-5, rtol=0), "pooled weights changed the logits"
        assert got["greedy"] == ref["greedy"]
        assert pool.copies >= len(plan.pooled) * (1 + NEW_TOKENS)  # every pooled layer came in for every step
    finally:
        pool.close()


def test_weights_pooled_in_pinned_host_memory_give_the_same_outputs(llama_dir):
    check_pooled_weights(llama_dir, cuda())


def test_engine_worker_on_cuda_equals_transformers(llama_dir):
    from energon_infer import SamplingParams
    from energon_infer.engine.engine import Engine
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    ref = hf_reference(llama_dir, cuda(), torch.float32)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for pool in (None, MemoryPoolConfig(fraction=0.5, lookahead=1)):
        with Engine.from_pretrained(llama_dir, memory_pool=pool, progress=False, block_size=4,
                                    kv_cache_tokens=1024) as engine:
            assert engine.worker_info[0]["device"].startswith("cuda"), engine.worker_info
            out = engine.generate(PROMPTS, greedy)
        assert [o.token_ids for o in out] == ref["greedy"], pool
