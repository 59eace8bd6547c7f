"""Generate from a Hugging Face model directory on one process or a ``tp x pp`` grid of them.

    python examples/energon_infer/generate.py --model path/to/dir --prompt "Hello" --prompt "Once upon"
    torchrun --nproc-per-node 4 examples/energon_infer/generate.py --model path/to/dir --tp 2 --pp 2

Without ``--model`` it writes a random (untrained) LLaMA-architecture directory to
``runs/energon_generate/random-llama`` first (nothing is downloaded), so the script runs anywhere; its
text is noise. Every rank runs the same calls; rank 0 prints, and writes the prompts and outputs to
``--out`` (default ``runs/energon_generate``) as ``generations.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

_SAY = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 talks
if _SAY:
    print("[generate] importing PyTorch ...", flush=True)  # each takes seconds to import: say so first
import torch
import torch.distributed as dist

if _SAY:
    print("[generate] importing energon_infer ...", flush=True)
from energon_infer import ModelRunner, SamplingParams
from energon_infer.demo import write_random_llama


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="directory with config.json, *.safetensors and tokenizer.json "
                                   "(default: write a random one under runs/energon_generate/)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; default: two examples)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--out", default="runs/energon_generate",
                   help="folder for generations.json and the random model (default %(default)s)")
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = args.model
    if path is None:
        shared = [os.path.abspath(os.path.join(args.out, "random-llama"))]
        if rank == 0:
            write_random_llama(shared[0])
            print(f"[generate] no --model: wrote a random, untrained LLaMA-architecture model to {shared[0]} "
                  "(its text is noise; pass --model DIR for a real one)", flush=True)
        if dist.is_initialized():  # one writer; the others read its directory (same machine)
            dist.broadcast_object_list(shared, src=0)
        path = shared[0]
    if rank == 0:
        print(f"[generate] loading {path} on tp={args.tp} x pp={args.pp} ...", flush=True)
    runner = ModelRunner.from_pretrained(path, tp=args.tp, pp=args.pp, dtype=args.dtype)
    prompts = args.prompt or ["a batch of unequal prompts", "the controller sends"]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    if rank == 0:
        print(f"[generate] generating up to {args.max_tokens} tokens for {len(prompts)} prompt(s) ...", flush=True)
    start = time.perf_counter()
    outs = runner.generate(prompts, params)
    seconds = time.perf_counter() - start
    if rank == 0:
        for prompt, out in zip(prompts, outs):
            print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}]")
        tokens = sum(len(o.token_ids) for o in outs)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generations.json").write_text(json.dumps(
            {"model": path, "tp": args.tp, "pp": args.pp, "seconds": seconds,
             "outputs": [{"prompt": p, "text": o.text, "token_ids": list(o.token_ids),
                          "finish_reason": o.finish_reason} for p, o in zip(prompts, outs)]}, indent=2))
        print(f"[generate] {tokens} tokens in {seconds:.2f} s on tp={args.tp} x pp={args.pp}; model: {path}; "
              f"outputs: {out / 'generations.json'}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
