"""Quantized models end to end against torchao's own quantized tensors, the independent reference.

The other quantization tests compare the runtime with torchao's dequantisation of *energon's* quantizer output
(``quantize_weight``), so a wrong scale made there (rounded through fp16, say) is the reference's too. Here every
projection of a loaded quantized model is checked against torchao's public tensor subclasses built from the
checkpoint's weight: ``Int8Tensor.from_hp(w, PerRow())`` for int8 and ``Int4OpaqueTensor.from_hp(w, [1, g])``
(torchao's CPU int4 layout, ATen's tinygemm kernel) for int4. Their scales (and int4 zero points) must be the
stored ones bit for bit, each layer's product must equal ``F.linear`` on torchao's tensor, and the model's
logits must equal those of the fp32 model whose weights are torchao's dequantised ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.energon_infer.tiny import PROMPTS, save_tiny

pytest.importorskip("torchao", reason="quantization needs torchao (scripts/setup.sh installs it)")

FAMILIES = {"llama": dict(hidden_size=64, intermediate_size=128), "qwen2": dict(hidden_size=64, intermediate_size=128)}
SPECS = [("int8", None), ("int4", 32), ("int4", 64)]
TOL = 2e-4  # relative to the logits' scale: another summation order, not another weight


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("torchao_models")
    return {f: str(save_tiny(f, root / f, **kw)) for f, kw in FAMILIES.items()}


def torchao_quantized(w: torch.Tensor, method: str, group: int | None):
    """``(torchao's tensor, its per-row scales, its zero points or None, its dequantised weight)`` of ``w``.

    int4: torchao's CPU kernel wants a multiple of 16 rows, so ``w`` is padded with zero rows (rows are quantized
    independently) and the dequantised weight is torchao's own product with the identity, cut back to ``w``'s rows.
    """
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor
    from torchao.quantization import Int8Tensor
    from torchao.quantization.granularity import PerRow

    w = w.detach().float()
    if method == "int8":
        ao = Int8Tensor.from_hp(w, granularity=PerRow())
        return ao, ao.scale.reshape(-1), None, ao.dequantize()
    assert group is not None
    n, k = w.shape
    ao = Int4OpaqueTensor.from_hp(F.pad(w, (0, 0, 0, -n % 16)), [1, group])
    scale_and_zero = ao.scale_and_zero  # (groups, rows, 2), torchao's tinygemm packing
    deq = F.linear(torch.eye(k), ao).t()[:n]
    return ao, scale_and_zero[:, :n, 0].t(), scale_and_zero[:, :n, 1].t(), deq


def _layers(runner):
    """(name, module) of every layer a quantized runner holds quantized (block projections and the vocabulary
    head: at hidden 64 every group size here tiles it)."""
    from energon_infer.loading.quantization import PROJECTIONS

    for i, block in runner.stage.layers.items():
        for proj in PROJECTIONS:
            yield f"layers.{i}.{proj}", getattr(block, proj)
    yield "lm_head", runner.stage.lm_head


def _logits(runner) -> torch.Tensor:
    return runner.forward(list(enumerate(PROMPTS)), all_logits=True, broadcast=True)


@pytest.mark.parametrize("method,group", SPECS, ids=["int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_quantized_model_is_torchaos_quantization_of_the_checkpoint(dirs, family, method, group, monkeypatch):
    from energon_infer import ModelRunner
    from tightfit.kernels.quant_linear_a8 import A8_ENV_VAR

    monkeypatch.setenv(A8_ENV_VAR, "fp32")  # the fp32-activation kernels: torchao's weight-only product
    path = dirs[family]
    plain = ModelRunner.from_pretrained(path, block_size=4, progress=False, packed_weights=False)
    quant = ModelRunner.from_pretrained(path, block_size=4, progress=False, quantization=method, group_size=group)
    weights = {name: layer.weight for name, layer in _layers(plain)}
    x = torch.randn(5, plain.stage.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    checked = []
    for name, layer in _layers(quant):
        w = weights[name]
        assert layer.quant == method and "weight" not in layer._parameters, name
        ao, scale, zero, _ = torchao_quantized(w, method, group)
        # The stored scales and zero points are torchao's, bit for bit (not rounded through another dtype).
        assert torch.equal(layer.qscale, scale.float()), f"{name}: scales differ from torchao's"
        if zero is not None:
            assert torch.equal(layer.qzero, zero.float()), f"{name}: zero points differ from torchao's"
        if w.shape[1] == x.shape[1] and (method == "int8" or w.shape[0] % 16 == 0):
            got = layer.matmul(x)
            torch.testing.assert_close(got, F.linear(x, ao), atol=1e-4, rtol=1e-4, msg=f"{name}: product")
        checked.append(name)
    assert "lm_head" in checked and len(checked) == 4 * len(plain.stage.layers) + 1
    # End to end: the fp32 model whose quantized weights are torchao's dequantised ones gives the same logits.
    with torch.no_grad():
        for _, layer in _layers(plain):
            layer.weight.copy_(torchao_quantized(layer.weight, method, group)[3])
    got, want = _logits(quant), _logits(plain)
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
