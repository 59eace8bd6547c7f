"""The engine: one controller in your process drives a ``tp x pp`` worker group (EnergonAI's hierarchy).

You program against :class:`Engine` as if the model were one serial object; behind it the
controller thread batches requests step by step (:mod:`energon_infer.scheduler`), sends each step
to the worker processes (:mod:`energon_infer.workers`), which run the tensor/pipeline-parallel
runtime SPMD, and hands the sampled tokens back to futures, token listeners and async streams.

    with Engine.from_pretrained("path/to/hf-dir", tp=2, max_batch_tokens=4096) as engine:
        outs = engine.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=16))
        fut = engine.submit("Once upon a time", SamplingParams(max_tokens=32))     # -> Future[Completion]
        async for event in engine.stream("Tell me", SamplingParams(max_tokens=8)):  # in async code
            print(event.text, end="")

With ``pp > 1`` as many steps as there are stages are in flight (one per group of requests), so
the first stage already runs the next group while the last one samples (the non-blocking
pipeline); :meth:`Engine.pipeline_stats` reports each stage's measured utilisation.

Faults: a worker that dies (or a step that outlives ``step_timeout_s``) fails the requests that
were running with :class:`WorkerFailedError`; waiting requests are kept; the group is restarted
(up to ``max_restarts`` times) and serving goes on. No request is dropped without its future or
stream receiving a result or an error.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import queue
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from energon_infer.memory_pool import MemoryPoolConfig
from energon_infer.metrics import EngineMetrics
from energon_infer.runtime import RuntimeConfig
from energon_infer.sampling import SamplingParams
from energon_infer.scheduler import QueueFullError, Request, Scheduler, SchedulerConfig, StepPlan
from energon_infer.workers import ModelSource, WorkerGroup

__all__ = ["Engine", "EngineConfig", "Completion", "TokenEvent", "WorkerFailedError", "EngineClosedError",
           "QueueFullError"]


class WorkerFailedError(RuntimeError):
    """The worker group failed while this request ran (a worker died or a step hung)."""


class EngineClosedError(RuntimeError):
    """The engine is shut down (or has no workers left) and takes no more requests."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How the controller batches and how it treats failures.

    Args:
        max_batch_tokens: tokens per step (one per running request plus each admitted prompt).
        max_running: sequences in the running batch at most.
        max_queue: waiting requests at most; ``submit`` raises :class:`QueueFullError` beyond.
        pipeline_groups: steps in flight at once (0: one per pipeline stage, the non-blocking pipeline; 1: each
            step waits for the previous one).
        policy: ``"continuous"`` or ``"static"`` batching (see :mod:`energon_infer.scheduler`).
        restart_workers: restart the worker group after a failure.
        max_restarts: restarts allowed over the engine's life; after that the engine fails closed.
        step_timeout_s: a step without an answer after this long counts as a hung worker group.
        start_timeout_s: how long loading may take.
        threads_per_worker: intra-op threads of each worker (0: CPU cores / workers).
        backend: ``"gloo"`` or ``"nccl"`` (``None``: NCCL with CUDA, else gloo).
        launcher: ``"spawn"`` (start ``tp * pp`` local worker processes) or ``"torchrun"`` (join the world
            torchrun started, on one or many nodes; this process must be rank 0, the others call
            :func:`energon_infer.torchrun.run_worker`; no restarts).
    """

    max_batch_tokens: int = 4096
    max_running: int = 256
    max_queue: int = 1024
    pipeline_groups: int = 0
    policy: str = "continuous"
    restart_workers: bool = True
    max_restarts: int = 3
    step_timeout_s: float = 300.0
    start_timeout_s: float = 600.0
    threads_per_worker: int = 0
    backend: str | None = None
    launcher: str = "spawn"

    def __post_init__(self) -> None:
        if self.pipeline_groups < 0 or self.max_restarts < 0 or self.threads_per_worker < 0:
            raise ValueError(f"pipeline_groups={self.pipeline_groups}, max_restarts={self.max_restarts} and "
                             f"threads_per_worker={self.threads_per_worker} must be >= 0")
        if self.step_timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError(f"step_timeout_s={self.step_timeout_s} and start_timeout_s={self.start_timeout_s} must be > 0")
        if self.launcher not in ("spawn", "torchrun"):
            raise ValueError(f"launcher={self.launcher!r} must be 'spawn' (local worker processes) or 'torchrun'")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend={self.backend!r} must be 'gloo', 'nccl' or None (automatic)")


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request: tokens, text, why it stopped, and its timings (``time.monotonic`` seconds)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop", "length" or "abort"
    arrival: float
    first_token: float
    finished: float

    @property
    def latency_s(self) -> float:
        return self.finished - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return self.first_token - self.arrival if self.first_token else None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token of a request as it is generated (``text``: the new text since the previous event).

    The last event of a request has ``finish_reason`` set and carries the :class:`Completion`
    (or ``error``, when the request failed).
    """

    request_id: str
    token_id: int | None
    text: str
    finish_reason: str | None = None
    completion: Completion | None = None
    error: BaseException | None = None


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_RUNTIME_FIELDS = {f.name for f in dataclasses.fields(RuntimeConfig)}


def _pool_config(memory_pool: Any) -> MemoryPoolConfig | None:
    if memory_pool is None or memory_pool is False or memory_pool == 0:
        return None
    if isinstance(memory_pool, MemoryPoolConfig):
        return memory_pool
    if isinstance(memory_pool, (int, float)) and not isinstance(memory_pool, bool):
        return MemoryPoolConfig(fraction=float(memory_pool))
    if isinstance(memory_pool, str):
        return MemoryPoolConfig(device_budget=memory_pool)
    if isinstance(memory_pool, dict):
        return MemoryPoolConfig(**memory_pool)
    raise TypeError(f"memory_pool={memory_pool!r}: give a fraction of layers (0.5), a device budget ('2GiB'), "
                    "a MemoryPoolConfig, or None")


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier, so it runs later): stop the
    # controllers and workers in order instead of leaving exit to terminate and join them.
    for engine in list(_LIVE):
        engine.shutdown(cancel=True, timeout=10)


class Engine:
    """The single controller (see the module docstring). Build it with :meth:`from_pretrained` or
    :meth:`from_lightning_checkpoint`.

    Args:
        source: what the workers load.
        runtime: layout and cache of every worker (``tp``, ``pp``, ``dtype``, ``kv_cache_tokens``...).
        config: batching and fault handling.
        memory_pool: peer memory pooling of each stage's layers (``None``: off).
        tokenizer: turns text prompts into ids and ids into text (``None``: token-id prompts only).
        model_name: the name the HTTP server reports.

    Example:
        >>> with Engine.from_pretrained(model_dir, tp=2) as engine:              # doctest: +SKIP
        ...     print(engine.generate(["Hello"])[0].text)
    """

    def __init__(self, source: ModelSource, runtime: RuntimeConfig, config: EngineConfig | None = None, *,
                 memory_pool: Any = None, tokenizer: Any = None, model_name: str | None = None):
        self.source, self.runtime = source, runtime
        self.config = config or EngineConfig()
        self.memory_pool = _pool_config(memory_pool)
        self.tokenizer = tokenizer
        self.model_name = model_name or Path(source.path).name
        self.metrics = EngineMetrics(model_name=self.model_name)
        self.groups = self.config.pipeline_groups or runtime.pp
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._live: dict[str, Request] = {}
        self._inflight: dict[int, StepPlan] = {}
        self._stats: dict[int, dict[str, float]] = {}
        self._stats_ready = threading.Condition(self._lock)
        self._closing = self._stop_now = False
        self.status = "starting"
        self.last_error = ""
        self._group = self._start_group()
        info = self._group.info
        self.worker_info = info
        cfg = info[0]["config"]
        self.vocab_size, self.max_context = int(cfg["vocab_size"]), int(cfg["max_positions"])
        self.eos_token_ids = tuple(info[0]["eos_token_ids"])
        if self.tokenizer is None and source.kind == "tightfit_gpt" and self.vocab_size == 256:
            from energon_infer.gpt_checkpoint import ByteTokenizer

            self.tokenizer = ByteTokenizer()
        self.scheduler = Scheduler(
            SchedulerConfig(kv_blocks=int(info[0]["kv_blocks"]), block_size=int(info[0]["block_size"]),
                            max_context=self.max_context, max_batch_tokens=self.config.max_batch_tokens,
                            max_running=self.config.max_running, max_queue=self.config.max_queue, groups=self.groups,
                            policy=self.config.policy),
            eos_token_ids=self.eos_token_ids, decode=self.decode if self.tokenizer is not None else None)
        self.status = "ready"
        self._thread = threading.Thread(target=self._run, name="energon-controller", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        unknown = sorted(set(kwargs) - _ENGINE_FIELDS - _RUNTIME_FIELDS)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; the engine takes EngineConfig fields "
                            f"{sorted(_ENGINE_FIELDS)} and RuntimeConfig fields {sorted(_RUNTIME_FIELDS)}")
        return ({k: v for k, v in kwargs.items() if k in _ENGINE_FIELDS},
                {k: v for k, v in kwargs.items() if k in _RUNTIME_FIELDS})

    @classmethod
    def _build(cls, source: ModelSource, tp: int, pp: int, dtype: str, max_batch_tokens: int, memory_pool: Any,
               tokenizer: Any, model_name: str | None, kwargs: dict[str, Any]) -> Engine:
        engine_kw, runtime_kw = cls._split(kwargs)
        engine_cfg = EngineConfig(max_batch_tokens=max_batch_tokens, **engine_kw)
        groups = engine_cfg.pipeline_groups or pp
        # The engine keeps pp steps in flight itself; splitting each step again only shrinks the matmuls.
        runtime_kw.setdefault("microbatches", 1 if groups > 1 else 0)
        runtime = RuntimeConfig(tp=tp, pp=pp, dtype=dtype, max_batch_tokens=max_batch_tokens, **runtime_kw)
        return cls(source, runtime, engine_cfg, memory_pool=memory_pool, tokenizer=tokenizer, model_name=model_name)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, tp: int = 1, pp: int = 1, dtype: str = "float32",
                        max_batch_tokens: int = 4096, memory_pool: Any = None, tokenizer: Any = None,
                        model_name: str | None = None, **kwargs: Any) -> Engine:
        """Start ``tp * pp`` workers on a Hugging Face directory (``config.json`` + ``*.safetensors``).

        ``kwargs`` are :class:`EngineConfig` fields (``max_queue=64``) and :class:`RuntimeConfig` fields
        (``kv_cache_tokens=8192``). The directory's ``tokenizer.json`` is used when there is one.
        """
        from energon_infer.config import load_config
        from energon_infer.model import check_tp
        from energon_infer.parallel import split_layers

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist; give a directory saved with "
                                    "save_pretrained (config.json + *.safetensors)")
        # Fail here, in the caller's process, before any worker is spawned.
        model = load_config(path)
        check_tp(model, tp)
        split_layers(model.n_layers, pp)
        if tokenizer is None and (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls._build(ModelSource("pretrained", str(path)), tp, pp, dtype, max_batch_tokens, memory_pool,
                          tokenizer, model_name, kwargs)

    @classmethod
    def from_lightning_checkpoint(cls, path: str | Path, *, tp: int = 1, pp: int = 1, dtype: str = "float32",
                                  max_batch_tokens: int = 4096, memory_pool: Any = None, gpt_config: Any = None,
                                  heads: int | None = None, tokenizer: Any = None, model_name: str | None = None,
                                  **kwargs: Any) -> Engine:
        """Serve the tightfit example GPT from a training checkpoint (Lightning ``.ckpt``, ``state_dict``
        file or ``.safetensors``), e.g. the one ``strategy="elixir"`` trained. A 256-token vocabulary gets
        the byte tokenizer. ``gpt_config``/``heads``: see :func:`energon_infer.gpt_checkpoint.load_tightfit_gpt`;
        a ``.safetensors`` file with a GPTConfig ``config.json`` beside it (what the Elixir example exports)
        needs neither.
        """
        path = Path(path)
        if not path.is_file():
            hint = (" (a directory: a sharded checkpoint? export it first with `python -m lightning_elixir.export "
                    f"{path}`)") if path.is_dir() else ""
            raise FileNotFoundError(f"checkpoint {path} is not a file{hint}; give a Lightning .ckpt, a torch.save'd "
                                    "state_dict, or a .safetensors file")
        beside = path.parent / "config.json"
        if gpt_config is None and heads is None and path.suffix == ".safetensors" and beside.is_file():
            # The Elixir example writes its GPTConfig as config.json next to the exported weights.
            import json

            from tightfit.models.gpt import GPTConfig

            raw = json.loads(beside.read_text())
            if "model_type" not in raw:  # not a Hugging Face config
                gpt_config = GPTConfig.from_dict(raw)
        options = {k: v for k, v in (("gpt_config", gpt_config), ("heads", heads)) if v is not None}
        return cls._build(ModelSource("tightfit_gpt", str(path), options), tp, pp, dtype, max_batch_tokens,
                          memory_pool, tokenizer, model_name or path.stem, kwargs)

    def _start_group(self) -> Any:
        if self.config.launcher == "torchrun":
            from energon_infer.torchrun import TorchrunWorkerGroup

            tgroup = TorchrunWorkerGroup(self.source, self.runtime, pool=self.memory_pool)
            tgroup.start(self.config.start_timeout_s)
            return tgroup
        group = WorkerGroup(self.source, self.runtime, pool=self.memory_pool, threads=self.config.threads_per_worker,
                            backend=self.config.backend)
        if self.runtime.progress:
            print(f"energon: starting {group.world} worker(s) ({group.backend}, tp={self.runtime.tp} x "
                  f"pp={self.runtime.pp}) for {self.source.path}", file=sys.stderr, flush=True)
        group.start(self.config.start_timeout_s, cancelled=lambda: self._stop_now)
        return group

    # ------------------------------------------------------------------ tokens

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer, so prompts must be token ids; put tokenizer.json in "
                                 "the model directory or pass tokenizer=...")
            return list(self.tokenizer.encode(prompt).ids)
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer; read token_ids instead of text")
        return self.tokenizer.decode(list(token_ids))

    # ------------------------------------------------------------------ requests

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, listener: Callable[[TokenEvent], None] | None = None,
               block: bool = False, timeout: float | None = None) -> Future[Completion]:
        """Queue a request; the future resolves to its :class:`Completion` (or raises why it failed).

        ``listener`` is called from the controller thread with a :class:`TokenEvent` per token. With
        ``block=True`` a full queue waits (up to ``timeout``) instead of raising :class:`QueueFullError`.
        Cancelling the future aborts the request.
        """
        ids = self.encode(prompt)
        req = Request(request_id or uuid.uuid4().hex, ids, params or SamplingParams(), listener)
        fut: Future[Completion] = Future()
        req.future = fut
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_open()
            if req.request_id in self._live:
                raise ValueError(f"request id {req.request_id!r} is already running; use a unique id")
            while True:
                try:
                    self.scheduler.add(req)
                    break
                except QueueFullError:
                    left = None if deadline is None else deadline - time.monotonic()
                    if not block or (left is not None and left <= 0):
                        self.metrics.record_rejected()
                        raise
                    self._space.wait(0.5 if left is None else min(left, 0.5))
                    self._check_open()
            self._live[req.request_id] = req
            wake = self.scheduler.in_flight < self.groups
        self.metrics.record_submitted(len(ids))
        fut.add_done_callback(lambda f: f.cancelled() and self.abort(req.request_id))
        if wake:
            self._wake()
        return fut

    def _check_open(self) -> None:
        if self._closing:
            raise EngineClosedError("the engine is shut down; start a new one to serve more requests")
        if self.status == "failed":
            raise EngineClosedError(f"the engine has no workers ({self.last_error}); start a new engine")

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt (continuously batched with whatever else is running); results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        futures = [self.submit(p, sp, block=True) for p, sp in zip(prompts, plist)]
        return [f.result() for f in futures]

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yield a :class:`TokenEvent` per generated token; leaving the loop early aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def listener(event: TokenEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        fut = self.submit(prompt, params, request_id=request_id, listener=listener)
        try:
            while True:
                event = await events.get()
                if event.error is not None:
                    raise event.error
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not fut.done():
                fut.cancel()  # the consumer left early: abort (its done callback frees the request)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its future resolves with ``finish_reason="abort"``. False if it is not live."""
        with self._lock:
            if request_id not in self._live:
                return False
            req = self.scheduler.abort(request_id)
            if req is not None:  # finished now (else when its step in flight answers)
                self._live.pop(request_id, None)
            wake = self.scheduler.in_flight < self.groups
        if req is not None:
            self._notify([(req, None, True)])
        if wake:
            self._wake()
        return True

    # ------------------------------------------------------------------ the controller loop

    def _wake(self) -> None:
        try:
            self._group.results.put(("wake",))
        except (OSError, ValueError):
            pass

    def _run(self) -> None:
        try:
            while True:
                frees: list[int] = []
                with self._lock:
                    if self._stop_now or (self._closing and not self.scheduler.has_work() and not self._inflight):
                        break
                    plans = []
                    if self.status == "ready":
                        for g in self.scheduler.idle_groups():
                            plan = self.scheduler.schedule(g)
                            if plan is not None:
                                plans.append(plan)
                                self._inflight[plan.step_id] = plan
                        frees = [] if plans or self._inflight else self.scheduler.take_frees()
                    if plans:
                        self._space.notify_all()  # admissions made room in the queue
                for plan in plans:
                    self._group.send(("step", plan.step_id, plan.frees, plan.items, plan.new_params))
                if self.status == "ready" and not plans and frees:
                    self._group.send(("free", frees))
                try:
                    msg = self._group.results.get(timeout=0.25)
                except queue.Empty:
                    msg = None
                if msg is not None:
                    self._handle(msg)
                self._watch()
        except BaseException as exc:  # the controller must never die silently
            self.last_error = f"controller crashed: {exc!r}\n{traceback.format_exc()}"
            self.status = "failed"
        finally:
            self._close_down()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "tokens":
            _, step_id, tokens = msg
            with self._lock:
                plan = self._inflight.pop(step_id, None)
                if plan is None:
                    return  # a step of a group that has since failed
                events = self.scheduler.complete(plan, tokens)
                for req, _, done in events:
                    if done:
                        self._live.pop(req.request_id, None)
            self.metrics.record_step(plan.n_tokens, sum(1 for _, tok, _ in events if tok is not None))
            self._notify(events)
        elif kind == "error":
            # A peer's death usually reaches the survivors as a collective error ("connection reset")
            # before the controller sees the exit: name the dead worker first when there is one.
            deadline = time.monotonic() + 1.0
            while not self._group.dead() and time.monotonic() < deadline:
                time.sleep(0.02)
            last = msg[2].strip().splitlines()[-1] if msg[2].strip() else "no traceback"
            dead = self._group.dead()
            failed = [r for r, _ in dead]
            reason = self._group.describe_death().strip() if [r for r in failed if r != msg[1]] else ""
            reason = f"{reason}; worker {msg[1]} then failed: {last}" if reason else f"worker {msg[1]} failed: {last}"
            print(f"energon: worker {msg[1]} traceback:\n{msg[2]}", file=sys.stderr, flush=True)
            self._group_failed(reason)
        elif kind == "stats":
            with self._lock:
                self._stats[msg[1]] = msg[2]
                self._stats_ready.notify_all()

    def _watch(self) -> None:
        if self.status != "ready":
            return
        dead = self._group.dead()
        if dead:
            self._group_failed(self._group.describe_death().strip())
            return
        now = time.monotonic()
        hung = [p for p in self._inflight.values() if now - p.started > self.config.step_timeout_s]
        if hung:
            self._group_failed(f"step {hung[0].step_id} got no answer within step_timeout_s="
                               f"{self.config.step_timeout_s:g} s (a worker hangs)")

    def _group_failed(self, reason: str) -> None:
        self.metrics.worker_failures += 1
        can_restart = (self.config.restart_workers and self.metrics.restarts < self.config.max_restarts
                       and self.config.launcher == "spawn")  # a torchrun world's processes are torchrun's
        with self._lock:
            lost = self.scheduler.fail_running()
            self._inflight.clear()
            self.status = "restarting" if can_restart else "failed"
            self.last_error = reason
            for req in lost:
                self._live.pop(req.request_id, None)
        after = "the worker group is restarting" if can_restart else "the engine has no workers left"
        print(f"energon: worker group failed: {reason}; {len(lost)} running request(s) failed; {after}",
              file=sys.stderr, flush=True)
        self._fail(lost, WorkerFailedError(f"the worker group failed while this request ran ({reason}); {after}; "
                                           "resubmit the request"))
        self._group.kill()
        if can_restart:
            self.metrics.restarts += 1
            try:
                self._group = self._start_group()
                with self._lock:
                    self.status = "ready"
                return
            except Exception as exc:
                with self._lock:
                    self.status = "failed"
                    self.last_error = f"{reason}; the restart failed too: {exc}"
        with self._lock:
            waiting = self.scheduler.drain_waiting()
            for req in waiting:
                self._live.pop(req.request_id, None)
            self._space.notify_all()
        self._fail(waiting, EngineClosedError(f"the engine has no workers left ({self.last_error}); start a new one"))

    def _close_down(self) -> None:
        with self._lock:
            leftovers = self.scheduler.fail_running() + self.scheduler.drain_waiting()
            self._live.clear()
            self._inflight.clear()
            self._closing = True
            self._space.notify_all()
            if self.status != "failed":
                self.status = "stopped"
        self._fail(leftovers, EngineClosedError("the engine shut down before this request finished; resubmit it to "
                                                "a running engine"))
        self._group.stop()

    # ------------------------------------------------------------------ notifications

    def _completion(self, req: Request) -> Completion:
        return Completion(req.request_id, list(req.prompt), list(req.generated), req.text, req.finish_reason or "abort",
                          req.arrival, req.first_token, req.finished)

    def _delta(self, req: Request, done: bool) -> str:
        """New text since the last event; holds back what may still become a stop string or a whole character."""
        if self.tokenizer is None:
            return ""
        full = req.text if done and req.text is not None else self.decode(req.generated)
        if not done:
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            while full.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next bytes
                full = full[:-1]
            full = full[: len(full) - hold] if hold else full
        if not full.startswith(req.sent_text):
            return ""  # the tokenizer revised earlier text (rare); the completion carries the final text
        delta = full[len(req.sent_text):]
        req.sent_text = full
        return delta

    def _notify(self, events: list[tuple[Request, int | None, bool]]) -> None:
        for req, tok, done in events:
            completion = self._completion(req) if done else None
            if req.listener is not None:
                event = TokenEvent(req.request_id, tok, self._delta(req, done), req.finish_reason if done else None,
                                   completion)
                try:
                    req.listener(event)
                except Exception:  # a listener's bug must not stop the controller
                    traceback.print_exc()
            if done:
                assert completion is not None
                status = "aborted" if completion.finish_reason == "abort" else "ok"
                self.metrics.record_finished(latency_s=completion.latency_s, ttft_s=completion.ttft_s,
                                             tokens=len(completion.token_ids), status=status)
                if not req.future.done():
                    try:
                        req.future.set_result(completion)
                    except Exception:  # cancelled meanwhile
                        pass

    def _fail(self, requests: list[Request], error: BaseException) -> None:
        for req in requests:
            self.metrics.record_finished(latency_s=0.0, ttft_s=None, tokens=len(req.generated), status="error")
            if req.listener is not None:
                try:
                    req.listener(TokenEvent(req.request_id, None, "", "error", None, error))
                except Exception:
                    traceback.print_exc()
            if not req.future.done():
                try:
                    req.future.set_exception(error)
                except Exception:
                    pass

    # ------------------------------------------------------------------ status

    def health(self) -> dict[str, Any]:
        """Status (``ready``, ``restarting``, ``failed``, ``stopped``), workers, restarts, queue and last error."""
        group = self._group
        dead = group.dead()
        return {"status": "degraded" if self.status == "ready" and dead else self.status,
                "workers": group.world, "alive": group.world - len(dead), "pids": group.pids,
                "restarts": self.metrics.restarts, "worker_failures": self.metrics.worker_failures,
                "waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                "last_error": self.last_error, "model": self.model_name}

    def render_metrics(self) -> str:
        """Prometheus text for ``/metrics``."""
        return self.metrics.render(queue_depth=self.scheduler.num_waiting, running=self.scheduler.num_running,
                                   up=self.status == "ready")

    def pipeline_stats(self, *, reset: bool = False, timeout: float = 60.0) -> dict[str, Any]:
        """Measured busy share of each stage since the last reset: ``{"stages": [...], "ranks": [...]}``.

        A stage is busy from its forward's start to its end; time waiting for inputs or for the
        controller is idle. Asked in order with the steps, so it covers every step sent before it.
        """
        with self._lock:
            self._stats.clear()
        self._group.send(("stats", reset))
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._stats) < self._group.world:
                left = deadline - time.monotonic()
                if left <= 0 or self.status not in ("ready",):
                    raise TimeoutError(f"the workers did not report stage times within {timeout:g} s "
                                       f"(status {self.status})")
                self._stats_ready.wait(min(left, 0.5))
            ranks = [self._stats[r] for r in range(self._group.world)]
        tp = self.runtime.tp
        stages = [max(ranks[s * tp: (s + 1) * tp], key=lambda r: r["busy_s"]) for s in range(self.runtime.pp)]
        return {"ranks": ranks, "stages": [s["utilisation"] for s in stages], "groups": self.groups}

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, *, wait: bool = True, timeout: float | None = 30.0, cancel: bool = False) -> None:
        """Stop taking requests; finish the queued and running ones (``cancel=True``: abort them now).

        Requests still unfinished after ``timeout`` seconds fail with :class:`EngineClosedError`; then
        the workers are stopped. Idempotent.
        """
        with self._lock:
            self._closing = True
            self._space.notify_all()
            if cancel:
                self._stop_now = True
        self._wake()
        if not wait:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop_now = True
            self._wake()
            self._thread.join(timeout)
        if self._thread.is_alive():  # wedged (it never should be): do not leave workers behind
            self._group.kill()
        _LIVE.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

