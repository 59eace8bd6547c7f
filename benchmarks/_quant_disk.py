"""energon_quant's disk-tier part: under a hard memory cap, the largest model each format serves, and its tokens/s.

    python -m benchmarks._quant_disk [--quick]        # this part alone: prints its JSON and report section

The setup of benchmarks/energon_offload.py: one engine process per cell, started in a
fresh cgroup v1 memory group (benchmarks/memlimit.py; the page cache counts) after the page cache is dropped,
no weights budget (the serving planner fits the whole process under the cap, as for a user who gives none),
one core fewer than the machine for compute (the other for the reads). The candidates are random LLaMA models of
one depth and growing width (heads of 128, 2 key/value heads); for each format (fp32, int8, int4 at group 32, a
size every candidate's widths take) the pool planner says which candidates fit ``limit - 896 MiB`` of weights
(192 MiB less for the quantized formats, whose two processes import torchao) with every layer it must
stream read from disk (``plan_tiers`` on headers only: the candidates are written as safetensors headers over
sparse files, no bytes), and the largest is then served for real under the cap: its greedy tokens/s at one
batch, its peak memory and the bytes its disk layers move per step. A quantized model's first load writes its
quantized store (its own run, capped if it fits, else uncapped and said so), the measured run reuses it. The
largest model fp32 serves is also served in every format: tokens/s and bytes streamed on the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

from benchmarks.energon_offload import WORK, GiB, MiB, run_cell, save_model
from benchmarks.memlimit import limit_unavailable

FORMATS = {"fp32": (None, None), "int8": ("int8", None), "int4": ("int4", 32)}
OVERHEAD = 896 * MiB  # the processes themselves (as benchmarks/energon_offload.py's default budget leaves)
# Importing torchao (and the quantized kernels) costs ~82 MiB of RSS per process here, in the caller and the worker.
TORCHAO = 2 * 96 * MiB


def _config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
                       num_key_value_heads=2, intermediate_size=hidden * 8 // 3 // 32 * 32, vocab_size=vocab,
                       max_position_embeddings=512, tie_word_embeddings=False)


def shapes_only_model(hidden: int, layers: int, vocab: int) -> Path:
    """A model directory whose safetensors file has the real header over a sparse (unwritten) data region: what
    the planner reads (config.json and the tensors' shapes), in no time and no disk."""
    import torch
    from transformers import LlamaForCausalLM

    path = WORK / "shapes" / f"llama-h{hidden}-l{layers}-v{vocab}"
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(hidden, layers, vocab)
    cfg.save_pretrained(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    header: dict[str, Any] = {}
    offset = 0
    for name, t in model.state_dict().items():
        n = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return path


def fits(path: Path, method: str | None, group: int | None, budget: int) -> bool:
    """Whether the tiered plan of ``path`` in this format fits ``budget`` on a CPU (the planner's answer)."""
    from energon_infer.loading.config import load_config
    from energon_infer.loading.quantization import QuantSpec
    from energon_infer.worker.disk_pool import plan_tiers
    from energon_infer.worker.memory_pool import MemoryPoolConfig
    from tightfit.planner.errors import PlanInfeasibleError

    pool = MemoryPoolConfig(memory_budget=budget, lookahead=1, disk="nvme-gen4",
                            quantized_dir=str(WORK / "shapes-q"))
    try:
        plan_tiers(path, load_config(path), tp=1, pp=1, dtype="float32", device_type="cpu", config=pool,
                   quant=QuantSpec.create(method, group))
    except PlanInfeasibleError:
        return False
    return True


def _serve(model: Path, method: str | None, group: int | None, *, limit: int, batch: int,
           new_tokens: int, threads: int, timeout: float) -> dict[str, Any]:
    from benchmarks.energon_offload import _prompts

    prompts = _prompts(batch, 4096, 0)
    options: dict[str, Any] = {"kv_cache_tokens": max(512, batch * 32 + 256), "max_batch_tokens": 2048,
                               "max_running": max(64, batch)}
    if method:
        options.update(quantization=method, group_size=group)
    # Served as a user serves under a limit: no weights budget, the serving planner fits the whole process in it
    # (the quantized store beside the model, where a first load writes it).
    spec = {"model": str(model), "prompts": prompts, "new_tokens": new_tokens, "threads": threads,
            "runner": "energon", "options": options, "planned": True}
    first = run_cell("energon", sys.executable, spec, limit, timeout) if method else None
    capped = first is None or "error" not in first
    if not capped:  # writing the store holds a layer's fp32 tensors and torchao's temporaries: try it uncapped
        first = {**run_cell("energon", sys.executable, spec, None, timeout), "capped_error": first.get("error")}
    cell = run_cell("energon", sys.executable, spec, limit, timeout)
    if first is not None:
        cell["first_load"] = {"capped": capped, **{k: first.get(k) for k in ("load_s", "peak_bytes", "error",
                                                                            "capped_error")}}
    if "tokens" in cell:
        generated = sum(len(t) for t in cell["tokens"])
        cell["tokens_per_s"] = generated / cell["seconds"]
        del cell["tokens"]
    return cell


def disk_case(quick: bool) -> dict[str, Any]:
    """The section's measurements (see the module docstring)."""
    why = limit_unavailable()
    if why:
        return {"skipped": why}
    limit = int(1.5 * GiB)
    budgets = {name: limit - OVERHEAD - (TORCHAO if m else 0) for name, (m, _) in FORMATS.items()}
    layers, vocab = 4, 4096
    hiddens = (1536, 2048, 3072, 3584, 4096)
    batch, new_tokens = (8, 4) if quick else (8, 8)
    threads = max(1, (os.cpu_count() or 1) - 1)
    planned = {name: [h for h in hiddens if fits(shapes_only_model(h, layers, vocab), m, g, budgets[name])]
               for name, (m, g) in FORMATS.items()}
    for name in ("quantized", "models"):  # every quantized store is written by this run
        for store in (WORK / name).glob("**/.tightfit-quantized") if name == "models" else [WORK / name]:
            shutil.rmtree(store, ignore_errors=True)
    out: dict[str, Any] = {"limit_bytes": limit, "budget_bytes": budgets, "layers": layers, "vocab": vocab,
                           "hiddens": list(hiddens), "fits": planned, "batch": batch, "new_tokens": new_tokens,
                           "threads": threads, "largest": {}, "same_model": {}}
    for name, (m, g) in FORMATS.items():
        if not planned[name]:
            out["largest"][name] = {"error": "no candidate fits the budget"}
            continue
        h = max(planned[name])
        model = save_model(h, layers, vocab)
        cell = _serve(model, m, g, limit=limit, batch=batch, new_tokens=new_tokens,
                      threads=threads, timeout=600.0)
        out["largest"][name] = {"hidden": h, "weight_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
                                **cell}
        print(f"[quant-disk] {name} largest h={h}: {cell.get('tokens_per_s', cell.get('error'))}", file=sys.stderr,
              flush=True)
    same = max(planned["fp32"], default=min(hiddens))  # the largest fp32 serves: the model all formats serve
    out["same_hidden"] = same
    small = save_model(same, layers, vocab)
    for name, (m, g) in FORMATS.items():
        if out["largest"].get(name, {}).get("hidden") == same:
            out["same_model"][name] = out["largest"][name]
            continue
        out["same_model"][name] = _serve(small, m, g, limit=limit, batch=batch, new_tokens=new_tokens,
                                         threads=threads, timeout=600.0)
    return out


def markdown(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"With the disk tier under a memory cap: not measured ({r['skipped']})."
    budgets = ", ".join(f"{n} {b / MiB:.0f} MiB" for n, b in r["budget_bytes"].items())
    lines = [f"With the disk tier under a {r['limit_bytes'] / GiB:.2f} GiB cgroup limit (served with no weights "
             f"budget: the serving planner fits each process under the limit; candidates are the widths whose "
             f"weights the pool planner fits in {budgets}, the quantized ones less torchao's imports; "
             f"{r['layers']} layers, vocab {r['vocab']}, widths "
             f"{', '.join(map(str, r['hiddens']))}; batch {r['batch']}, {r['new_tokens']} tokens, {r['threads']} "
             "compute thread(s)):", "",
             "| format | largest that serves | its fp32 checkpoint | tokens/s | peak | disk bytes / step | same model "
             f"(width {r['same_hidden']}) tokens/s, disk bytes / step |", "|---|---|---|---|---|---|---|"]
    for name, cell in r["largest"].items():
        same = r["same_model"].get(name, {})
        pool = cell.get("pool", {})
        lines.append(
            f"| {name} | width {cell.get('hidden', '-')} | {cell.get('weight_bytes', 0) / GiB:.2f} GiB | "
            f"{cell.get('tokens_per_s', float('nan')):.2f} | {(cell.get('peak_bytes') or 0) / MiB:.0f} MiB | "
            f"{pool.get('disk_bytes_per_step', 0) / MiB:.1f} MiB | {same.get('tokens_per_s', float('nan')):.2f}, "
            f"{same.get('pool', {}).get('disk_bytes_per_step', 0) / MiB:.1f} MiB |"
            + (f" {cell['error']}" if "error" in cell else ""))
    for name, cell in r["largest"].items():
        first = cell.get("first_load") or {}
        if first and not first.get("capped"):
            peak = (first.get("peak_bytes") or 0) / GiB
            lines.append(f"\n{name}: the first load (quantize, write the store) did not fit the cap "
                         f"({(first.get('capped_error') or '')[:60]}...); uncapped it peaked at {peak:.2f} GiB "
                         "(page cache included); the measured run reused the store under the cap.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    r = disk_case(quick)
    print(json.dumps(r, indent=1, default=str))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
