"""``tightfit serve PATH`` / ``python -m energon_infer.serve PATH``: start an engine and its HTTP server.

    tightfit serve path/to/hf-dir --tp 2 --port 8000
    tightfit serve runs/elixir_demo/last.ckpt             # a tightfit GPT training checkpoint
    torchrun --nnodes 2 --nproc-per-node 8 ... -m energon_infer.serve DIR --tp 8 --pp 2 --launcher torchrun
    ENERGON_API_KEY=secret tightfit serve path/to/hf-dir --host 0.0.0.0

``PATH`` is a Hugging Face directory (``config.json`` + ``*.safetensors``) or a training
checkpoint file of the tightfit example GPT (Lightning ``.ckpt``, ``state_dict`` file,
``.safetensors``). Ctrl-C (or SIGTERM) stops accepting connections, lets in-flight requests finish
for up to ``--drain-timeout`` seconds, then stops the workers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tightfit.cli import Parser
from tightfit.commands.args import UsageError, exit_codes_help, nonnegative_int, positive_int

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tightfit serve", description="Serve a model over an OpenAI-compatible HTTP API.",
               epilog=(__doc__ or "").replace("``", "") + "\n" + exit_codes_help())  # plain text, not reST
    p.add_argument("path", help="Hugging Face model directory, or a tightfit GPT checkpoint file")
    m = p.add_argument_group("model layout")
    m.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel workers per stage (default 1)")
    m.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default 1)")
    m.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    m.add_argument("--kv-cache-tokens", type=positive_int, default=32768, help="KV cache capacity in tokens per worker")
    m.add_argument("--memory-pool", default=None,
                   help="pool layers' weights outside the device: a fraction of layers (0.5) or a device budget (2GiB)")
    m.add_argument("--heads", type=int, default=None, help="attention heads, for a GPT checkpoint that does not say")
    b = p.add_argument_group("batching and faults")
    b.add_argument("--max-batch-tokens", type=positive_int, default=4096, help="tokens per batched step (default 4096)")
    b.add_argument("--max-running", type=positive_int, default=256, help="requests in the running batch at most")
    b.add_argument("--max-queue", type=positive_int, default=1024, help="waiting requests at most; more get HTTP 429")
    b.add_argument("--max-restarts", type=nonnegative_int, default=3, help="worker group restarts after failures (default 3)")
    b.add_argument("--no-restart", action="store_true", help="do not restart the workers after a failure")
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
    s.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on shutdown")
    s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    return p


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
    from energon_infer.engine import Engine
    from energon_infer.server import ServerConfig, serve

    path = Path(args.path)
    if not path.exists():
        print(f"tightfit serve: {path} does not exist; give a Hugging Face model directory or a GPT checkpoint file",
              file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tightfit serve: warning: binding {args.host} without --api-key lets anyone who can reach this "
              "machine use the model", file=sys.stderr)
    server_cfg = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                              default_max_tokens=min(16, args.max_tokens_limit), drain_timeout_s=args.drain_timeout,
                              log_level=args.log_level)
    common = dict(tp=args.tp, pp=args.pp, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
                  memory_pool=_memory_pool(args.memory_pool), model_name=args.served_model_name,
                  kv_cache_tokens=args.kv_cache_tokens, max_running=args.max_running, max_queue=args.max_queue,
                  max_restarts=args.max_restarts, restart_workers=not args.no_restart, launcher=args.launcher)
    if path.is_dir():
        engine = Engine.from_pretrained(path, **common)
    else:
        engine = Engine.from_lightning_checkpoint(path, heads=args.heads, **common)
    w = engine.worker_info[0]
    print(f"energon: serving {engine.model_name!r} ({w['config']['model_type']}, context {engine.max_context}) on "
          f"tp={args.tp} x pp={args.pp} at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    serve(engine, server_cfg, owns_engine=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
