"""The whole runtime on the tightfit.kernels Triton kernels (the kernels' own tests are tests/core/test_kernels_attention.py)."""

from __future__ import annotations

import torch

from tests.helpers.runif import RunIf


@RunIf(triton=True, transformers=True)
def test_runtime_on_the_triton_kernels_equals_transformers(tiny_dirs, hf_refs, monkeypatch):
    """The whole model with TIGHTFIT_KERNELS=triton (interpreter here, the GPU path on CUDA)."""
    from energon_infer import ModelRunner
    from tests.energon_infer.tiny import PROMPTS

    monkeypatch.setenv("TIGHTFIT_KERNELS", "triton")
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False)
    logits = runner.forward(list(enumerate(PROMPTS)), all_logits=True)
    assert (logits - torch.cat(hf_refs["llama"]["logits"])).abs().max().item() <= 1e-4
    step = runner.forward([(i, [3]) for i in range(len(PROMPTS))])  # a decode step on the kernel
    assert step.shape == (len(PROMPTS), 101)
