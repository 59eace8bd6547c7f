"""Predicted vs measured on one GPU: the calibrated Elixir cost model against real DDP / FSDP2 steps.

    python -m benchmarks.gpu.cost_model [--quick] [--smoke]

The CPU benchmark (``benchmarks/cost_model.py``) on the GPU: one rank (NCCL), blocks timed on the GPU
with CUDA synchronisation, FSDP2 per-unit overhead calibrated there (no collectives at one rank), peaks
from ``max_memory_allocated``, step time as wall time between synchronisations. Contenders as on the
CPU: DDP, FSDP2 full shard, no-reshard, + CPU offload (pinned), Elixir's plan at 60% of DDP's predicted
peak, two other frontier plans. GPT-2-shaped models of hidden 1024 x 8 layers and 2048 x 8 layers
(``--quick``: the first), batch 4 x 128 per rank (the CPU benchmark's ``_rank`` sets it), fp32 AdamW.
``--smoke``: the CPU sizes on the CPU (checks the script runs; numbers mean nothing for a GPU).
"""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

from benchmarks.gpu.common import ensure_tightfit, parser, skip, write_result

NAME = "cost_model"
GPU_SIZES = {"1024x8": dict(hidden=1024, layers=8), "2048x8": dict(hidden=2048, layers=8)}


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    ensure_tightfit()
    import torch
    import torch.multiprocessing as mp

    from benchmarks.cost_model import SIZES, _rank, analyse, markdown_for

    if not torch.cuda.is_available() and not args.smoke:
        return skip(NAME, "cost model (GPU)", "no CUDA device")
    device_type = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    sizes = SIZES if args.smoke else (dict(list(GPU_SIZES.items())[:1]) if args.quick else GPU_SIZES)
    repeats = args.repeats or (3 if args.smoke else 5 if args.quick else 7)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "cost_model_gpu.json"
    world = 1 if device_type == "cuda" else 2
    mp.spawn(_rank, args=(world, port, args.quick, repeats, str(out), device_type, sizes), nprocs=world, join=True)
    res = json.loads(out.read_text())
    res.pop("calibration", None)
    analysis = {size: analyse(r) for size, r in res.items()}
    lines: list[str] = []
    for size, r in res.items():
        lines += markdown_for(size, r, analysis[size]) + [""]
    summary = "; ".join(f"{size}: rank corr {a['spearman']:.2f}, worst step error "
                        f"{max(abs(x['time_err']) for x in a['rows'].values()) * 100:.0f}%, pick "
                        f"{a['pick_gap'] * 100:+.1f}% vs fastest fitting" for size, a in analysis.items())
    write_result(NAME, title="Cost model: predicted vs measured (GPU)", results={"raw": res, "analysis": analysis},
                 summary=summary, params={"repeats": repeats, "device": device_type, "sizes": list(sizes)})
    print("\n".join(lines))
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
