"""profile_model: accuracy against real CPU steps measured by torch.profiler, blocks, orders, FLOPs,
checkpointing estimates, optimizer bytes, and the model families the issue names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.helpers.runif import RunIf
from tightfit.models import GPTConfig, build_gpt
from tightfit.profiler import MetaProfilingError, ModelProfile, optimizer_state_bytes, profile_model
from tightfit.profiler.measure import measure_step_peak

BOUND = 0.10  # the accuracy requirement


def _ce(targets: torch.Tensor):
    return lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))


def _rel(pred: int, real: int) -> float:
    return abs(pred - real) / real


# (hidden, layers, heads, vocab, batch, seq): 2, 6 and 12 layers
SHAPES = [(64, 2, 4, 512, 4, 64), (96, 6, 4, 1024, 2, 96), (64, 12, 4, 768, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}-L{s[1]}")
def test_gpt_step_peak_within_bound_of_real_cpu_step(shape):
    hidden, layers, heads, vocab, batch, seq = shape
    cfg = GPTConfig(vocab_size=vocab, n_positions=seq, hidden=hidden, layers=layers, heads=heads)
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
    prof = profile_model(build_gpt(cfg, device="meta"), ids, loss_fn=_ce(targets))
    model = build_gpt(cfg)
    real = measure_step_peak(model, ids, loss_fn=_ce(targets))
    real_act = measure_step_peak(model, ids, loss_fn=_ce(targets), drop_grads=True)
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND, (prof.peak_bytes, real)
    assert _rel(prof.activation_peak_bytes, real_act.peak_delta_bytes) <= BOUND, (prof.activation_peak_bytes, real_act)
    # Parameters exact; a training step leaves exactly one gradient per parameter behind.
    assert prof.param_bytes == real.baseline_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert real.end_delta_bytes == prof.param_bytes
    assert prof.param_numel == cfg.num_params()


def _checkpointed(model: nn.Module, names: set[str]) -> None:
    for name, module in model.named_modules():
        if name in names:
            fwd = module.forward
            module.forward = lambda *a, _f=fwd, **k: checkpoint(_f, *a, use_reentrant=False, **k)


@pytest.mark.parametrize("which", ["blocks.1", "every-other", "all"])
def test_checkpointing_estimate_within_bound(which):
    cfg = GPTConfig(vocab_size=512, n_positions=64, hidden=64, layers=4, heads=4)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    prof = profile_model(build_gpt(cfg, device="meta"), ids, loss_fn=_ce(ids))
    chosen = {"blocks.1": ["blocks.1"], "every-other": ["blocks.0", "blocks.2"], "all": "all"}[which]
    est = prof.estimate_peak(chosen)
    model = build_gpt(cfg)
    _checkpointed(model, set(est.checkpointed))
    real = measure_step_peak(model, ids, loss_fn=_ce(ids))
    real_act = measure_step_peak(model, ids, loss_fn=_ce(ids), drop_grads=True)
    assert _rel(est.total_bytes, real.total_bytes) <= BOUND, (est, real)
    assert _rel(est.activation_bytes, real_act.peak_delta_bytes) <= BOUND, (est, real_act)
    assert est.activation_bytes < prof.activation_peak_bytes  # recomputation saves memory
    # profile_model(checkpointing=...) records the same estimate.
    again = profile_model(build_gpt(cfg, device="meta"), ids, loss_fn=_ce(ids), checkpointing=chosen)
    assert again.checkpointed_peak_bytes == est.total_bytes and again.checkpointed == est.checkpointed


def test_gpt_blocks_orders_flops_and_tied_weights():
    cfg = GPTConfig(vocab_size=300, n_positions=32, hidden=48, layers=3, heads=4)
    batch, seq = 2, 32
    model = build_gpt(cfg, device="meta")
    prof = profile_model(model, torch.zeros(batch, seq, dtype=torch.long))
    names = [b.name for b in prof.blocks]
    assert names == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    assert [b.index for b in prof.blocks] == list(range(len(names)))
    # Every parameter exactly once; the tied head weight is an alias owned by the embedding.
    owned = [p for b in prof.blocks for p in b.params]
    assert sorted(owned) == sorted(p.name for p in prof.params) and len(owned) == len(set(owned))
    wte = next(p for p in prof.params if p.name == "wte.weight")
    assert wte.aliases == ("lm_head.weight",) and wte.block == "wte"
    assert prof.block("lm_head").param_bytes == 0
    assert sum(b.param_bytes for b in prof.blocks) == prof.param_bytes == cfg.num_params() * 4
    # First use in forward; gradients arrive in reverse (the head's tied weight last).
    assert prof.forward_order[:3] == ("wte.weight", "wpe.weight", "blocks.0.ln_1.weight")
    assert prof.backward_order[:2] == ("ln_f.weight", "ln_f.bias") or prof.backward_order[0].startswith("ln_f")
    assert prof.backward_order[-1] in ("wte.weight", "wpe.weight")
    assert set(prof.backward_order) == set(prof.forward_order) == {p.name for p in prof.params}
    # FLOPs of a block: the four matmuls (2 * tokens * 12 h^2) plus attention (4 * batch * seq^2 * h).
    tokens, h = batch * seq, cfg.hidden
    expect = 2 * tokens * 12 * h * h + 4 * batch * seq * seq * h
    for i in range(3):
        blk = prof.block(f"blocks.{i}")
        assert blk.fwd_flops == expect and blk.bwd_flops == 2 * expect
        assert blk.output_bytes == tokens * h * 4 and blk.checkpoint_bytes == tokens * h * 4
        assert blk.saved_bytes > blk.checkpoint_bytes
    assert prof.block("lm_head").fwd_flops == 2 * tokens * h * cfg.vocab_size
    # The model passed in is untouched (still meta, no gradients).
    assert all(p.is_meta and p.grad is None for p in model.parameters())


def test_profile_json_roundtrip_and_summary(tmp_path):
    prof = profile_model(lambda: build_gpt("gpt2-tiny"), torch.zeros(2, 16, dtype=torch.long), checkpointing="all")
    path = tmp_path / "p.json"
    prof.to_json(path)
    assert ModelProfile.from_json(path) == prof
    text = prof.summary()
    assert "gpt2-tiny" in text and "blocks.1" in text and "with 7 blocks checkpointed" in text


def test_forward_step_saves_nothing_and_errors():
    cfg = GPTConfig(vocab_size=128, n_positions=32, hidden=32, layers=2, heads=2)
    ids = torch.zeros(2, 32, dtype=torch.long)
    fwd = profile_model(build_gpt(cfg, device="meta"), ids, step="forward")
    train = profile_model(build_gpt(cfg, device="meta"), ids)
    assert fwd.bwd_flops == 0 and fwd.activation_peak_bytes < train.activation_peak_bytes
    assert all(b.saved_bytes == 0 for b in fwd.blocks if b.name.startswith("blocks."))
    with pytest.raises(ValueError, match=r"step='eval' must be 'train' or 'forward'"):
        profile_model(build_gpt(cfg, device="meta"), ids, step="eval")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"cannot checkpoint block 'blocks.7': no such block; blocks: wte, wpe"):
        train.estimate_peak(["blocks.7"])


def test_meta_incompatible_model_errors_then_falls_back():
    class Picky(nn.Module):  # data-dependent shape: keeps only positive rows
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(h[h[:, 0] > 0])

    model, x = Picky(), torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(MetaProfilingError, match=r"Picky cannot be profiled on the meta device.*device='cpu'"):
        profile_model(model, x)
    prof = profile_model(model, x, fallback="cpu")
    assert "fell back to cpu" in prof.notes[0]
    real = measure_step_peak(model, x)
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND


def test_plain_sequential():
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    x = torch.randn(64, 32)
    prof = profile_model(model, x, loss_fn=lambda out: out.square().mean())
    assert [b.name for b in prof.blocks] == ["0", "1", "2", "3", "4"]
    assert prof.param_numel == sum(p.numel() for p in model.parameters())
    real = measure_step_peak(model, x, loss_fn=lambda out: out.square().mean())
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND


@RunIf(lightning=True)
def test_lightning_demo_transformer():
    from lightning.pytorch.demos import Transformer

    model = Transformer(vocab_size=100, ninp=32, nhead=2, nhid=64, nlayers=2)
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, 100, (8, 20), generator=g), torch.randint(0, 100, (8, 20), generator=g)
    loss = lambda out: F.nll_loss(out, target.view(-1))  # noqa: E731 - what the demo's LightningModule does
    # nn.Transformer compares its mask with a causal one (torch.equal): data-dependent, so meta refuses.
    with pytest.raises(MetaProfilingError, match=r"DataDependent.*small batch"):
        profile_model(model, (ids, target), loss_fn=loss)
    prof = profile_model(model, (ids, target), loss_fn=loss, fallback="cpu")
    names = [b.name for b in prof.blocks]
    assert "transformer.encoder.layers.1" in names and "transformer.decoder.layers.1" in names
    assert names.index("embedding") < names.index("transformer.encoder.layers.0") < names.index("decoder")
    real = measure_step_peak(model, (ids, target), loss_fn=loss)
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND


def _hf_models():
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
    )

    return {
        "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2),
                 "transformer.h."),
        "opt": (OPTForCausalLM, OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                          num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=32),
                "model.decoder.layers."),
        "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                max_position_embeddings=64), "model.layers."),
    }


@RunIf(transformers=True)
@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_transformers_causal_lms(family):
    cls, cfg, layer_prefix = _hf_models()[family]
    torch.manual_seed(0)
    model = cls(cfg)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    prof = profile_model(model, batch)  # backpropagates output.loss
    layers = [b.name for b in prof.blocks if b.name.startswith(layer_prefix)]
    assert layers == [f"{layer_prefix}0", f"{layer_prefix}1"]
    assert prof.param_numel == model.num_parameters()
    assert prof.model == family or prof.model == cfg.model_type
    real = measure_step_peak(model, batch)
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND


@RunIf(torchrec=True)
def test_torchrec_dlrm():
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=500, feature_names=[f"f{i}"])
              for i in range(3)]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables), dense_in_features=8,
                 dense_arch_layer_sizes=[32, 16], over_arch_layer_sizes=[32, 1])
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4, (3 * 32,), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1", "f2"], lengths=lengths,
                                              values=torch.randint(0, 500, (int(lengths.sum()),), generator=g))
    inputs = (torch.randn(32, 8, generator=g), kjt)
    # Pooling jagged lookups needs the lengths' values: meta refuses, the CPU fallback profiles.
    with pytest.raises(MetaProfilingError, match=r"DLRM cannot be profiled on the meta device"):
        profile_model(model, inputs)
    prof = profile_model(model, inputs, fallback="cpu")
    names = [b.name for b in prof.blocks]
    assert {"sparse_arch", "inter_arch", "over_arch"} <= set(names)
    assert prof.param_numel == sum(p.numel() for p in model.parameters())
    real = measure_step_peak(model, inputs)
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND


# ---------------------------------------------------------------------------- optimizer state


def _real_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    model(torch.zeros(2, 8, dtype=torch.long)).float().sum().backward()
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,kwargs,ours", [
    ("SGD", {"lr": 0.1}, ("sgd", {})),
    ("SGD", {"lr": 0.1, "momentum": 0.9}, ("sgd", {"momentum": 0.9})),
    ("Adam", {}, ("adam", {})),
    ("AdamW", {}, ("adamw", {})),
    ("AdamW", {"amsgrad": True}, ("adamw", {"amsgrad": True})),
    ("Adagrad", {}, ("adagrad", {})),
])
def test_optimizer_state_bytes_exact(dtype, name, kwargs, ours):
    model = build_gpt("gpt2-tiny").to(dtype)
    model.wpe.weight.requires_grad_(False)  # frozen parameters hold no state
    prof = profile_model(model, torch.zeros(2, 8, dtype=torch.long))
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    opt = getattr(torch.optim, name)([p for p in model.parameters() if p.requires_grad], **kwargs)
    assert optimizer_state_bytes(prof, ours[0], precision=precision, **ours[1]) == _real_state_bytes(model, opt)


def test_mixed_precision_optimizer_bytes():
    prof = profile_model(build_gpt("gpt2-tiny", device="meta"), torch.zeros(1, 8, dtype=torch.long))
    n, tensors = prof.param_numel, len(prof.params)
    # fp32 master copy + two fp32 moments per element (ZeRO's K = 12), plus the step scalars.
    assert prof.optimizer_state_bytes("adamw", precision="mixed") == 12 * n + 4 * tensors
    assert prof.optimizer_state_bytes("sgd", precision="mixed-bf16", momentum=0.9) == 8 * n
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; known: sgd, adam, adamw, adagrad"):
        prof.optimizer_state_bytes("lion")
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'"):
        prof.optimizer_state_bytes("adamw", precision="fp8")


def test_loss_backward_is_measured_apart_from_the_head_it_follows():
    # An untied head with parameters, then a cross-entropy: the loss's backward (the gradient of log-softmax's output
    # and of the logits, 2 x the logits' bytes) runs before any node of the head, so before a sharded runtime would
    # gather the head's weight; the profile keeps the two apart, and the whole backward's peak is unchanged.
    vocab, batch, seq = 2048, 8, 16
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
    logits = batch * seq * vocab * 4

    def model(device="cpu"):
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, vocab)).to(device)
    prof = profile_model(model("meta"), ids, loss_fn=_ce(targets))
    head = prof.blocks[-1]
    assert head.param_numel == 32 * vocab + vocab
    assert 1.9 * logits <= head.loss_transient_bytes <= 2 * logits + 64 * 1024, head
    assert head.transient_bytes < logits // 4, head  # the head's own backward: a small input gradient
    assert head.backward_transient_bytes == head.loss_transient_bytes
    assert all(b.loss_transient_bytes == 0 for b in prof.blocks[:-1])
    real = measure_step_peak(model(), ids, loss_fn=_ce(targets))
    assert _rel(prof.peak_bytes, real.total_bytes) <= BOUND, (prof.peak_bytes, real)
