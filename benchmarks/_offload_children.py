"""The contenders of ``benchmarks.energon_offload``, each run in its own process under a cgroup v1 memory limit.

    python -m benchmarks._offload_children SPEC.json     # prints one "OFFLOAD_RESULT {json}" line

The parent (``benchmarks.energon_offload``) writes a spec (contender, model directory, prompts, new tokens,
threads, options), drops the page cache, and starts this module in a fresh memory cgroup: the energon engine
with the project's venv, the transformers + accelerate and llama.cpp peers with ``.venv-offload``'s python
(where ``benchmarks.common`` and this file import with the standard library only: every heavy import is inside
the runner that needs it). Every runner reports the same fields: greedy token ids per prompt, seconds from
submission to the first token of the batch (TTFT) and to the last, seconds to load, and the bytes the
process tree read from the block device during the decode steps (``/proc/<pid>/io`` ``read_bytes``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._child_sources import tag
from benchmarks.common import left_padded
from benchmarks.proc_tree import descendants

RESULT_TAG = "OFFLOAD_RESULT "


def _tree_read_bytes() -> int:
    """``read_bytes`` (from the block device) of this process and every live descendant."""
    total = 0
    for pid in descendants(os.getpid()) or []:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # exited while we read
    return total


# ---------------------------------------------------------------------------- energon


def run_energon(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine; each prompt set of ``spec["prompt_sets"]`` (or ``spec["prompts"]``) generated in turn."""
    from energon_infer.engine.engine import Engine
    from energon_infer.sampling import SamplingParams

    if spec.get("whole_layers"):  # energon_moe's baseline: the plan energon made before placing experts singly
        import energon_infer.engine.expert_plan as expert_plan

        expert_plan.place_experts = lambda *args, **kwargs: None
    pool = None
    if spec.get("pool"):
        from energon_infer.worker.memory_pool import MemoryPoolConfig

        pool = MemoryPoolConfig(**spec["pool"])
    n = spec["new_tokens"]
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(spec["model"], memory_pool=pool, progress=False,
                                    threads_per_worker=spec["threads"], **spec.get("options", {}))
    load_s = time.perf_counter() - t0
    runs = []
    try:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        for prompts in spec.get("prompt_sets") or [spec["prompts"]]:
            if pool is not None or spec.get("planned"):
                engine.memory_report()  # the report below covers this set only
            read0 = _tree_read_bytes()
            start = time.monotonic()
            done = engine.generate(prompts, params)
            end = time.monotonic()
            read1 = _tree_read_bytes()
            first = min(c.first_token for c in done if c.first_token)
            runs.append({"tokens": [list(c.token_ids) for c in done], "ttft_s": first - start, "seconds": end - start,
                         "load_s": load_s, "read_bytes": read1 - read0,
                         "pool": _pool_info(engine, pool is not None or bool(spec.get("planned")))})
    finally:
        engine.shutdown()
    return runs[0] if "prompt_sets" not in spec else {"runs": runs}


def _pool_info(engine: Any, pooled: bool) -> dict[str, Any]:
    """The engine's own memory report (tiers of the layers, disk reads, bytes streamed per step, its roofline)."""
    if not pooled:
        return {"weight_bytes": engine.worker_info[0].weight_bytes}
    rep = engine.memory_report()
    rank = rep["ranks"][0]
    tiers = rank.get("tiers", {})
    out = {k: rep[k] for k in ("steps", "mean_batch", "tokens_per_s", "io_seconds_per_step", "disk_bytes_per_step",
                               "io_roofline_tokens_per_s", "roofline_fraction") if k in rep}
    out.update({k: v for k, v in rank.items() if k != "tiers" and isinstance(v, (int, float, str))})
    out["tiers"] = {str(k): str(v) for k, v in tiers.items()}
    out["disk_layers"] = sorted(int(k) for k, v in tiers.items() if "disk" in str(v).lower())
    return json.loads(json.dumps(out, default=str))


# ---------------------------------------------------------------------------- transformers + accelerate


def run_accelerate(spec: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained(device_map="auto", max_memory={"cpu": budget}, offload_folder=...)``: the layers beyond the
    budget are offloaded to disk (read in place from the safetensors files), then one batched ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, device_map="auto", max_memory={"cpu": spec["cpu_budget"]},
        offload_folder=spec["offload_folder"], offload_state_dict=True)
    load_s = time.perf_counter() - t0
    devices = sorted({str(v) for v in getattr(model, "hf_device_map", {}).values()})

    class Stamp(LogitsProcessor):
        """Records when each step's logits arrive (after the step's forward): the first is the TTFT."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.monotonic())
            return scores

    prompts, n = spec["prompts"], spec["new_tokens"]
    ids, mask = left_padded(prompts)
    stamp = Stamp()
    read0 = _tree_read_bytes()
    start = time.monotonic()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList([stamp]))
    end = time.monotonic()
    read1 = _tree_read_bytes()
    return {"tokens": out[:, ids.shape[1]:].tolist(), "ttft_s": stamp.times[0] - start, "seconds": end - start,
            "load_s": load_s, "read_bytes": read1 - read0, "devices": devices}


# ---------------------------------------------------------------------------- llama.cpp


def run_llamacpp(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp (``llama-cpp-python``'s C API bindings, as its ``batched`` example drives it): the GGUF ``mmap``ed
    (its default: the kernel pages the weights in and out under the limit), one sequence id per prompt, every
    prompt decoded in one ``llama_decode`` batch, then one token per sequence per step, greedy (argmax of the logits)."""
    import ctypes

    import llama_cpp as ll
    import numpy as np

    prompts, n = spec["prompts"], spec["new_tokens"]
    ll.llama_backend_init()
    t0 = time.perf_counter()
    mparams = ll.llama_model_default_params()
    mparams.use_mmap = True
    model = ll.llama_model_load_from_file(spec["gguf"].encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['gguf']}")
    cparams = ll.llama_context_default_params()
    per_seq = max(len(p) for p in prompts) + n + 8
    cparams.n_ctx = per_seq * len(prompts)
    cparams.n_batch = max(cparams.n_ctx, 512)
    cparams.n_ubatch = min(cparams.n_batch, 2048)
    cparams.n_seq_max = len(prompts)
    cparams.n_threads = cparams.n_threads_batch = spec["threads"]
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    load_s = time.perf_counter() - t0
    batch = ll.llama_batch_init(cparams.n_batch, 0, len(prompts))

    def fill(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want

    def argmax(i: int) -> int:
        ptr = ll.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (vocab,))))

    out: list[list[int]] = [[] for _ in prompts]
    read0 = _tree_read_bytes()
    start = time.monotonic()
    items, last = [], []
    for s, p in enumerate(prompts):
        items += [(tok, pos, s, pos == len(p) - 1) for pos, tok in enumerate(p)]
        last.append(len(items) - 1)
    fill(items)
    if ll.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed on the prompts")
    for s in range(len(prompts)):
        out[s].append(argmax(last[s]))
    first = time.monotonic()
    for step in range(1, n):
        fill([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed at step {step}")
        for s in range(len(prompts)):
            out[s].append(argmax(s))
    end = time.monotonic()
    read1 = _tree_read_bytes()
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return {"tokens": out, "ttft_s": first - start, "seconds": end - start, "load_s": load_s,
            "read_bytes": read1 - read0}


RUNNERS = {"energon": run_energon, "accelerate": run_accelerate, "llamacpp": run_llamacpp}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out = RUNNERS[spec["runner"]](spec)
    print(RESULT_TAG + json.dumps(tag(out)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
