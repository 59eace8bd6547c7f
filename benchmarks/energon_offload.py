"""energon_infer serving a model larger than its memory limit (the disk tier) against transformers + accelerate
disk offload and llama.cpp under the same hard limit, with the all-in-RAM engine as the ceiling.

    python -m benchmarks.energon_offload --prepare-only   # once: .venv-offload (accelerate, llama-cpp-python build)
    python -m benchmarks.energon_offload [--quick] [--limit 1.25GiB] [--batches 1,8,32,64] [--render JSON]
    python -m benchmarks.energon_offload --batches 8 --contenders "energon (limit);llama.cpp mmap (limit)"
                                                          # one batch, llama.cpp beside energon (a few minutes)

Question: with fp32 weights at least 3x the cgroup memory limit of the serving process, how many
tokens/s does each contender sustain on offline batches of 1, 8, 32 and 64 sequences, how far is that from the
I/O roofline (batch x measured disk bandwidth / bytes streamed per decode step), and does anyone get killed?

Defaults: 3.77 GiB of fp32 weights (hidden 1536, 41 layers, 12 heads, 2 key/value heads, vocabulary 4096) under
a 1.25 GiB limit (3.0x; below about 1.1 GiB energon's two processes do not fit beside its smallest plan: see the
report), 4 greedy tokens. ``--quick`` (``make bench``): the same model, batch 32 only, 3 tokens, energon under the
limit against transformers + accelerate only (greedy tokens checked against transformers'); the peers' venv is
not built by a benchmark run (``--prepare-only`` builds it; without it the peers are reported as not run).

Setup: a random LLaMA (``LlamaForCausalLM`` from its config, ``save_pretrained`` as safetensors; kept under
``/tmp/energon-disk-bench/models`` between runs, keyed by its shape). Every (batch, contender) cell is one fresh
process started inside its own cgroup v1 memory group (hard limit; ``memory.max_usage_in_bytes`` is the peak,
``memory.oom_control`` says whether the OOM killer fired), after ``sync; echo 3 > /proc/sys/vm/drop_caches`` so
nothing is read from a page cache another contender filled. The order of the contenders rotates from batch to
batch. Contenders, each with all the cores (2 threads), greedy, prompts of 4-12 random tokens drawn fresh for each
batch and repeat (the same for every contender of that batch and repeat, so a repeat's cells pair up: ratios are
paired, ``benchmarks/README.md``):

* **energon (limit)**: ``Engine.from_pretrained(dir, memory_pool=MemoryPoolConfig(...))`` with the host budget
  below the limit: the plan keeps some layers in host memory and reads the others from the model's own
  safetensors files each step.
* **transformers + accelerate (limit)**: ``from_pretrained(device_map="auto", max_memory={"cpu": budget},
  offload_folder=...)`` (layers beyond the budget on "disk"), one batched, left-padded ``generate``
  (``.venv-offload``: torch, transformers, accelerate).
* **llama.cpp (limit)**: ``llama-cpp-python`` (built from source in ``.venv-offload``), the model converted to a
  GGUF f32 file by llama.cpp's own ``convert_hf_to_gguf.py`` (the random model has no tokenizer: the
  conversion is given a placeholder vocabulary of the model's size), ``mmap``ed as llama.cpp does by default,
  all sequences in one batch per step (its ``batched`` example's loop).
* **energon all in RAM (no limit)**: the ceiling; measured in a group without a limit (for its peak).

Reported per cell: tokens/s (generated tokens / seconds from submission to the last token), decode tokens/s
(batch x (new tokens - 1) / seconds after the first token), fraction of the I/O roofline (decode tokens/s over
batch x disk bandwidth / bytes the plan streams per step), time to first token, peak memory of the group, OOM
kills, and the bytes the process tree read from the disk per decode step (``/proc/<pid>/io``). Greedy tokens of
energon under the limit are compared with energon all in RAM (must be equal) and with the peers (agreement).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _offload_report as report
from benchmarks._child_sources import collect
from benchmarks._offload_children import RESULT_TAG
from benchmarks._offload_report import ACCEL, ENERGON, ENERGON_RAM, LLAMA, NAME, GiB, MiB
from benchmarks.common import parser, write_result
from benchmarks.memlimit import drop_page_cache, limit_unavailable, run_limited

TITLE = "energon_infer beyond memory: weights streamed from the checkpoint's files under a hard memory limit"
ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-offload"
WORK = Path("/tmp/energon-disk-bench")
LLAMA_CPP_VERSION = "0.3.36"

__all__ = ["prepare_peers", "save_model", "to_gguf", "disk_bandwidth", "main"]


# ---------------------------------------------------------------------------- preparation (cached)


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


# llama-cpp-python's own dependencies, installed beside it: its build is installed with --force-reinstall
# --no-deps (a rebuild replaces it alone, not numpy and the rest), and without diskcache `import llama_cpp` fails.
LLAMA_DEPS = ("diskcache>=5.6.1", "jinja2>=2.11.3", "typing-extensions>=4.5.0")


def prepare_peers(install: bool = True) -> dict[str, str]:
    """``.venv-offload`` with transformers + accelerate and llama-cpp-python; ``{peer: why it cannot run}``."""
    py = PEER_VENV / "bin" / "python"
    why: dict[str, str] = {}
    probe = "import accelerate, transformers, torch"
    if _run([str(py), "-c", probe]).returncode != 0 if py.exists() else True:
        if not install:
            return {ACCEL: f"{PEER_VENV} missing (run python -m benchmarks.energon_offload --prepare-only)",
                    LLAMA: f"{PEER_VENV} missing"}
        steps = [[sys.executable, "-m", "venv", str(PEER_VENV)],
                 [str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "transformers==5.24.0", "accelerate",
                  "numpy", "safetensors", "sentencepiece"]]
        for cmd in steps:
            done = _run(cmd)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                return {ACCEL: f"`{' '.join(cmd[-3:])}` failed: {tail}", LLAMA: "no peer venv"}
    cmake_args = llama_cmake_args()
    stamp = PEER_VENV / "llama-cpp-build.txt"  # the CMAKE_ARGS of the build in the venv: another build is redone
    built = _run([str(py), "-c", "import llama_cpp"]).returncode == 0
    if not built and install and stamp.exists() and stamp.read_text() == cmake_args:
        # Built with these flags, but its Python dependencies missing (it is installed --no-deps): add them.
        _run([str(py), "-m", "pip", "install", "-q", *LLAMA_DEPS])
        built = _run([str(py), "-c", "import llama_cpp"]).returncode == 0
    if not built or not stamp.exists() or stamp.read_text() != cmake_args:
        if not install:
            why[LLAMA] = ("llama-cpp-python is not built in .venv-offload, or was built with other flags "
                          "(run --prepare-only)")
        else:
            src = _llama_sdist()
            env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2", CMAKE_ARGS=cmake_args)
            _run([str(py), "-m", "pip", "install", "-q", *LLAMA_DEPS])
            done = _run(["nice", "-n", "10", str(py), "-m", "pip", "install", "-q", "--force-reinstall",
                         "--no-deps", "--no-cache-dir", str(src)], env=env)
            if done.returncode != 0:
                why[LLAMA] = ("llama-cpp-python did not build: "
                              f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            else:
                stamp.write_text(cmake_args)
    return why


def llama_cmake_args(cpuinfo: str | None = None) -> str:
    """llama.cpp's build flags for this CPU: native, except its AMX kernels where the CPU has AMX.

    On this project's Xeon VMs (amx_int8 in /proc/cpuinfo) a native build runs its AMX matmul
    (``ggml_backend_amx_mul_mat``) and dies with SIGSEGV on the first ``llama_decode`` of a Q8_0 or Q4_0 model,
    every run; without AMX it keeps AVX-512 VNNI, its fastest kernels that run here."""
    if cpuinfo is None:
        from tightfit.kernels.native import (
            _cpu_flags,  # the flags line the native kernels' cache key is made of
        )

        cpuinfo = _cpu_flags()
    args = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
    if "amx_int8" in cpuinfo.split():
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        args += f" -DCMAKE_C_FLAGS='{no_amx}' -DCMAKE_CXX_FLAGS='{no_amx}'"
    return args


def _llama_sdist() -> Path:
    """llama-cpp-python's source archive (pip downloads it once): the build, and llama.cpp's converter."""
    where = PEER_VENV / "src"
    archive = where / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not archive.exists():
        where.mkdir(parents=True, exist_ok=True)
        _run([str(PEER_VENV / "bin" / "python"), "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "-d", str(where), f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)
    tree = where / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if not (tree / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        _run(["tar", "xzf", str(archive), "-C", str(where)], check=True)
    return archive


def save_model(hidden: int, layers: int, vocab: int) -> Path:
    """The random LLaMA directory (fp32 safetensors), made once per shape in a subprocess (its 3 GiB freed).

    Heads of 128, two key/value heads (grouped-query attention, as LLaMA-3 class models have): the KV cache of
    64 sequences stays a small part of the limit, so the weights are what does not fit."""
    path = WORK / "models" / f"llama-h{hidden}-l{layers}-v{vocab}-kv2"
    if (path / "done").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    code = ("import sys, torch; from transformers import LlamaConfig, LlamaForCausalLM; torch.manual_seed(0); "
            f"cfg = LlamaConfig(hidden_size={hidden}, num_hidden_layers={layers}, num_attention_heads={hidden // 128}, "
            f"num_key_value_heads=2, intermediate_size={hidden * 8 // 3 // 32 * 32}, vocab_size={vocab}, "
            "max_position_embeddings=512, tie_word_embeddings=False); "
            "LlamaForCausalLM._from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[1])")
    _run([sys.executable, "-c", code, str(path)], check=True, cwd=ROOT)
    (path / "done").write_text("")
    return path


# Runs in .venv-offload: llama.cpp's own converter, with one change: the random model has no tokenizer, so
# LlamaModel.set_vocab writes a placeholder SentencePiece-style vocabulary of the model's size (token i is "<i>").
_CONVERT = r"""
import sys
from pathlib import Path
vendor = Path(sys.argv[1])
sys.path[:0] = [str(vendor), str(vendor / "gguf-py")]
import gguf
from conversion import llama

def set_vocab(self):
    n = self.hparams["vocab_size"]
    w = self.gguf_writer
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL for i in range(n)])
    w.add_unk_token_id(0); w.add_bos_token_id(1); w.add_eos_token_id(2)
    w.add_add_bos_token(False)

llama.LlamaModel.set_vocab = set_vocab
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", sys.argv[2], "--outtype", "f32", "--outfile", sys.argv[3]]
convert_hf_to_gguf.main()
"""


def to_gguf(model: Path, convert: str = _CONVERT) -> tuple[Path | None, str]:
    """The model as GGUF f32 (llama.cpp's converter, run by ``convert``; cached beside the model); ``(path, "")`` or
    ``(None, why)``."""
    out = model / "model-f32.gguf"
    if out.exists():
        return out, ""
    vendor = PEER_VENV / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if not (vendor / "convert_hf_to_gguf.py").exists():
        return None, f"llama.cpp's converter is not at {vendor} (run --prepare-only)"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "convert.py"
        script.write_text(convert)
        part = out.with_suffix(".part")
        done = _run([str(PEER_VENV / "bin" / "python"), str(script), str(vendor), str(model), str(part)])
        if done.returncode != 0:
            return None, f"GGUF conversion failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
        part.replace(out)
    return out, ""


def disk_bandwidth(model: Path, nbytes: int, readers: int) -> float:
    """Bytes/s of ``readers`` threads reading the largest safetensors file with O_DIRECT, 4 MiB requests (what
    ``dd iflag=direct`` measures with one), each its own part of the first ``nbytes``, after dropping the page cache."""
    import mmap
    import threading

    from benchmarks.disk_io import RAW_REQUEST

    f = max(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    part = min(nbytes, f.stat().st_size) // readers // RAW_REQUEST * RAW_REQUEST
    bufs = [mmap.mmap(-1, RAW_REQUEST) for _ in range(readers)]
    fd = os.open(f, os.O_RDONLY | os.O_DIRECT)

    def read(k: int) -> None:
        for off in range(k * part, (k + 1) * part, RAW_REQUEST):
            os.preadv(fd, [bufs[k]], off)

    try:
        drop_page_cache()
        threads = [threading.Thread(target=read, args=(k,)) for k in range(readers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return part * readers / (time.perf_counter() - start)
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


# ---------------------------------------------------------------------------- one cell


def _spec(contender: str, model: Path, gguf: Path | None, prompts: list[list[int]], new_tokens: int,
          limit: int, budget: int, threads: int, lookahead: int = 2) -> tuple[str, dict[str, Any]]:
    """``(python to run, spec)`` of one contender's process."""
    base = {"model": str(model), "prompts": prompts, "new_tokens": new_tokens, "threads": threads}
    tokens = max((len(p) for p in prompts), default=12) + new_tokens
    # KV blocks of 16 tokens: what the batch needs and a few spare (the cache is allocated whole, inside the limit).
    opts = {"kv_cache_tokens": max(512, len(prompts) * -(-tokens // 16) * 16 + 256), "max_batch_tokens": 2048,
            "max_running": max(64, len(prompts))}
    if contender == ENERGON_RAM:
        return sys.executable, {**base, "runner": "energon", "options": opts}
    if contender == ENERGON:  # one core for the disk reads, as energon's README advises on a CPU
        return sys.executable, {**base, "runner": "energon", "options": opts, "pool": _energon_pool(budget, lookahead),
                                "threads": max(1, threads - 1)}
    if contender == ACCEL:
        return accelerate_spec(base, budget)
    return str(PEER_VENV / "bin" / "python"), {**base, "runner": "llamacpp", "gguf": str(gguf)}


def accelerate_spec(base: dict[str, Any], budget: int, python: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(python to run, spec)`` of transformers + accelerate's process (``_offload_children.run_accelerate``):
    ``device_map="auto"`` under ``budget`` bytes of host memory, the rest offloaded to a fresh folder. ``base``:
    model, prompts, new_tokens, threads; ``python``: one with transformers and accelerate (default .venv-offload's)."""
    folder = WORK / "accelerate-offload"
    shutil.rmtree(folder, ignore_errors=True)
    return python or str(PEER_VENV / "bin" / "python"), {**base, "runner": "accelerate", "cpu_budget": budget,
                                                         "offload_folder": str(folder)}


def _energon_pool(budget: int, lookahead: int = 2) -> dict[str, Any]:
    """The MemoryPoolConfig keywords that put the model under ``budget`` bytes of host memory (the disk tier).

    Two layers ahead (three slots), not one: with one, a single layer's reads are in flight, and the disk idles
    while its I/O thread copies each tensor into the slot (input-major), about a fifth of the time; the third
    slot costs one layer that would otherwise stay in memory (2.5% more bytes streamed per step here)."""
    return {"memory_budget": budget, "lookahead": lookahead}


def run_cell(contender: str, python: str, spec: dict[str, Any], limit: int | None, timeout_s: float) -> dict[str, Any]:
    """One contender on one batch, in a fresh cgroup, after dropping the page cache."""
    note = "" if drop_page_cache() else "could not drop the page cache (not root?)"
    with tempfile.TemporaryDirectory(prefix="energon-offload-") as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), PYTHONPATH=str(ROOT))
        run = run_limited([python, "-m", "benchmarks._offload_children", str(path)], limit if limit else 2**62,
                          name="energon-offload", env=env, cwd=ROOT, timeout=timeout_s)
    rc, out, err, wall = run.returncode, run.stdout, run.stderr, run.wall_seconds
    peak, kills = run.peak_bytes, int(run.oom_killed)
    cell: dict[str, Any] = {"rc": rc, "peak_bytes": peak, "oom_kills": kills, "process_s": wall,
                            "limit_bytes": limit, "cache_note": note}
    line = next((x for x in out.splitlines() if x.startswith(RESULT_TAG)), None)
    if rc == 0 and line:
        cell.update(json.loads(line[len(RESULT_TAG):]))
    else:
        tail = [x for x in err.strip().splitlines() if x.strip()][-3:]
        cell["error"] = ("killed by the OOM killer" if kills else f"exit {rc}") + ": " + " | ".join(tail)[-400:]
    return cell


def _derive(cell: dict[str, Any], batch: int, new_tokens: int, bw: float, streamed: float | None) -> None:
    """tokens/s, decode tokens/s, bytes read per decode step and the fraction of the I/O roofline."""
    if "tokens" not in cell:
        return
    generated = sum(len(t) for t in cell["tokens"])
    cell["tokens_per_s"] = generated / cell["seconds"]
    decode_s = cell["seconds"] - cell["ttft_s"]
    cell["decode_tokens_per_s"] = batch * (new_tokens - 1) / decode_s if decode_s > 0 else None
    cell["read_bytes_per_step"] = cell["read_bytes"] / new_tokens  # prompts' step included
    if streamed:
        roof = batch * bw / streamed
        cell["roofline_tokens_per_s"] = roof
        cell["roofline_fraction"] = (cell["decode_tokens_per_s"] or 0.0) / roof


# ---------------------------------------------------------------------------- the run


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(1000 * seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))] for _ in range(batch)]


def _streamed_bytes(cells: dict[str, Any]) -> tuple[float | None, str]:
    """Bytes energon streams from disk per step: its plan's figure where the worker reports one, else what its
    process tree read from the disk per step in that cell."""
    e = cells.get(ENERGON, {})
    pool = e.get("pool") or {}
    for key in ("disk_bytes_per_pass",):
        if pool.get(key):
            return float(pool[key]), f"plan ({key})"
    if e.get("read_bytes_per_step"):
        return float(e["read_bytes_per_step"]), "measured (read_bytes per step)"
    return None, "unknown"


def _agreement(cell: dict[str, Any], ref: dict[str, Any]) -> float | None:
    if "tokens" not in cell or "tokens" not in ref:
        return None
    return sum(a == b for a, b in zip(cell["tokens"], ref["tokens"])) / len(ref["tokens"])


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--limit", default=None, help="the cgroup memory limit (default 1GiB; --quick 512MiB)")
    p.add_argument("--budget", default=None, help="host bytes energon and accelerate may plan for (default: limit "
                                                  "- 896MiB: the processes themselves (interpreter, torch, the worker), KV cache and page cache)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32,64; --quick 1,32)")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--contenders", default=None, help=f"comma-separated subset of: {ENERGON}; {ACCEL}; {LLAMA}; "
                                                      f"{ENERGON_RAM} (separated by ';')")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--lookahead", type=int, default=2, help="energon's layers read ahead (slots = lookahead + 1; 2, "
                                                          "MemoryPoolConfig's default: two layers' reads in flight)")
    p.add_argument("--llama-max-batch", type=int, default=32, help="llama.cpp only up to this batch")
    p.add_argument("--render", type=Path, default=None, help="recompute the derived figures and the report section "
                                                                "of a results JSON (its measurements untouched)")
    p.add_argument("--prepare-only", action="store_true", help="build the peers' venv, the model and its GGUF, then stop")
    args = p.parse_args(argv)
    if args.render:
        return render(args.render)
    from tightfit.units import parse_bytes

    quick = args.quick
    hidden, layers, vocab = 1536, 41, 4096
    hidden, layers = args.hidden or hidden, args.layers or layers
    limit = parse_bytes(args.limit or "1.25GiB")
    budget = parse_bytes(args.budget) if args.budget else max(limit - 896 * MiB, 64 * MiB)
    batches = [int(b) for b in (args.batches or ("32" if quick else "1,8,32,64")).split(",")]
    new_tokens = args.new_tokens or (3 if quick else 4)
    repeats = args.repeats or 1
    threads = os.cpu_count() or 1
    skipped: dict[str, str] = {}
    why = limit_unavailable()
    if why:
        print(f"energon_offload: {why}; no hard limit, nothing to measure", file=sys.stderr)
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    print("[offload] peers' venv (.venv-offload), the model, its GGUF", file=sys.stderr, flush=True)
    skipped.update(prepare_peers(install=args.prepare_only))
    model = save_model(hidden, layers, vocab)
    weight_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    gguf = None
    wants_llama = not quick and (not args.contenders or LLAMA in args.contenders.split(";"))
    if LLAMA not in skipped and (wants_llama or args.prepare_only):
        gguf, why = to_gguf(model)
        if gguf is None:
            skipped[LLAMA] = why
    if args.prepare_only:
        print(f"model {model} ({weight_bytes / GiB:.2f} GiB), gguf {gguf}, skipped {skipped}")
        return 0
    contenders = [c for c in (ENERGON, ACCEL, LLAMA, ENERGON_RAM) if c not in skipped]
    if args.contenders or quick:  # --quick: energon under the limit and the peer it must beat 3x, batch 32
        chosen = (args.contenders or f"{ENERGON};{ACCEL}").split(";")
        contenders = [c for c in contenders if c in chosen]
    span = 1 * GiB if not quick else 512 * MiB
    bandwidths = {f"before, {k} reader(s)": disk_bandwidth(model, span, k) for k in (1, 2)}
    print(f"[offload] {weight_bytes / GiB:.2f} GiB of weights, limit {limit / GiB:.2f} GiB, budget "
          f"{budget / MiB:.0f} MiB, disk " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in bandwidths.items()),
          file=sys.stderr, flush=True)
    results: dict[str, Any] = {"weight_bytes": weight_bytes, "limit_bytes": limit, "budget_bytes": budget,
                               "skipped": skipped, "batches": {}}
    timeout = 150.0 if quick else 200.0
    params = {"quick": quick, "hidden": hidden, "layers": layers, "vocab": vocab, "limit_bytes": limit,
              "budget_bytes": budget, "batches": batches, "new_tokens": new_tokens, "repeats": repeats,
              "threads": threads, "contenders": contenders, "cell_timeout_s": timeout,
              "llama_max_batch": args.llama_max_batch, "lookahead": args.lookahead}
    cells_of = {r: {b: {} for b in batches} for r in range(repeats)}
    prompts = {(r, b): _prompts(b, vocab, r) for r in range(repeats) for b in batches}
    disk_bound = [c for c in contenders if c != ENERGON_RAM]
    for r in range(repeats):
        for i, batch in enumerate(batches):
            order = disk_bound[i % len(disk_bound):] + disk_bound[:i % len(disk_bound)] if disk_bound else []
            cells = cells_of[r][batch]
            for c in order:
                if c == LLAMA and batch > args.llama_max_batch:
                    skipped[f"{LLAMA}, batch {batch}"] = (f"left out above batch {args.llama_max_batch} (--llama-max-batch): "
                                                          "it did not finish within the cell's time at 32 here")
                    continue
                py, spec = _spec(c, model, gguf, prompts[r, batch], new_tokens, limit, budget, threads, args.lookahead)
                cells[c] = run_cell(c, py, spec, limit, timeout)
                _partial(params, results, bandwidths, cells_of, prompts)
                got = cells[c]
                print(f"  batch {batch} {c}: " + (f"{got['seconds']:.1f} s, TTFT {got['ttft_s']:.1f} s, peak "
                      f"{got['peak_bytes'] / MiB:.0f} MiB" if "seconds" in got else got["error"]),
                      file=sys.stderr, flush=True)
    if ENERGON_RAM in contenders:  # the ceiling, last: one process, loaded once, every batch in turn (not disk-bound)
        py, spec = _spec(ENERGON_RAM, model, gguf, [], new_tokens, limit, budget, threads)
        spec["prompt_sets"] = [prompts[key] for key in prompts]
        spec["options"]["kv_cache_tokens"] = max(512, max(batches) * (12 + new_tokens + 16))
        spec["options"]["max_running"] = max(64, max(batches))
        ram = run_cell(ENERGON_RAM, py, spec, None, timeout * 2)
        print(f"  {ENERGON_RAM}: peak {ram['peak_bytes'] / MiB:.0f} MiB {ram.get('error', '')}", file=sys.stderr)
        for key, run in zip(prompts, ram.pop("runs", [{}] * len(prompts))):
            cells_of[key[0]][key[1]][ENERGON_RAM] = {**ram, **run, "peak_note": "one process for every batch"}
        _partial(params, results, bandwidths, cells_of, prompts)
    bandwidths.update({f"after, {k} reader(s)": disk_bandwidth(model, span, k) for k in (1, 2)})
    bw = max(bandwidths.values())
    results.update(disk_bytes_per_s=bw, disk_bandwidths=bandwidths)
    for r in range(repeats):
        for batch in batches:
            results["batches"].setdefault(str(batch), []).append({"prompts": prompts[r, batch],
                                                                  "cells": cells_of[r][batch]})
    _finish(results, new_tokens)
    md = report.markdown(results, hidden, layers, vocab, new_tokens, threads, repeats)
    print(md)
    groups: dict[str, list[dict[str, Any]]] = {}  # a contender's cells run the same code
    for by_batch in cells_of.values():
        for cells in by_batch.values():
            for contender, cell in cells.items():
                groups.setdefault(contender, []).append(cell)
    measures = collect(groups.values(), fallback=("benchmarks/_offload_children.py", "core", "plugins/energon_infer"))
    write_result(NAME, title=TITLE, params={**params, "commit": _commit()}, results=results, markdown=md,
                 plots=report.plot(results), measures=measures)
    return 0


def _partial(params: dict[str, Any], results: dict[str, Any], bandwidths: dict[str, float],
             cells_of: dict[int, dict[int, dict[str, Any]]], prompts: dict[tuple[int, int], list[list[int]]]) -> None:
    """Every cell measured so far, as ``WORK/energon_offload.partial.json`` (``--render`` takes it), so a run cut
    short keeps what it measured."""
    res = {**results, "disk_bytes_per_s": max(bandwidths.values()), "disk_bandwidths": bandwidths, "batches": {
        str(b): [{"prompts": prompts[r, b], "cells": cells_of[r][b]}] for r in cells_of for b in cells_of[r]}}
    (WORK / "energon_offload.partial.json").write_text(json.dumps({"params": params, "results": res}, default=str))


def _finish(results: dict[str, Any], new_tokens: int) -> None:
    """The derived figures of every cell: tokens/s, roofline fraction, agreement with the reference's tokens."""
    bw = results["disk_bytes_per_s"]
    for batch, runs in results["batches"].items():
        for run in runs:
            cells = run["cells"]
            streamed, source = _streamed_bytes(cells)
            run.update(streamed_bytes_per_step=streamed, streamed_source=source)
            ref = ENERGON_RAM if ENERGON_RAM in cells else ACCEL  # --quick: transformers is the reference
            for c, cell in cells.items():
                _derive(cell, int(batch), new_tokens, bw, streamed if c != ENERGON_RAM else None)
                cell["same_as_ram"] = _agreement(cell, cells.get(ref, {})) if c != ref else None
                cell["reference"] = ref


def render(path: Path) -> int:
    """Rewrite ``path``'s derived figures and Markdown from its measurements (after a change to this report code)."""
    data = json.loads(path.read_text())
    pr, res = data["params"], data["results"]
    _finish(res, pr["new_tokens"])
    data["markdown"] = report.markdown(res, pr["hidden"], pr["layers"], pr["vocab"], pr["new_tokens"], pr["threads"],
                                 pr["repeats"])
    path.write_text(json.dumps(data, indent=2, default=str))
    print(data["markdown"])
    return 0


def _commit() -> str:
    done = _run(["git", "rev-parse", "HEAD"], cwd=ROOT)
    dirty = _run(["git", "status", "--porcelain", "--", "plugins/energon_infer", "benchmarks"], cwd=ROOT).stdout
    return done.stdout.strip() + (" (uncommitted changes)" if dirty.strip() else "")


if __name__ == "__main__":
    raise SystemExit(main())
