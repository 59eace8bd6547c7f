"""``tightfit serve PATH`` / ``python -m energon_infer.serving.serve PATH``: start an engine and its HTTP server.

    tightfit serve path/to/hf-dir --tp 2 --port 8000
    tightfit serve runs/elixir_demo/last.ckpt             # a tightfit GPT training checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m energon_infer.serving.serve DIR --tp 8 --pp 2 --launcher torchrun
    ENERGON_API_KEY=secret tightfit serve path/to/hf-dir --host 0.0.0.0

``PATH`` is a Hugging Face directory (``config.json`` + ``*.safetensors``) or a training
checkpoint file of the tightfit example GPT (Lightning ``.ckpt``, ``state_dict`` file,
``.safetensors``). The port is bound before the model loads, so a busy port fails at once. Ctrl-C
(or SIGTERM) stops accepting connections, lets in-flight requests finish for up to
``--drain-timeout`` seconds (a stream still running then ends with an error event), then stops the
workers and exits 0, or 128 + the signal (143 for SIGTERM, 130 for Ctrl-C) where requests were cut
short. ``--step-timeout`` is the watchdog: a step without an answer for that long marks the
worker group hung (``/health`` answers 503), fails its requests and restarts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, get_args

from tightfit.cli import Parser
from tightfit.commands.args import (
    UsageError,
    exit_codes_help,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)

__all__ = ["build_parser", "main", "bind_socket"]


def _defaults(kind: type) -> dict[str, Any]:
    """A config class's defaults: the one place each flag's default comes from (``--help`` shows it)."""
    return {f.name: f.default for f in dataclasses.fields(kind) if f.default is not dataclasses.MISSING}


def _memory_flags(m: Any) -> None:
    """The flags that pool or stream weights beyond the device (:func:`_memory_pool` reads them)."""
    m.add_argument("--memory-pool", default=None,
                   help="pool layers' weights outside the device: a fraction of layers (0.5) or a device budget (2GiB)")
    m.add_argument("--memory-budget", default=None,
                   help="serve beyond memory: bytes each worker's weights may hold in memory (2GiB), checked against "
                        "the memory limit; the layers that do not fit are read from the model directory's safetensors "
                        "files on every pass. Omitted on a CPU: the plan fits the whole process under the memory limit "
                        "(cgroup or machine) and streams layers from disk only where they do not fit")
    m.add_argument("--host-budget", default=None,
                   help="with --memory-budget on a GPU: host bytes for pooled layers and staging (default: what is free)")
    m.add_argument("--quantized-dir", default=None,
                   help="with --quantization and --memory-budget: where the quantized layers read from disk are "
                        "written once (default: .tightfit-quantized beside the model, or the cache directory)")
    m.add_argument("--lookahead", type=nonnegative_int, default=None,
                   help="pooled layers fetched ahead of the one running (default 2; on a CPU the most: the plan "
                        "fetches fewer where memory is short)")


def _batching_flags(b: Any, sched: dict[str, Any], faults: dict[str, Any], launch: dict[str, Any]) -> None:
    from energon_infer.engine.engine_config import Launcher

    b.add_argument("--max-batch-tokens", type=positive_int, default=sched["max_batch_tokens"],
                   help="tokens per batched step (when not given, on a CPU: at most this, fewer where memory is short)")
    b.add_argument("--token-budget", choices=("fixed", "measured"), default=sched["token_budget"],
                   help="fixed: each step may hold --max-batch-tokens; measured: the running decodes plus the prefill "
                        "their TPOT target leaves room for at the measured cost per token")
    b.add_argument("--tpot-target", type=float, default=sched["tpot_target_s"],
                   help="with --token-budget measured: seconds a decode step may grow to with prefill (0: twice the "
                        "decode-only step)")
    b.add_argument("--max-running", type=positive_int, default=sched["max_running"],
                   help="requests in the running batch at most")
    b.add_argument("--max-queue", type=positive_int, default=sched["max_queue"],
                   help="waiting requests at most; more get HTTP 429")
    b.add_argument("--max-restarts", type=nonnegative_int, default=faults["max_restarts"],
                   help="worker group restarts allowed within --restart-window")
    b.add_argument("--restart-window", type=positive_float, default=faults["restart_window_s"],
                   help="seconds over which --max-restarts counts; older failures are forgiven")
    b.add_argument("--no-restart", action="store_true", help="do not restart the workers after a failure")
    b.add_argument("--step-timeout", type=positive_float, default=faults["step_timeout_s"],
                   help="seconds a step may take before the worker group counts as hung and restarts")
    b.add_argument("--launcher", choices=get_args(Launcher), default=launch["launcher"],
                   help="spawn: start tp*pp local workers; torchrun: every torchrun rank runs this command, "
                        "rank 0 serves HTTP and the others are workers (multi-node)")


def build_parser() -> argparse.ArgumentParser:
    from energon_infer.engine.engine_config import FaultConfig, LaunchConfig
    from energon_infer.loading.backend import MODEL_IMPLS
    from energon_infer.scheduling.scheduler_config import SchedulerConfig
    from energon_infer.serving.server_config import TOOL_CALL_PARSERS, ServerConfig
    from energon_infer.worker.runtime_config import RuntimeConfig

    rt, sched, faults = _defaults(RuntimeConfig), _defaults(SchedulerConfig), _defaults(FaultConfig)
    launch, http = _defaults(LaunchConfig), _defaults(ServerConfig)
    p = Parser(prog="tightfit serve", description="Serve a model over an OpenAI-compatible HTTP API.",
               epilog=(__doc__ or "").replace("``", "") + "\n" + exit_codes_help())  # plain text, not reST
    p.add_argument("path", help="Hugging Face model directory, or a tightfit GPT checkpoint file")
    m = p.add_argument_group("model layout")
    m.add_argument("--tp", type=positive_int, default=rt["tp"], help="tensor-parallel workers per stage")
    m.add_argument("--pp", type=positive_int, default=rt["pp"], help="pipeline stages")
    m.add_argument("--dtype", default=rt["dtype"],
                   help="auto: the dtype config.json names where this device computes in it natively, else float32 "
                        "(the choice is printed at start); or float32, bfloat16, float16")
    m.add_argument("--model-impl", choices=MODEL_IMPLS, default=rt["model_impl"],
                   help="auto: a native family where one reads the checkpoint, else transformers' modeling code (the "
                        "choice and why are printed at start); native: refuse instead of falling back; transformers: "
                        "transformers' modeling code even for a native family")
    m.add_argument("--kv-cache-tokens", type=positive_int, default=rt["kv_cache_tokens"],
                   help="KV cache capacity in tokens per worker (when not given, on a CPU: at most this, what the "
                        "memory limit leaves)")
    _memory_flags(p.add_argument_group("memory beyond the device"))
    m.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly (on a GPU at tp=1 they are replayed from CUDA graphs by default)")
    m.add_argument("--no-packed-weights", action="store_true",
                   help="keep one copy of the weights on a CPU (by default the projections also keep a oneDNN-packed "
                        "copy, which decodes faster; the serving plan turns it off where only that fits the memory "
                        "limit)")
    m.add_argument("--quantization", choices=("int8", "int4"), default=None,
                   help="hold the block projections' weights quantized with torchao: int8 (one scale per row) or int4 "
                        "(a scale and zero per group); needs torchao installed")
    m.add_argument("--group-size", type=positive_int, default=None,
                   help="with --quantization int4: inputs per group (32, 64, 128 or 256; default 128)")
    m.add_argument("--speculative", default=None, metavar="ngram|DRAFT_DIR",
                   help="speculative decoding: 'ngram' (prompt lookup: outputs that copy from the prompt) or a draft "
                        "model's directory (a small model with the same tokenizer); several tokens checked per step")
    m.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                   help="with --speculative: tokens a request proposes per step at most (default 4; fewer are "
                        "chosen where the measured step costs or acceptance say more would not pay)")
    m.add_argument("--heads", type=int, default=None, help="attention heads, for a GPT checkpoint that does not say")
    _batching_flags(p.add_argument_group("batching and faults"), sched, faults, launch)
    s = p.add_argument_group("HTTP")
    s.add_argument("--host", default=http["host"], help="address to bind (127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=http["port"], help="TCP port to listen on")
    s.add_argument("--api-key", default=os.environ.get("ENERGON_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $ENERGON_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the path's name)")
    s.add_argument("--max-tokens-limit", type=int, default=http["max_tokens_limit"],
                   help="largest max_tokens a request may ask for")
    s.add_argument("--max-request-bytes", type=int, default=http["max_request_bytes"], help="largest request body")
    s.add_argument("--max-n", type=int, default=http["max_n"], help="largest n (choices per prompt) a request may ask for")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the format the model writes tool calls in (default: the one its chat template writes)")
    s.add_argument("--drain-timeout", type=nonnegative_float, default=http["drain_timeout_s"],
                   help="seconds in-flight requests get on shutdown")
    # The command logs each request (info); ServerConfig's own "warning" keeps in-process servers (tests) quiet.
    s.add_argument("--log-level", default="info", help="uvicorn log level")
    return p


def bind_socket(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """Bind ``host:port`` now (before a model loads for minutes), so a busy port fails at once.

    Raises ``OSError`` naming the address and the fix.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto says TCP.
    # With Nagle on, a keep-alive connection's small writes wait for the client's delayed ACK on every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Linux hands it on to accepted connections
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port} ({exc.strerror}); another server probably uses "
                                 "it: stop it or pick another --port") from None
    sock.set_inheritable(True)
    return sock


def _speculative(method: str | None, k: int | None) -> dict[str, Any]:
    """``--speculative`` / ``--num-speculative-tokens`` as the engine's ``speculative=`` keyword (none: off)."""
    if method is None:
        if k is not None:
            raise ValueError(f"--num-speculative-tokens {k} needs --speculative ngram or --speculative DRAFT_DIR")
        return {}
    from energon_infer.scheduling.speculation import SpeculativeConfig

    draft = None if method == "ngram" else method
    return {"speculative": SpeculativeConfig(method="ngram" if draft is None else "draft", draft_model=draft,
                                             num_speculative_tokens=k or 4)}


def _memory_pool(value: str | None, memory_budget: str | None = None, host_budget: str | None = None,
                 lookahead: int | None = None, *, quantized_dir: str | None = None) -> Any:
    """``--memory-pool`` / ``--memory-budget`` as a :class:`~energon_infer.worker.memory_pool.MemoryPoolConfig`
    (checked now, before any worker)."""
    if value is None and memory_budget is None:
        if host_budget is not None:
            raise ValueError(f"--host-budget {host_budget} needs --memory-budget (the tiered pool it sizes)")
        return None
    from energon_infer.worker.memory_pool import MemoryPoolConfig

    extra: dict[str, Any] = {} if lookahead is None else {"lookahead": lookahead}
    if memory_budget is not None:
        if value is not None:
            raise ValueError("give --memory-pool (a host pool) or --memory-budget (device, host and disk), not both")
        return MemoryPoolConfig(memory_budget=memory_budget, host_budget=host_budget, quantized_dir=quantized_dir,
                                **extra)
    assert value is not None
    try:
        fraction = float(value)
    except ValueError:
        return MemoryPoolConfig(device_budget=value, **extra)  # a byte budget such as "2GiB"
    return MemoryPoolConfig(fraction=fraction, **extra)


def main(argv: list[str] | None = None) -> int:
    """``tightfit serve ARGV``: 0 after a clean stop (143 / 130 where SIGTERM / Ctrl-C cut requests short); 2 and
    one line for bad input (a flag, a file, a model or layout energon refuses: an
    :class:`~energon_infer.errors.EnergonError`); 3 and one line where no plan fits the memory; anything else is a
    bug in energon: its traceback, and 1."""
    from energon_infer.errors import EnergonError
    from tightfit.planner.errors import PlanInfeasibleError

    try:
        return _serve(argv)
    except UsageError as e:  # one line naming the value, the rule and the fix; exit code 2
        print(e, file=sys.stderr)
        return 2
    except EnergonError as e:
        print(f"tightfit serve: {e}", file=sys.stderr)
        return 2
    except PlanInfeasibleError as e:  # no plan fits the memory: one line with what it needs and the cheapest change
        print(f"tightfit serve: {e}", file=sys.stderr)
        return 3
    except Exception:  # noqa: BLE001 - a bug: show where, and say it is not the user's input
        traceback.print_exc()
        print("tightfit serve: failed with the error above (a bug in energon, not in the input: please report it)",
              file=sys.stderr)
        return 1


def _serve(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.launcher == "torchrun" and int(os.environ.get("RANK", "0")) != 0:
        from energon_infer.worker.torchrun import run_worker

        run_worker()  # until rank 0's server shuts down
        return 0
    path = Path(args.path)
    if not path.exists():
        print(f"tightfit serve: {path} does not exist; give a Hugging Face model directory or a GPT checkpoint file",
              file=sys.stderr)
        return 2
    try:  # first, before torch and the model load (minutes for a large one): a busy port should fail now
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"tightfit serve: {exc.strerror}", file=sys.stderr)
        return 2
    from energon_infer.engine.engine import Engine
    from energon_infer.serving.server import serve
    from energon_infer.serving.server_config import ServerConfig

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tightfit serve: warning: binding {args.host} without --api-key lets anyone who can reach this "
              "machine use the model", file=sys.stderr)
    try:
        server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                  max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                                  default_max_tokens=min(_defaults(ServerConfig)["default_max_tokens"], args.max_tokens_limit), max_n=args.max_n,
                                  drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                                  tool_call_parser=args.tool_call_parser)
        # "auto" is resolved (and the choice stated) by the engine; a Lightning checkpoint is float32
        dtype = args.dtype if path.is_dir() or args.dtype != "auto" else "float32"
        pool = _memory_pool(args.memory_pool, args.memory_budget, args.host_budget, args.lookahead,
                            quantized_dir=args.quantized_dir)
        spec = _speculative(args.speculative, args.num_speculative_tokens)
    except ValueError as exc:  # the values of these flags were checked by their own classes
        sock.close()
        print(f"tightfit serve: {exc}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else argv
    # Left out unless given: on a CPU the serving plan chooses them within the memory limit (engine/memory_plan.py).
    chosen = {name: value for name, flag, value in (("max_batch_tokens", "--max-batch-tokens", args.max_batch_tokens),
                                                    ("kv_cache_tokens", "--kv-cache-tokens", args.kv_cache_tokens))
              if any(a == flag or a.startswith(flag + "=") for a in argv)}
    common = dict(tp=args.tp, pp=args.pp, dtype=dtype, model_impl=args.model_impl, **chosen,
                  memory_pool=pool, model_name=args.served_model_name,
                  max_running=args.max_running, max_queue=args.max_queue, token_budget=args.token_budget,
                  tpot_target_s=args.tpot_target,
                  max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                  restart_workers=not args.no_restart, launcher=args.launcher,
                  step_timeout_s=args.step_timeout, cuda_graphs=False if args.no_cuda_graphs else None,
                  **({"packed_weights": False} if args.no_packed_weights else {}), quantization=args.quantization,
                  group_size=args.group_size, **spec)
    try:
        if path.is_dir():
            engine = Engine.from_pretrained(path, **common)
        else:
            engine = Engine.from_lightning_checkpoint(path, heads=args.heads, **common)
    except BaseException:
        sock.close()
        raise
    w = engine.worker_info[0]
    rt = engine.config.runtime
    print(f"energon: serving {engine.model_name!r} ({w['config']['model_type']}, {rt.dtype}, context "
          f"{engine.max_context}) on tp={args.tp} x pp={args.pp} at http://{args.host}:{args.port}/v1 "
          f"(Ctrl-C to stop)", file=sys.stderr, flush=True)
    if engine.memory_plan is not None and engine.memory_plan.streams:  # what the memory holds, and what streams
        print(engine.explain(), file=sys.stderr, flush=True)
    if engine.tokenizer is None:
        print("energon: warning: this model has no tokenizer (no tokenizer.json), so only token-id prompts work: "
              "/v1/completions with \"prompt\": [ids...]; text prompts and /v1/chat/completions get 400",
              file=sys.stderr, flush=True)
    return serve(engine, server_cfg, owns_engine=True, sock=sock)


if __name__ == "__main__":
    raise SystemExit(main())
