"""``tightfit serve PATH`` / ``python -m energon_infer.serve PATH``: start an engine and its HTTP server.

    tightfit serve path/to/hf-dir --tp 2 --port 8000
    tightfit serve runs/elixir_demo/last.ckpt             # a tightfit GPT training checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m energon_infer.serve DIR --tp 8 --pp 2 --launcher torchrun
    ENERGON_API_KEY=secret tightfit serve path/to/hf-dir --host 0.0.0.0

``PATH`` is a Hugging Face directory (``config.json`` + ``*.safetensors``) or a training
checkpoint file of the tightfit example GPT (Lightning ``.ckpt``, ``state_dict`` file,
``.safetensors``). The port is bound before the model loads, so a busy port fails at once. Ctrl-C
(or SIGTERM) stops accepting connections, lets in-flight requests finish for up to
``--drain-timeout`` seconds (a stream still running then ends with an error event), then stops the
workers. ``--step-timeout`` is the watchdog: a step without an answer for that long marks the
worker group hung (``/health`` answers 503), fails its requests and restarts it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tightfit serve", description="Serve a model over an OpenAI-compatible HTTP API.",
               epilog=(__doc__ or "").replace("``", "") + "\n" + exit_codes_help())  # plain text, not reST
    p.add_argument("path", help="Hugging Face model directory, or a tightfit GPT checkpoint file")
    m = p.add_argument_group("model layout")
    m.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel workers per stage (default 1)")
    m.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default 1)")
    m.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, float16, or auto: the dtype config.json names (default float32)")
    m.add_argument("--kv-cache-tokens", type=positive_int, default=32768, help="KV cache capacity in tokens per worker")
    m.add_argument("--memory-pool", default=None,
                   help="pool layers' weights outside the device: a fraction of layers (0.5) or a device budget (2GiB)")
    m.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps eagerly (on a GPU at tp=1 they are replayed from CUDA graphs by default)")
    m.add_argument("--no-packed-weights", action="store_true",
                   help="keep one copy of the weights on a CPU (by default the projections also keep a oneDNN-packed "
                        "copy, which decodes faster)")
    m.add_argument("--heads", type=int, default=None, help="attention heads, for a GPT checkpoint that does not say")
    b = p.add_argument_group("batching and faults")
    b.add_argument("--max-batch-tokens", type=positive_int, default=4096, help="tokens per batched step (default 4096)")
    b.add_argument("--max-running", type=positive_int, default=256, help="requests in the running batch at most")
    b.add_argument("--max-queue", type=positive_int, default=1024, help="waiting requests at most; more get HTTP 429")
    b.add_argument("--max-restarts", type=nonnegative_int, default=3,
                   help="worker group restarts allowed within --restart-window (default 3)")
    b.add_argument("--restart-window", type=positive_float, default=3600.0,
                   help="seconds over which --max-restarts counts (default 3600); older failures are forgiven")
    b.add_argument("--no-restart", action="store_true", help="do not restart the workers after a failure")
    b.add_argument("--step-timeout", type=positive_float, default=300.0,
                   help="seconds a step may take before the worker group counts as hung and restarts (default 300)")
    b.add_argument("--launcher", choices=("spawn", "torchrun"), default="spawn",
                   help="spawn: start tp*pp local workers (default); torchrun: every torchrun rank runs this command, "
                        "rank 0 serves HTTP and the others are workers (multi-node)")
    s = p.add_argument_group("HTTP")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    s.add_argument("--api-key", default=os.environ.get("ENERGON_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $ENERGON_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="the model id clients use (default: the path's name)")
    s.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    s.add_argument("--max-n", type=int, default=16, help="largest n (choices per prompt) a request may ask for")
    s.add_argument("--drain-timeout", type=nonnegative_float, default=30.0, help="seconds in-flight requests get on shutdown")
    s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    return p


def bind_socket(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """Bind ``host:port`` now (before a model loads for minutes), so a busy port fails at once.

    Raises ``OSError`` naming the address and the fix.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port} ({exc.strerror}); another server probably uses "
                                 "it: stop it or pick another --port") from None
    sock.set_inheritable(True)
    return sock


def _memory_pool(value: str | None) -> float | str | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value  # a byte budget such as "2GiB"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:  # one line naming the value, the rule and the fix; exit code 2
        print(e, file=sys.stderr)
        return 2
    if args.launcher == "torchrun" and int(os.environ.get("RANK", "0")) != 0:
        from energon_infer.torchrun import run_worker

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
    from energon_infer.engine import Engine
    from energon_infer.hf_files import resolve_dtype
    from energon_infer.server import ServerConfig, serve

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tightfit serve: warning: binding {args.host} without --api-key lets anyone who can reach this "
              "machine use the model", file=sys.stderr)
    try:
        server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                  max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                                  default_max_tokens=min(16, args.max_tokens_limit), max_n=args.max_n,
                                  drain_timeout_s=args.drain_timeout, log_level=args.log_level)
        dtype = resolve_dtype(path, args.dtype) if path.is_dir() else ("float32" if args.dtype == "auto" else args.dtype)
    except ValueError as exc:
        sock.close()
        print(f"tightfit serve: {exc}", file=sys.stderr)
        return 2
    common = dict(tp=args.tp, pp=args.pp, dtype=dtype, max_batch_tokens=args.max_batch_tokens,
                  memory_pool=_memory_pool(args.memory_pool), model_name=args.served_model_name,
                  kv_cache_tokens=args.kv_cache_tokens, max_running=args.max_running, max_queue=args.max_queue,
                  max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                  restart_workers=not args.no_restart, launcher=args.launcher,
                  step_timeout_s=args.step_timeout, cuda_graphs=False if args.no_cuda_graphs else None,
                  packed_weights=not args.no_packed_weights)
    try:
        if path.is_dir():
            engine = Engine.from_pretrained(path, **common)
        else:
            engine = Engine.from_lightning_checkpoint(path, heads=args.heads, **common)
    except BaseException:
        sock.close()
        raise
    w = engine.worker_info[0]
    print(f"energon: serving {engine.model_name!r} ({w['config']['model_type']}, {dtype}, context "
          f"{engine.max_context}) on tp={args.tp} x pp={args.pp} at http://{args.host}:{args.port}/v1 "
          f"(Ctrl-C to stop)", file=sys.stderr, flush=True)
    if engine.tokenizer is None:
        print("energon: warning: this model has no tokenizer (no tokenizer.json), so only token-id prompts work: "
              "/v1/completions with \"prompt\": [ids...]; text prompts and /v1/chat/completions get 400",
              file=sys.stderr, flush=True)
    serve(engine, server_cfg, owns_engine=True, sock=sock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
