"""oneDNN-packed projection weights on the CPU (RuntimeConfig.packed_weights, parallel._Projection)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from energon_infer import ModelRunner, RuntimeConfig, SamplingParams
from energon_infer.parallel import ColumnLinear, RowLinear, VocabHead
from energon_infer.worker.memory_pool import MemoryPoolConfig, apply_memory_pool
from tests.energon_infer.tiny import FAMILIES, PROMPTS
from tightfit.kernels.packed_linear import MIN_ROWS, SMALL_MIN_ROWS, packed_linear, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="PyTorch built without oneDNN")


@pytest.fixture(autouse=True)
def pack_small_weights(monkeypatch):
    """The tiny test models' weights are all below the size worth packing: pack them anyway."""
    monkeypatch.setattr("tightfit.kernels.packed_linear.MIN_NUMEL", 0)


def _projections(runner: ModelRunner) -> list[torch.nn.Module]:
    return [m for m in runner.stage.modules() if isinstance(m, ColumnLinear | RowLinear | VocabHead)]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_and_plain_runners_agree(family, tiny_dirs):
    plain = ModelRunner.from_pretrained(tiny_dirs[family], block_size=4, progress=False, packed_weights=False)
    packed = ModelRunner.from_pretrained(tiny_dirs[family], block_size=4, progress=False)
    assert all(m.packed is not None for m in _projections(packed))  # on by default on the CPU
    assert all(m.packed is None for m in _projections(plain))
    items = list(enumerate(PROMPTS))
    torch.testing.assert_close(packed.forward(items, all_logits=True), plain.forward(items, all_logits=True),
                               rtol=0, atol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [g.token_ids for g in packed.generate(PROMPTS, params)] == \
        [g.token_ids for g in plain.generate(PROMPTS, params)]
    # Decode steps of 1 and 2 rows run F.linear (as fast there), wider ones the packed copy: both paths agree.
    for rows in (1, 2, 4):
        step = [(100 + i, [7 + i, 9]) for i in range(rows)]
        torch.testing.assert_close(packed.forward(step), plain.forward(step), rtol=0, atol=1e-4)


def test_a_weight_written_after_packing_is_used_not_its_stale_copy(tiny_dirs):
    plain = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False, packed_weights=False)
    packed = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False)
    for runner in (plain, packed):
        with torch.no_grad():
            runner.stage.layers["0"].up.weight.mul_(-2.0)
    proj = packed.stage.layers["0"].up
    items = list(enumerate(PROMPTS))
    torch.testing.assert_close(packed.forward(items, all_logits=True), plain.forward(items, all_logits=True),
                               rtol=0, atol=1e-4)
    assert proj.packed is None  # dropped for good, not re-checked every step
    assert packed.stage.layers["1"].up.packed is not None


def test_pooled_layers_drop_their_packed_copies(tiny_dirs):
    ref = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False)
    runner = ModelRunner.from_pretrained(tiny_dirs["llama"], block_size=4, progress=False)
    pool, plan = apply_memory_pool(runner, MemoryPoolConfig(fraction=0.5, lookahead=1))
    try:
        pooled = {str(i) for i in plan.pooled}
        assert pooled and len(pooled) < len(runner.stage.layers)
        for name, block in runner.stage.layers.items():
            copies = [m.packed is not None for m in block.modules() if isinstance(m, ColumnLinear | RowLinear)]
            assert copies and (not any(copies) if name in pooled else all(copies))
        items = list(enumerate(PROMPTS))
        torch.testing.assert_close(runner.forward(items, all_logits=True), ref.forward(items, all_logits=True),
                                   rtol=0, atol=1e-4)
    finally:
        pool.close()


def test_only_weights_worth_packing_are_packed(tmp_path, monkeypatch):
    from energon_infer.demo import write_random_llama

    monkeypatch.undo()  # the real size rule
    path = write_random_llama(tmp_path / "m", layers=1, hidden=256, heads=4, kv_heads=2, intermediate=512,
                              vocab=600, max_positions=64)
    runner = ModelRunner.from_pretrained(path, block_size=4, progress=False)
    block = runner.stage.layers["0"]
    # (256 x 512 qkv, 256 x 256 out, 256 x 1024 gate/up, 512 x 256 down, 256 x 600 head): the out projection
    # (65536 elements) is under MIN_NUMEL: packed, but used only from SMALL_MIN_ROWS rows; the others from MIN_ROWS.
    assert all(m.packed is not None for m in (block.o, block.qkv, block.up, block.down, runner.stage.lm_head))
    assert block.o._min_rows == SMALL_MIN_ROWS and block.qkv._min_rows == MIN_ROWS
    # Which path ran is recorded, not told apart by rounding: on some CPUs the packed and plain products are
    # bit-equal for these shapes.
    ran: list[int] = []

    def recording(x, *args, **kwargs):
        ran.append(x.shape[0])
        return packed_linear(x, *args, **kwargs)

    monkeypatch.setattr("energon_infer.parallel.packed_linear", recording)
    torch.manual_seed(0)
    for rows, packed in ((SMALL_MIN_ROWS - 1, False), (SMALL_MIN_ROWS, True)):
        x = torch.randn(rows, 256)
        ran.clear()
        out = block.o.matmul(x)
        assert ran == ([rows] if packed else [])
        expected = packed_linear(x, block.o.packed) if packed else F.linear(x, block.o.weight)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_packed_weights_is_validated_and_can_be_turned_off(tiny_dirs, monkeypatch):
    with pytest.raises(ValueError, match=r"packed_weights='no' must be True or False"):
        RuntimeConfig(packed_weights="no")  # type: ignore[arg-type]
    monkeypatch.setenv("TIGHTFIT_KERNELS", "reference")  # plain PyTorch everywhere, packing included
    runner = ModelRunner.from_pretrained(tiny_dirs["gpt2"], block_size=4, progress=False)
    assert all(m.packed is None for m in _projections(runner))
