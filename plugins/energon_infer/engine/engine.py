"""The engine's front door: one controller in your process drives a ``tp x pp`` worker group (EnergonAI's hierarchy).

You program against :class:`Engine` as if the model were one serial object; behind it the
controller thread batches requests step by step (:mod:`energon_infer.scheduling.scheduler`), sends each step
to the worker processes (:mod:`energon_infer.worker.workers`), which run the tensor/pipeline-parallel
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
(up to ``max_restarts`` times within ``restart_window_s``) and serving goes on; a request that
fails alone in a worker gets :class:`RequestFailedError` and nothing else is touched. No request
is dropped without its future or stream receiving a result or an error.

This module holds the factories and the request API; the loop is :mod:`energon_infer.engine.controller`,
the messages :mod:`energon_infer.protocol`, the results and their text :mod:`energon_infer.engine.delivery`.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import functools
import logging
import sys
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from energon_infer.engine.account import RequestStamps, ServingAccount, explain_account, now_ns
from energon_infer.engine.controller import (
    Controller,
    EngineClosedError,
    WorkerFailedError,
    start_group,
)
from energon_infer.engine.delivery import Completion, Delivery, RequestFailedError, TokenEvent
from energon_infer.engine.engine_config import EngineConfig, engine_config, pool_config
from energon_infer.engine.memory_plan import fit_memory
from energon_infer.engine.memory_report import METRIC_KEYS, ReportMark, memory_report
from energon_infer.engine.metrics import EngineMetrics
from energon_infer.engine.pool_check import check_pool_plan
from energon_infer.engine.speculators import build_speculator
from energon_infer.errors import InvalidRequestError, MissingFileError, OptionError
from energon_infer.loading.hf_files import as_engine_tokenizer, auto_dtype, generation_defaults
from energon_infer.protocol import WorkerGroup, WorkerInfo
from energon_infer.sampling import SamplingParams
from energon_infer.scheduling.requests import Encoded
from energon_infer.scheduling.scheduler import QueueFullError, Request, Scheduler
from energon_infer.scheduling.scheduler_config import AUTO
from energon_infer.structured import prepare
from energon_infer.worker.runtime import RuntimeConfig
from energon_infer.worker.workers import ModelSource
from tightfit.planner.pool import PoolPlan, streaming_groups
from tightfit.planner.serving import ServingPlan

__all__ = ["Engine", "EngineConfig", "Completion", "TokenEvent", "WorkerFailedError", "EngineClosedError",
           "QueueFullError", "RequestFailedError", "Encoded"]


def _default_params(source: ModelSource) -> SamplingParams:
    """What a request without SamplingParams gets: the model's generation_config.json defaults, if any."""
    if source.kind != "pretrained":
        return SamplingParams()
    found = generation_defaults(source.path)
    try:
        return SamplingParams(**found)
    except ValueError as exc:
        logging.getLogger("energon_infer").warning("energon: ignoring generation_config.json's defaults %s: %s",
                                                   found, exc)
        return SamplingParams()


_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()
# Options the serving plan chooses where the caller left them open (a whole config= counts as setting them).
_PLANNED = ("max_batch_tokens", "kv_cache_tokens", "chunked_prefill")


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
        config: the whole configuration (:class:`~energon_infer.engine.engine_config.EngineConfig`: batching, each
            worker's layout and cache, faults, launch); the factories build it from flat keywords.
        memory_pool: peer memory pooling of each stage's layers (``None``: off).
        tokenizer: turns text prompts into ids and ids into text (``None``: token-id prompts only); a
            ``tokenizers.Tokenizer`` or a transformers tokenizer (``AutoTokenizer.from_pretrained(...)``).
        model_name: the name the HTTP server reports.

    Requests without :class:`SamplingParams` get :attr:`default_params`: the model's ``generation_config.json``
    defaults (temperature, top_p, top_k, repetition_penalty, max_new_tokens; ``do_sample: false`` is greedy).

    Example:
        >>> with Engine.from_pretrained(model_dir, tp=2) as engine:              # doctest: +SKIP
        ...     print(engine.generate(["Hello"])[0].text)
    """

    def __init__(self, source: ModelSource, config: EngineConfig | None = None, *,
                 memory_pool: Any = None, tokenizer: Any = None, model_name: str | None = None,
                 memory_plan: ServingPlan | None = None):
        self.source, self.memory_plan = source, memory_plan  # the budget from_pretrained planned (explain())
        self.config = config or EngineConfig()
        if self.config.runtime.dtype == "auto":  # from_pretrained resolved (and stated) it; a Lightning file is fp32
            dtype = auto_dtype(source.path, self.config.runtime.device)[0] if Path(source.path).is_dir() else "float32"
            runtime = dataclasses.replace(self.config.runtime, dtype=dtype)
            self.config = dataclasses.replace(self.config, runtime=runtime)
        self.runtime: RuntimeConfig = self.config.runtime
        self.memory_pool = pool_config(memory_pool)
        self.tokenizer = as_engine_tokenizer(tokenizer)  # a transformers tokenizer gets the tokenizers interface
        self.model_name = model_name or Path(source.path).name
        self.default_params = _default_params(source)
        self.metrics = EngineMetrics(model_name=self.model_name)
        self.time_account = ServingAccount(self.metrics.observe_part)  # account() / explain() / /metrics
        self.groups = self.config.groups
        self._ctl: Controller | None = None
        self._mark, self._last_report = ReportMark(time.monotonic()), dict[str, Any]()
        # The controller restarts a failed group with this factory itself (no call back into the engine).
        start = functools.partial(start_group, source, self.runtime, self.config, self.memory_pool)
        speculator = build_speculator(self.config.speculative, source.path, self.runtime)  # a bad draft: no workers
        group = start()
        info: WorkerInfo = group.info[0]
        self.vocab_size, self.max_context = int(info.config["vocab_size"]), int(info.config["max_positions"])
        self.eos_token_ids = info.eos_token_ids
        if self.tokenizer is None and source.kind == "tightfit_gpt" and self.vocab_size == 256:
            from energon_infer.worker.gpt_checkpoint import ByteTokenizer

            self.tokenizer = ByteTokenizer()
        if self.config.scheduler.groups == AUTO:  # the plan's policy when stages stream from disk (streaming_groups)
            plans = [PoolPlan.from_json(i.pool.plan) for i in group.info if i.pool is not None and i.pool.plan]
            self.groups = streaming_groups(plans, self.groups)
            if self.groups != self.config.groups:
                self.config = dataclasses.replace(
                    self.config, scheduler=dataclasses.replace(self.config.scheduler, groups=self.groups))
        decode = self.decode if self.tokenizer is not None else None  # the scheduler's for stop strings, else delivery's
        scheduler = Scheduler(self.config.scheduler_from(info, max_context=self.max_context), eos_token_ids=self.eos_token_ids,
                              decode=decode, stop_text_only=True, speculator=speculator, hold_grammars=True)
        self._delivery = Delivery(self.metrics, has_text=self.tokenizer is not None, decode=decode,
                                  account=self.time_account)  # the frontend: outputs
        self._ctl = Controller(group, scheduler, start, self.config, self.metrics, self._delivery, groups=self.groups,
                               tp=self.runtime.tp, pp=self.runtime.pp, account=self.time_account)
        self._ctl.thread.start()
        _LIVE.add(self)

    # The controller's state, read by the server and the tests.
    @property
    def scheduler(self) -> Scheduler:
        return self._controller.scheduler

    @property
    def status(self) -> str:
        return self._controller.status if self._ctl is not None else "starting"

    @property
    def last_error(self) -> str:
        return self._controller.last_error

    @property
    def worker_info(self) -> list[WorkerInfo]:
        return self._controller.worker_info

    @property
    def _controller(self) -> Controller:
        if self._ctl is None:
            raise RuntimeError("the engine is still starting its workers")
        return self._ctl

    @property
    def _live(self) -> dict[str, Request]:
        return self._controller.live

    @property
    def _group(self) -> WorkerGroup:
        return self._controller.group

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(cls, path: str | Path, *, config: EngineConfig | None = None, memory_pool: Any = None,
                        tokenizer: Any = None, model_name: str | None = None, **options: Any) -> Engine:
        """Start ``tp * pp`` workers on a Hugging Face directory (``config.json`` + ``*.safetensors``).

        ``options`` are flat keywords, each naming one field of the :class:`EngineConfig` tree (``tp=2``,
        ``max_batch_tokens=4096``, ``max_queue=64``, ``kv_cache_tokens=8192``, ``dtype="auto"``: the dtype
        config.json names; see :data:`~energon_infer.engine.engine_config.FLAT_OPTIONS`), set on ``config`` (default:
        every default). The directory's ``tokenizer.json`` is used when there is one.
        """
        from energon_infer.loading.backend import check_fallback_options, choose_backend, model_type_of
        from energon_infer.loading.config import load_config
        from energon_infer.loading.torchao_checkpoint import checkpoint_quantization
        from energon_infer.parallel import split_layers
        from energon_infer.worker.model import check_tp

        path = Path(path)
        if not path.is_dir():
            raise MissingFileError(f"model directory {path} does not exist; give a directory saved with "
                                   "save_pretrained (config.json + *.safetensors)")
        cfg = engine_config(config, **options)
        # Fail here, in the caller's process, before any worker is spawned; say what was chosen once all is checked.
        if (method := checkpoint_quantization(path, cfg.runtime.quantization)) != cfg.runtime.quantization:
            cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, quantization=method))  # torchao's
        pool = pool_config(memory_pool)
        # a native family, or transformers' modeling code (the fallback, or what model_impl asks for)
        backend, why = choose_backend(path, cfg.runtime.model_impl)
        said = [why]
        if cfg.runtime.dtype == "auto":  # the checkpoint's dtype where the device computes in it, else float32
            dtype, dtype_why = auto_dtype(path, cfg.runtime.device)
            cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, dtype=dtype))
            said.append(f"dtype {dtype}: {dtype_why}")
        if backend == "transformers":
            check_fallback_options(model_type_of(path), tp=cfg.runtime.tp, pp=cfg.runtime.pp,
                                   quantization=cfg.runtime.quantization, memory_pool=pool is not None)
        else:
            model = load_config(path)
            try:  # both only check the layout the caller asked for against the model's shape
                check_tp(model, cfg.runtime.tp)
                split_layers(model.n_layers, cfg.runtime.pp)
            except ValueError as exc:
                raise OptionError(str(exc)) from None
            if cfg.runtime.quantization is not None:  # group size vs this model's widths, torchao installed
                from energon_infer.loading.quantization import QuantSpec, check_quantization
                from energon_infer.worker.runtime_config import DTYPES

                check_quantization(model, QuantSpec.create(cfg.runtime.quantization, cfg.runtime.group_size),
                                   tp=cfg.runtime.tp, dtype=DTYPES[cfg.runtime.dtype])
        plan = None
        if backend != "transformers":  # the whole serving process inside the memory it may use (a CPU), or one line
            given = frozenset(options) | (frozenset(_PLANNED) if config is not None else frozenset())
            cfg, pool, plan = fit_memory(path, model, cfg, pool, given=given)
        if pool is not None and (plan is None or not pool.tiered):  # an impossible budget raises here, not in a worker
            check_pool_plan(str(path), cfg.runtime, pool)
        if cfg.runtime.progress:
            print("\n".join(f"energon: {line}" for line in said), file=sys.stderr, flush=True)
        if tokenizer is None and (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls(ModelSource("pretrained", str(path)), cfg, memory_pool=pool, tokenizer=tokenizer,
                   model_name=model_name, memory_plan=plan)

    @classmethod
    def from_lightning_checkpoint(cls, path: str | Path, *, config: EngineConfig | None = None, memory_pool: Any = None,
                                  gpt_config: Any = None, heads: int | None = None, tokenizer: Any = None,
                                  model_name: str | None = None, **options: Any) -> Engine:
        """Serve the tightfit example GPT from a training checkpoint (Lightning ``.ckpt``, ``state_dict``
        file or ``.safetensors``), e.g. the one ``strategy="elixir"`` trained. A 256-token vocabulary gets
        the byte tokenizer. ``gpt_config``/``heads``: see :func:`energon_infer.worker.gpt_checkpoint.load_tightfit_gpt`;
        a ``.safetensors`` file with a GPTConfig ``config.json`` beside it (what the Elixir example exports)
        needs neither. ``config`` / ``options``: as in :meth:`from_pretrained`.
        """
        path = Path(path)
        if not path.is_file():
            hint = (" (a directory: a sharded checkpoint? export it first with `python -m lightning_elixir.export "
                    f"{path}`)") if path.is_dir() else ""
            raise MissingFileError(f"checkpoint {path} is not a file{hint}; give a Lightning .ckpt, a torch.save'd "
                                   "state_dict, or a .safetensors file")
        beside = path.parent / "config.json"
        if gpt_config is None and heads is None and path.suffix == ".safetensors" and beside.is_file():
            # The Elixir example writes its GPTConfig as config.json next to the exported weights.
            import json

            from tightfit.models.gpt import GPTConfig

            raw = json.loads(beside.read_text())
            if "model_type" not in raw:  # not a Hugging Face config
                gpt_config = GPTConfig.from_dict(raw)
        gpt_options = {k: v for k, v in (("gpt_config", gpt_config), ("heads", heads)) if v is not None}
        cfg = engine_config(config, **options)  # before anything loads: an unknown keyword fails at once
        pool = pool_config(memory_pool)
        if pool is not None and pool.tiered:
            raise OptionError(f"memory_budget streams layers from a Hugging Face safetensors directory; {path} is a "
                              "training checkpoint: export it with save_pretrained and use from_pretrained, or pool "
                              "with device_budget")
        return cls(ModelSource("tightfit_gpt", str(path), gpt_options), cfg, memory_pool=memory_pool,
                   tokenizer=tokenizer, model_name=model_name or path.stem)

    # ------------------------------------------------------------------ tokens

    def encode(self, prompt: str | Sequence[int]) -> Encoded:
        """A text prompt's ids, or ids checked against the vocabulary; :class:`Encoded` ids (encoded once) pass."""
        if isinstance(prompt, Encoded):
            return prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer, so prompts must be token ids; put tokenizer.json in "
                                 "the model directory or pass tokenizer=...")
            return Encoded(self.tokenizer.encode(prompt).ids)
        ids = Encoded(int(t) for t in prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
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
        stamps = RequestStamps(received=(t0 := now_ns()), tokenize_start=t0)
        ids, stamps.tokenized = self.encode(prompt), now_ns()
        req = Request(request_id or uuid.uuid4().hex, ids, prepare(self, params or self.default_params))
        deadline = None if timeout is None else time.monotonic() + timeout
        fut = self._delivery.open(req.request_id, listener, stamps)  # the caller's side first: no token comes before it
        try:
            self._controller.add(req, block=block, deadline=deadline)
        except BaseException:
            self._delivery.close(req.request_id)
            raise
        self.metrics.record_submitted(len(ids))
        fut.add_done_callback(lambda f: f.cancelled() and self.abort(req.request_id))
        return fut

    def submit_all(self, jobs: Sequence[tuple[str | Sequence[int], SamplingParams | None]], *,
                   listeners: Sequence[Callable[[TokenEvent], None] | None] | None = None, block: bool = False,
                   timeout: float | None = None, stamps: Sequence[RequestStamps] | None = None
                   ) -> list[Future[Completion]]:
        """Queue several requests as one: all are admitted or none (a :class:`QueueFullError` or ``ValueError``
        leaves nothing queued). Returns their futures in order; ``listeners``: one per job, and ``block`` /
        ``timeout`` (wait for room for all of them), as in :meth:`submit`. ``stamps``: one per job, its time account so
        far (:mod:`energon_infer.engine.account`), which the caller closes once it wrote the answer (the server)."""
        t0 = now_ns()
        reqs = [Request(uuid.uuid4().hex, self.encode(p), prepare(self, sp or self.default_params)) for p, sp in jobs]
        t1, given = now_ns(), stamps is not None
        stamps = stamps or [RequestStamps(received=t0, tokenize_start=t0, tokenized=t1) for _ in reqs]
        futures: list[Future[Completion]] = []
        try:
            for i, req in enumerate(reqs):
                futures.append(self._delivery.open(req.request_id, listeners[i] if listeners is not None else None,
                                                   stamps[i], closes=not given))
            self._controller.add_all(reqs, block=block,
                                     deadline=None if timeout is None else time.monotonic() + timeout)
        except BaseException:
            for req in reqs[:len(futures)]:  # only those opened here
                self._delivery.close(req.request_id)
            raise
        for req, fut in zip(reqs, futures):
            self.metrics.record_submitted(len(req.prompt))
            fut.add_done_callback(functools.partial(self._abort_if_cancelled, req.request_id))
        return futures

    def _abort_if_cancelled(self, request_id: str, fut: Future[Completion]) -> None:
        if fut.cancelled():
            self.abort(request_id)

    def generate(self, prompts: Sequence[str | Sequence[int]] | str,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt (continuously batched with whatever else is running); results in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        plist = list(params) if isinstance(params, Sequence) else [params or self.default_params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
        jobs = list(zip(prompts, plist))
        if len(jobs) <= self.scheduler.config.max_queue:
            # Queued together (once there is room for all), so the first step sees every prompt however fast
            # the workers run.
            futures = self.submit_all(jobs, block=True)
        else:  # more than the queue holds: fed to it as it drains
            futures = [self.submit(p, sp, block=True) for p, sp in jobs]
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
        return self._controller.abort(request_id)

    # ------------------------------------------------------------------ status

    def health(self) -> dict[str, Any]:
        """Status, workers, restarts (and what is left of the budget), queue and last error.

        ``ready``; ``degraded`` (serving, but a worker is gone or the group failed within ``restart_window_s``);
        ``restarting`` (a failed or hung group is being replaced); ``failed`` (no workers, no restart left);
        ``stopped``.
        """
        group = self._group
        dead = group.dead()
        budget = self._controller.budget
        # degraded: serving, but a worker is gone or the group failed within the restart window (budget in use).
        degraded = self.status == "ready" and (dead or budget.used > 0)
        return {"status": "degraded" if degraded else self.status,
                "workers": group.world, "alive": group.world - len(dead), "pids": group.pids,
                "restarts": self.metrics.restarts, "worker_failures": self.metrics.worker_failures,
                "restarts_left": budget.left, "restart_budget": budget.describe(),
                "waiting": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                "last_error": self.last_error, "model": self.model_name}

    def render_metrics(self) -> str:
        """Prometheus text for ``/metrics`` (with the last :meth:`memory_report`'s pool figures, if any)."""
        extra = {f"pool_{k}": float(v) for k, v in self._last_report.items()
                 if k in METRIC_KEYS and v not in (float("inf"),)}
        return self.metrics.render(queue_depth=self.scheduler.num_waiting, running=self.scheduler.num_running,
                                   up=self.status == "ready", extra=extra)

    def explain(self) -> str:
        """The whole-process memory budget the engine was planned with, one line per item (the memory the limit
        left, each worker's interpreter, weights, prefetch slots, read buffers, KV cache, activations, slack), or
        why there is none (:mod:`energon_infer.engine.memory_plan`); then the token budget and the time account."""
        none = "no serving memory plan: one is made on a CPU from a model directory (not on a GPU, not from a checkpoint)"
        memory = self.memory_plan.explain() if self.memory_plan is not None else none
        return (f"{memory}\ntoken budget ({self.scheduler.config.token_budget}): {self.scheduler.budget.last.why}\n"
                f"time account:\n{explain_account(self.time_account.view())}")

    def account(self, *, reset: bool = False) -> dict[str, Any]:
        """Each part's mean and share of the time since the last ``reset``, by request and step, and the last ones."""
        return {"recent": self.time_account.recent(), **self.time_account.view(reset=reset)}

    def memory_report(self, *, timeout: float = 60.0) -> dict[str, Any]:
        """Where each layer lives and what the memory pool did (:mod:`energon_infer.engine.memory_report`): per rank
        the tier of every layer, disk reads by layer and bytes read; since the previous report, tokens/s against
        the I/O roofline (``batch x disk bandwidth / bytes streamed per step``); ``budget``: the whole-process
        budget the engine was planned with, line by line (:meth:`explain`), where there is one."""
        stats = self.pipeline_stats(reset=True, timeout=timeout)["ranks"]  # each report times its own interval
        report, self._mark = memory_report(self.worker_info, stats, steps=self.metrics.steps,
                                           generated=self.metrics.generated_tokens, since=self._mark)
        if self.memory_plan is not None:  # what was planned, line by line, beside what the pool did
            report["budget"] = [dict(what=w, bytes=b) for w, b in self.memory_plan.lines[0]]
        self._last_report = report
        return report

    def pipeline_stats(self, *, reset: bool = False, timeout: float = 60.0) -> dict[str, Any]:
        """Measured busy share of each stage since the last reset: ``{"stages": [...], "ranks": [...]}``.

        A stage is busy from its forward's start to its end; waiting for inputs or the controller is idle. Asked in
        order with the steps (it covers every step sent before it); the sampling rank adds ``grammar_compiles``.
        """
        return self._controller.pipeline_stats(reset=reset, timeout=timeout)

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, *, wait: bool = True, timeout: float | None = 30.0, cancel: bool = False) -> None:
        """Stop taking requests; finish the queued and running ones (``cancel=True``: abort them now).

        Requests still unfinished after ``timeout`` seconds fail with :class:`EngineClosedError`; then
        the workers are stopped. Idempotent.
        """
        self._controller.shutdown(wait=wait, timeout=timeout, cancel=cancel)
        if wait:
            _LIVE.discard(self)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
