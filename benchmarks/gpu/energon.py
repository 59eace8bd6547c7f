"""energon_infer runtime vs transformers on one GPU, ~1B-parameter LLaMA-architecture model in bf16.

    python -m benchmarks.gpu.energon [--quick] [--smoke]

1. Padding elimination: prefill (next-token logits) of 32 prompts with lengths spread evenly over
   16..512: energon packed (Triton paged variable-length attention, no pad token in any matmul), the
   same runtime on the batch padded to the longest prompt, and transformers' forward on the padded
   batch (SDPA attention, ``logits_to_keep=1``). Limit: max/mean length (linear layers) and
   max²/mean(len²) (attention).
2. Generation: greedy tokens/s, energon ``generate`` (continuous batching, paged KV cache) vs
   transformers ``generate`` on the left-padded batch, same prompts and lengths.
3. The paged attention kernel alone vs its PyTorch reference on the same prefill and decode shapes.

The model is built once on the GPU with transformers (random weights) and the runtime is loaded
from its state dict (the same tensors; no disk). Runs on torch + Triton + transformers only.
``--smoke`` runs tiny sizes on the CPU (Triton interpreter) to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from benchmarks.gpu.common import (
    ROOT,
    ensure_tightfit,
    interleave_cuda,
    parser,
    skip,
    summarize,
    write_result,
)

NAME, TITLE = "energon", "energon_infer vs transformers on one GPU (~1B LLaMA-arch, bf16)"


def ensure_energon() -> None:
    # The tree is copied, not installed, onto the GPU machine: plugins/ holds the energon_infer package.
    ensure_tightfit()
    if str(ROOT / "plugins") not in sys.path:
        sys.path.insert(0, str(ROOT / "plugins"))


def llama_model(smoke: bool, device, dtype):
    """The ~0.89B LLaMA-architecture model (random weights) these GPU benchmarks run, or a tiny one for --smoke."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=512, max_position_embeddings=1024)
    else:  # 0.89B parameters: 16 layers of width 2048, 128-wide heads, GQA 16/8, vocabulary 32000
        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                          intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def _lengths(n: int, lo: int, hi: int) -> list[int]:
    import torch

    lengths = torch.linspace(lo, hi, n).round().long()
    return lengths[torch.randperm(n, generator=torch.Generator().manual_seed(0))].tolist()


def _padded(prompts, device):
    from benchmarks.common import left_padded

    ids, mask = left_padded(prompts)
    return ids.to(device), mask.to(device)


def _hf_last_logits(hf, ids, mask):
    try:
        return hf(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
    except TypeError:  # transformers < 4.50 has no logits_to_keep
        return hf(input_ids=ids, attention_mask=mask).logits[:, -1]


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__ or TITLE).parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["TIGHTFIT_KERNELS"] = "triton"  # exercise the kernels on the interpreter
    import torch

    if not args.smoke and not torch.cuda.is_available():
        return skip(NAME, TITLE, "no CUDA device")
    try:
        import transformers  # noqa: F401
    except ImportError:
        return skip(NAME, TITLE, "transformers is not installed (the peer)")
    ensure_energon()
    from tightfit.kernels.dispatch import triton_available, triton_import_error

    if not triton_available():
        return skip(NAME, TITLE, f"Triton does not import ({triton_import_error()})")
    from energon_infer.loading.config import config_from_hf
    from energon_infer.sampling import SamplingParams
    from energon_infer.worker.runtime import ModelRunner, RuntimeConfig
    from tightfit.kernels.varlen_attention import paged_attention

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    repeats = args.repeats or (2 if args.smoke else 5 if args.quick else 7)
    n, lo, hi = (4, 4, 24) if args.smoke else (32, 16, 512)
    gen_n, gen_lo, gen_hi, new = (2, 4, 8, 3) if args.smoke else ((16, 64, 256, 64) if args.quick else (32, 64, 512, 128))
    t0 = time.perf_counter()
    hf = llama_model(args.smoke, device, dtype)
    params = sum(p.numel() for p in hf.parameters())
    runner = ModelRunner(config_from_hf(hf.config.to_dict()), hf.state_dict(),
                         RuntimeConfig(dtype="float32" if args.smoke else "bfloat16", device=str(device),
                                       kv_cache_tokens=max(n * hi, gen_n * (gen_hi + new)) + 1024, progress=False))
    print(f"[{NAME}] {params / 1e9:.2f}B params built and loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(1)
    results: dict = {"params": params}

    # ---- 1. padding elimination (prefill)
    lengths = _lengths(n, lo, hi)
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
    width = max(lengths)
    padded_items = [p + [0] * (width - len(p)) for p in prompts]
    ids, mask = _padded(prompts, device)

    def run(items):
        out = runner.forward(list(enumerate(items)))
        for i in range(len(items)):
            runner.free(i)
        return out

    with torch.inference_mode():
        diff = (run(prompts).float() - _hf_last_logits(hf, ids, mask).float()).abs().max().item()
        times = interleave_cuda({"energon packed": lambda: run(prompts), "energon padded": lambda: run(padded_items),
                                 "transformers padded": lambda: _hf_last_logits(hf, ids, mask)},
                                repeats=repeats, warmup=1, iters=1 if args.smoke else 3)
    med = {k: summarize(v)["median"] for k, v in times.items()}
    results["prefill"] = {
        "lengths": lengths, "tokens_packed": sum(lengths), "tokens_padded": n * width,
        "limit_max_over_mean": width * n / sum(lengths), "attention_limit": n * width ** 2 / sum(k * k for k in lengths),
        "max_abs_logit_diff_vs_transformers_bf16": diff, "times_s": times,
        "speedup_vs_own_padded": med["energon padded"] / med["energon packed"],
        "speedup_vs_transformers": med["transformers padded"] / med["energon packed"],
    }
    print(f"[{NAME}] prefill: packed {med['energon packed'] * 1e3:.1f} ms, padded {med['energon padded'] * 1e3:.1f} ms, "
          f"transformers {med['transformers padded'] * 1e3:.1f} ms", flush=True)

    # ---- 2. generation throughput
    glens = _lengths(gen_n, gen_lo, gen_hi)
    gprompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in glens]
    gids, gmask = _padded(gprompts, device)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    def energon_generate():
        return [x.token_ids for x in runner.generate(gprompts, sp)]

    def hf_generate():
        out = hf.generate(input_ids=gids, attention_mask=gmask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
        return out[:, gids.shape[1]:].tolist()

    with torch.inference_mode():
        same = sum(a == b for a, b in zip(energon_generate(), hf_generate()))
        gtimes = interleave_cuda({"energon generate": energon_generate, "transformers generate": hf_generate},
                                 repeats=max(2, repeats - 2), warmup=1, iters=1)
    tps = {k: [gen_n * new / t for t in v] for k, v in gtimes.items()}
    gmed = {k: summarize(v)["median"] for k, v in tps.items()}
    results["generate"] = {"lengths": glens, "new_tokens": new, "identical_greedy_outputs": f"{same}/{gen_n}",
                           "times_s": gtimes, "tokens_per_s": tps,
                           "throughput_ratio": gmed["energon generate"] / gmed["transformers generate"]}
    print(f"[{NAME}] generate: energon {gmed['energon generate']:.0f} tok/s, transformers "
          f"{gmed['transformers generate']:.0f} tok/s", flush=True)

    # ---- 3. the attention kernel alone (prefill shape of case 1, and a decode step over it)
    cfg = runner.config
    k_cache, v_cache = runner.cache.k[0], runner.cache.v[0]
    kernel: dict = {}
    for label, q_lens in (("prefill", lengths), ("decode", [1] * n)):
        kv = torch.tensor(lengths, dtype=torch.int32, device=device)
        q = torch.randn(sum(q_lens), cfg.n_heads, cfg.head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        per = -(-width // runner.cache.block_size)
        tables = torch.arange(n * per, dtype=torch.int32, device=device).view(n, per) % runner.cache.num_blocks
        call = {b: functools.partial(paged_attention, q, k_cache, v_cache, tables, cu, kv, scale=cfg.head_dim ** -0.5,
                                     max_q_len=max(q_lens), backend=b) for b in ("reference", "triton")}
        err = (call["triton"]().float() - call["reference"]().float()).abs().max().item()
        kt = interleave_cuda(call, repeats=repeats, warmup=1, iters=1 if args.smoke else 10)
        kernel[label] = {"max_abs_diff": err, "times_s": kt,
                         "speedup": summarize(kt["reference"])["median"] / summarize(kt["triton"])["median"]}
    results["attention_kernel"] = kernel
    p, gr = results["prefill"], results["generate"]
    summary = (f"prefill packed/padded {p['speedup_vs_own_padded']:.2f}x (limit {p['limit_max_over_mean']:.2f}-"
               f"{p['attention_limit']:.2f}x), vs transformers {p['speedup_vs_transformers']:.2f}x; generate "
               f"{gr['throughput_ratio']:.2f}x transformers tok/s; paged attention vs torch "
               f"{kernel['prefill']['speedup']:.1f}x prefill, {kernel['decode']['speedup']:.1f}x decode")
    if args.smoke:
        summary = "smoke (CPU interpreter; numbers mean nothing): " + summary
    write_result(NAME, title=TITLE, results=results, summary=summary,
                 params={"quick": args.quick, "smoke": args.smoke, "repeats": repeats, "dtype": str(dtype)})
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
