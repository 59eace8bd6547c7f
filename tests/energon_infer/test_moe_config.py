"""Reading the Mixture-of-Experts fields of config.json: which layers are sparse (transformers' own models are
the reference), any value a user's file may hold either loads or is refused in one line naming the field, and
the tensor-parallel widths an MoE model must divide."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from energon_infer.loading.config import ConfigError, UnsupportedModelError, config_from_hf
from energon_infer.worker.model import check_tp

_SIZES = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=24, vocab_size=11,
              max_position_embeddings=32, moe_intermediate_size=8, shared_expert_intermediate_size=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_type=st.sampled_from(["mixtral", "qwen2_moe", "qwen3_moe"]), n_layers=st.integers(1, 5),
       n_experts=st.integers(0, 6), step=st.integers(1, 3), dense=st.lists(st.integers(0, 6), max_size=3, unique=True),
       norm=st.booleans(), data=st.data())
def test_the_sparse_layers_and_their_sizes_are_transformers_own(model_type, n_layers, n_experts, step, dense, norm,
                                                                data):
    from transformers import AutoConfig, AutoModelForCausalLM

    n_experts = max(n_experts, 1) if model_type == "mixtral" else n_experts
    top_k = data.draw(st.integers(1, max(n_experts, 1)))
    experts = dict(num_local_experts=n_experts) if model_type == "mixtral" else dict(
        num_experts=n_experts, decoder_sparse_step=step, mlp_only_layers=dense, norm_topk_prob=norm)
    sizes = {k: v for k, v in _SIZES.items() if model_type != "mixtral" or "expert" not in k}
    hf = AutoConfig.for_model(model_type, num_hidden_layers=n_layers, num_experts_per_tok=top_k, **sizes, **experts)
    cfg = config_from_hf(hf.to_dict())  # what save_pretrained writes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert [cfg.sparse(i) for i in range(n_layers)] == sparse
    assert cfg.n_sparse == sum(sparse)
    for layer, is_sparse in zip(model.model.layers, sparse):
        assert cfg.mlp_params(is_sparse) == sum(p.numel() for p in layer.mlp.parameters())
    if any(sparse):
        assert (cfg.n_experts, cfg.experts_per_token) == (n_experts, top_k)
        assert cfg.norm_topk == (norm or model_type == "mixtral")


_BASE = {"model_type": "qwen2_moe", "vocab_size": 11, "hidden_size": 16, "num_hidden_layers": 3,
         "num_attention_heads": 2, "intermediate_size": 24, "max_position_embeddings": 32, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12}
_FIELDS = ["num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers"]
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=3), st.lists(st.one_of(st.integers(-2, 8), st.booleans(), st.text(max_size=2)),
                                                  max_size=3))


@settings(max_examples=200, deadline=None)
@given(model_type=st.sampled_from(["mixtral", "qwen2_moe", "qwen3_moe"]), field=st.sampled_from(_FIELDS),
       value=_VALUES)
def test_any_moe_field_value_loads_or_is_refused_in_one_line_naming_it(model_type, field, value):
    raw = {**_BASE, "model_type": model_type, field: value}
    try:
        cfg = config_from_hf(raw)
    except (ConfigError, UnsupportedModelError) as err:
        assert "\n" not in str(err)
        assert field in str(err), str(err)
        return
    if cfg.n_experts:
        assert 1 <= cfg.experts_per_token <= cfg.n_experts and cfg.moe_intermediate_size >= 1 and cfg.moe_step >= 1


def test_tp_splits_experts_whole_where_it_divides_them_else_their_width():
    raw = {**_BASE, "model_type": "mixtral", "num_attention_heads": 8, "num_key_value_heads": 8,
           "num_experts": 6, "intermediate_size": 36}
    cfg = config_from_hf(raw)
    assert [cfg.expert_parallel(tp) for tp in (1, 2, 3, 4)] == [True, True, True, False]
    check_tp(cfg, 2)
    check_tp(cfg, 4)  # 4 does not divide 6 experts: each expert's 36 columns split in 4
    match = (r"tp=8 does not divide the 36 expert MLP width \(moe_intermediate_size; or a tp dividing num_experts\) "
             r"of this mixtral model; .* use tp in \[1, 2, 4\]")
    with pytest.raises(ValueError, match=match):
        check_tp(cfg, 8)
