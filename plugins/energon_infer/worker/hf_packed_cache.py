"""The transformers path for models whose attention is their own code (falcon): a cache object and a mask.

Such a model never calls transformers' attention interface, so energon cannot supply its attention; it does call
its cache's ``update(key, value, layer_idx)`` in every layer and attends over what comes back under the mask it
is given. :class:`PackedCache` is that cache for one packed step: ``update`` writes the step's new keys/values into
energon's paged :class:`~energon_infer.worker.kv_cache.KVCache` and returns every sequence's cached keys/values
back to back, ``(1, kv_heads, sum of kv_lens, head_dim)``; :func:`packed_mask` is the 4-D additive mask that lets
each new token see its own sequence's keys up to its position and nothing else (a 4-D mask is used as given).

The model's own attention then does the math, so this path is exact where the model honours the cache and the
mask; :func:`check_packed_step` measures that at load (a packed prefill and a decode step against the model's
own forward; :mod:`energon_infer.worker.hf_stage` refuses a model that fails it, on either path). It gathers
each sequence's whole context every layer: slower than the interface path, which reads the paged cache in place.
"""

from __future__ import annotations

from typing import Any

import torch

from energon_infer.worker.kv_cache import KVCache, StepMetadata
from tightfit.kernels.varlen_attention import store_kv

__all__ = ["PackedCache", "packed_mask", "check_packed_step"]


def _key_layout(meta: StepMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every cached key of the step's sequences, back to back: its sequence, its position, its cache slot."""
    lens = meta.kv_lens.long()
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    starts = torch.zeros_like(lens)
    torch.cumsum(lens[:-1], 0, out=starts[1:])
    pos = torch.arange(seq.shape[0], device=lens.device) - starts[seq]
    slots = meta.block_tables.long()[seq, pos // block_size] * block_size + pos % block_size
    return seq, pos, slots


def packed_mask(meta: StepMetadata, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(1, 1, new tokens, cached keys)``: 0 where a new token may attend (its own sequence, a position at or
    before its own), the dtype's minimum elsewhere."""
    seq, pos, _ = _key_layout(meta, block_size)
    cu = meta.cu_seqlens.long()
    q_seq = torch.repeat_interleave(torch.arange(cu.shape[0] - 1, device=cu.device), cu[1:] - cu[:-1])
    allowed = (q_seq[:, None] == seq[None, :]) & (pos[None, :] <= meta.positions[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


class PackedCache:
    """transformers' cache interface over one packed step of energon's paged cache (see the module docstring).

    Args:
        meta: the step.
        cache: the paged cache (its layer ``i`` is the model's layer ``i``: one stage holds every layer).
        probe: a list to record each layer's ``(layer_idx, kv_heads, head_dim, value width)`` into instead of
            caching (at load, before the cache exists).
    """

    def __init__(self, meta: StepMetadata | None, cache: KVCache | None, probe: list[tuple[int, ...]] | None = None):
        self.meta, self.cache, self.probe = meta, cache, probe
        self._slots = None if meta is None or cache is None else _key_layout(meta, cache.block_size)[2]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.probe is not None:
            self.probe.append((layer_idx, key.shape[1], key.shape[-1], value.shape[-1]))
            return key, value
        assert self.meta is not None and self.cache is not None and self._slots is not None
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, self.meta.slot_mapping)
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        keys = k_cache.view(-1, heads, dim).index_select(0, self._slots)
        values = v_cache.view(-1, heads, dim).index_select(0, self._slots)
        return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before this step; a packed step has one per sequence, so this is 0 and the positions
        come from ``position_ids`` (an alibi model, which sizes its bias from this, fails the load check)."""
        return 0


def check_packed_step(forward: Any, reference: Any, n_layers: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device, vocab: int) -> float:
    """The largest difference, relative to the logits' spread, between ``forward`` (a stage's packed step) and
    ``reference`` (token ids ``(1, L)`` -> the model's own logits ``(L, vocab)``): two sequences prefilled together,
    then one decode step each. Anything that mixes the sequences or loses the context shows here."""
    cache = KVCache(n_layers=n_layers, num_blocks=4, block_size=4, n_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype, device=device)
    prompts = [[t % vocab for t in (3, 5, 7)], [t % vocab for t in (11, 13)]]
    nxt = [17 % vocab, 19 % vocab]
    cache.assign(0, [0])
    cache.assign(1, [1])
    first = forward(torch.tensor(prompts[0] + prompts[1], device=device), cache.prepare([(0, 3), (1, 2)], device),
                    cache, all_logits=True)
    second = forward(torch.tensor(nxt, device=device), cache.prepare([(0, 1), (1, 1)], device), cache)
    worst = 0.0
    with torch.inference_mode():
        for i, (prompt, last) in enumerate(zip(prompts, nxt)):
            ref = reference(torch.tensor([prompt + [last]], device=device)).float()
            got = torch.cat([first[(0, 3)[i]:(3, 5)[i]], second[i:i + 1]]).float()
            worst = max(worst, float((got - ref).abs().max() / (ref.std() + 1e-6)))
    return worst
