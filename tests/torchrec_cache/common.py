"""Shared fixtures of the torchrec_cache tests: small tables, Zipf-distributed KJT batches, reference optimizers."""

from __future__ import annotations

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim import RowWiseAdagrad

from torchrec_cache import RowOptimizer

TOL = 1e-6  # the bar for fp32 equivalence, as atol and rtol of torch.testing.assert_close


def tables(pooling_b: PoolingType = PoolingType.MEAN) -> list[EmbeddingBagConfig]:
    # Two features share table t0; t1 pools by mean; t2 is wider.
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=211, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=97, feature_names=["f2"], pooling=pooling_b),
        EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=150, feature_names=["f3"]),
    ]


def zipf_ids(n: int, rows: int, gen: torch.Generator, a: float = 1.1) -> torch.Tensor:
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** a
    perm = torch.randperm(rows, generator=gen)
    return perm[torch.multinomial(probs, n, replacement=True, generator=gen)]


def make_kjt(cfgs: list[EmbeddingBagConfig], batch: int, gen: torch.Generator, *, max_len: int = 6,
             weighted: bool = False) -> KeyedJaggedTensor:
    keys, lengths, values = [], [], []
    for cfg in cfgs:
        for f in cfg.feature_names:
            ln = torch.randint(0, max_len + 1, (batch,), generator=gen)
            keys.append(f)
            lengths.append(ln)
            values.append(zipf_ids(int(ln.sum()), cfg.num_embeddings, gen))
    v = torch.cat(values)
    w = torch.rand(v.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys, v, torch.cat(lengths), weights=w)


def reference_optimizer(ebc: EmbeddingBagCollection, opt: RowOptimizer) -> torch.optim.Optimizer:
    """The PyTorch/TorchRec optimizer the fused one mirrors, on a plain collection."""
    params = list(ebc.parameters())
    if opt.kind == "sgd":
        return torch.optim.SGD(params, lr=opt.lr)
    if opt.kind == "adagrad":
        return torch.optim.Adagrad(params, lr=opt.lr, eps=opt.eps,
                                   initial_accumulator_value=opt.initial_accumulator_value)
    if opt.kind == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=opt.lr, eps=opt.eps)
    # Lazy Adam: SparseAdam needs sparse gradients, which nn.EmbeddingBag gives with sparse=True.
    for bag in ebc.embedding_bags.values():
        bag.sparse = True
    return torch.optim.SparseAdam(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


def reference_state(optim: torch.optim.Optimizer, ebc: EmbeddingBagCollection) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, bag in ebc.embedding_bags.items():
        st = optim.state.get(bag.weight, {})
        out[name] = {k: v for k, v in st.items() if k != "step"}
    return out
