"""The typed messages between the engine's controller and its workers (spawned or torchrun).

Commands go from the controller to every worker, in the same order to each (the workers are SPMD):

* :class:`Step`: free finished sequences, then run one packed step;
* :class:`Free`: free sequences without a step (nothing else to run);
* :class:`Stats`: every rank reports its stage's busy time;
* :class:`Ping`: every rank answers :class:`Pong` (the controller's heartbeat when idle);
* :class:`CompileGrammars`: the rank that samples compiles these structured outputs' grammars off the step path;
* :class:`Stop`: leave the loop, destroy the process group, exit 0.

Replies go from workers to the controller: :class:`Ready` (loaded, with a :class:`WorkerInfo`),
:class:`Tokens` (the result rank's sampled tokens of a step), :class:`StatsReport`, :class:`Pong`,
:class:`GrammarReady` (a grammar compiled, or why it could not be), :class:`WorkerError` (a traceback; the
worker then exits) and :class:`Bye` (a torchrun worker left).
:class:`Wake` is the controller's own nudge to its result queue (a new request arrived).

Every message is a frozen dataclass of plain values, cheap to pickle; readers dispatch with
``isinstance``, so a misspelt kind is a type error, not a silently ignored string.

:class:`WorkerGroup` is what the controller drives: the local worker processes
(:class:`energon_infer.worker.workers.SpawnedWorkerGroup`) and the ranks of a torchrun world
(:class:`energon_infer.worker.torchrun.TorchrunWorkerGroup`) both implement it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from energon_infer.sampling import SamplingParams
from energon_infer.structured import StructuredOutput

__all__ = ["Step", "Free", "Stats", "Ping", "CompileGrammars", "Stop", "Command", "Ready", "Tokens", "StatsReport", "Pong",
           "GrammarReady", "WorkerError", "Bye", "Wake", "Reply", "WorkerInfo", "PoolInfo", "WorkerGroup"]


# ---------------------------------------------------------------------- commands (controller -> workers)


@dataclass(frozen=True, slots=True)
class Step:
    """Free ``frees``, then run ``items`` (``(seq_id, new_tokens)``); ``new_params`` for sequences new in this step.

    Block decisions of the scheduler, applied before the step runs: ``copies`` (``(src, dst)`` block
    copies, copy-on-write of a shared prefix), ``blocks`` (blocks appended to each sequence's table;
    a new sequence's whole table, whose leading entries may be holes, ``-1``) and ``starts`` (a new sequence's
    tokens already cached); ``trims`` (a running sequence's leading table entries released, a sliding window
    having passed them: holes from now on, never read), applied after the swap-outs and before the frees.
    With steps planned ahead (``depth > 1``): ``send_back`` has the last stage send this step's tokens
    straight to the first stage's ranks; ``take_back`` has those receive the previous ``send_back`` step
    of ``group``'s tokens and put them in place of the placeholders (``-1``) before running.
    ``late``: admissions only, planned while the group's steps were all in flight (see
    :meth:`~energon_infer.scheduling.scheduler.Scheduler.schedule_late`); a worker that has not yet started the
    step before it runs both as one (:mod:`energon_infer.worker.late_steps`), else it runs after it.
    ``prefill_lengths`` (a ``longrope`` model's steps only): a sequence whose items are a chunk of a longer prefill
    (a prompt, or a recompute) -> that prefill's whole length, which the rope takes as transformers' one call would.
    A new sequence's structured output (``new_params[seq].structured``) carries its constraint, which the rank that
    samples compiles (:data:`~energon_infer.structured.ON_RANK`), or a grammar given compiled (xgrammar's JSON
    text); ``history`` then has its outputs so far.
    """

    step_id: int
    frees: list[int]
    items: list[tuple[int, list[int]]]
    new_params: dict[int, SamplingParams]
    blocks: dict[int, list[int]] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)
    copies: list[tuple[int, int]] = field(default_factory=list)
    group: int = 0
    send_back: bool = False
    take_back: bool = False
    history: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks, before anything else
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) blocks, after the assignments
    late: bool = False
    trims: dict[int, int] = field(default_factory=dict)  # seq -> leading table entries released (holes)
    prefill_lengths: dict[int, int] = field(default_factory=dict)  # seq -> its prefill's length, this a chunk of it
    proposals: dict[int, int] = field(default_factory=dict)  # seq -> proposed tokens ending its item (speculation)


@dataclass(frozen=True, slots=True)
class Free:
    """Free these sequences' KV blocks (sent alone when no step runs)."""

    seq_ids: list[int]


@dataclass(frozen=True, slots=True)
class Stats:
    """Report the stage's busy time (and start counting afresh when ``reset``)."""

    reset: bool = False


@dataclass(frozen=True, slots=True)
class Ping:
    """Every rank answers :class:`Pong`: the controller's heartbeat while no step is in flight (a frozen
    worker is then found without waiting for the next request)."""

    seq: int


@dataclass(frozen=True, slots=True)
class CompileGrammars:
    """The rank that samples compiles these constraints' grammars on its grammar thread (the step path never waits
    for them) and answers :class:`GrammarReady` for each; the other ranks ignore it. The scheduler holds the
    requests that need them until then (:mod:`energon_infer.scheduling.grammar_wait`)."""

    structured: tuple[StructuredOutput, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the command loop."""


Command = Step | Free | Stats | Ping | CompileGrammars | Stop


# ---------------------------------------------------------------------- replies (workers -> controller)


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """What a worker's layer pool holds (see :mod:`energon_infer.worker.memory_pool`)."""

    pooled: tuple[int, ...]
    layers: int
    pool_bytes: int
    slot_bytes: int
    device_bytes: int
    layer_bytes: int
    plan: str = ""  # the PoolPlan as JSON (tiers, disk layers, bytes and seconds per pass)
    first_layer: int = 0  # the stage's first layer number (plan positions are within the stage)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports once loaded: its cache geometry, model config, device and weights.

    ``info["key"]`` reads a field as JSON-shaped data (tuples as lists), for callers of the dict it replaced.
    """

    rank: int
    pid: int
    kv_blocks: int
    block_size: int
    config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    device: str
    weight_bytes: int
    pool: PoolInfo | None = None
    # What each layer of the stage holds (bytes, model layer order) and in which format ("float32",
    # "int4 (group 128)"; energon_infer.loading.quantization): the memory report's per-layer figures.
    layer_bytes: tuple[int, ...] = ()
    weights_format: str = ""
    first_layer: int = 0  # the model layer number of layer_bytes[0] (this rank's pipeline stage)
    host_blocks: int = 0  # swap space (see energon_infer.scheduling.swap) and its measured costs
    swap_s_per_block: float = 0.0
    recompute_s_per_token: float = 0.0
    kv_window: int = 0  # every layer's sliding window, the scheduler's to free blocks by (0: none)
    kv_groups: tuple[int, ...] = ()  # each KV group's window (energon_infer.scheduling.kv_groups; (): one group)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["layer_bytes"], out["kv_groups"] = list(self.layer_bytes), list(self.kv_groups)
        if self.pool is not None:
            out["pool"]["pooled"] = list(self.pool.pooled)
        return out

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]


@dataclass(frozen=True, slots=True)
class Ready:
    rank: int
    info: WorkerInfo


@dataclass(frozen=True, slots=True)
class Tokens:
    """A step's sampled tokens; by seq_id, the logprobs asked for and the rows that failed alone (see
    :meth:`~energon_infer.sampling.Sampler.sample_rows`; such a row's token is a placeholder). ``accepted``: a
    speculating sequence's tokens in order, each with its logprobs or ``None`` (the last is its entry of ``tokens``)."""

    step_id: int
    tokens: list[int]
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    # time.monotonic_ns() on the result rank: the step's start, its forward's start and end, its end (the time
    # account, energon_infer.engine.account); () where none was taken
    timing: tuple[int, ...] = ()
    accepted: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StatsReport:
    """A rank's stage timing: ``busy_s``, ``span_s``, ``steps``, ``utilisation``; the rank that samples adds
    ``grammar_compiles`` (structured outputs' grammars it compiled since it started)."""

    rank: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pong:
    """A rank's answer to :class:`Ping` ``seq``."""

    rank: int
    seq: int


@dataclass(frozen=True, slots=True)
class GrammarReady:
    """The rank that samples holds the grammar of the constraint whose ``key`` this is
    (:attr:`~energon_infer.structured.StructuredOutput.key`), or could not compile it: ``error`` (beginning with
    :data:`~energon_infer.structured.REFUSED` where the constraint cannot compile: a 400)."""

    key: tuple[str, str]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerError:
    """A worker failed (``rank`` -1: the result channel itself failed); ``traceback`` says where. ``fatal``: a
    restart would not help or must not happen (the checkpoint changed under the server): the engine stops."""

    rank: int
    traceback: str
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class Bye:
    rank: int


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake the controller loop (it waits on the result queue)."""


Reply = Ready | Tokens | StatsReport | Pong | GrammarReady | WorkerError | Bye | Wake


# ---------------------------------------------------------------------- the group the controller drives


@runtime_checkable
class WorkerGroup(Protocol):
    """A started ``tp x pp`` group of workers, as the controller sees it: commands in, replies out.

    ``results`` is the one queue every reply arrives on (and the controller's own :class:`Wake`);
    ``send`` gives a command to every rank, in order.
    """

    world: int  # ranks
    backend: str  # "gloo" or "nccl"
    info: list[WorkerInfo]  # what each rank reported once loaded, by rank
    results: Any  # a queue of Reply: get(timeout=...), put(...)
    procs: list[Any]  # the processes this group owns (none for a torchrun world)

    @property
    def pids(self) -> list[int]: ...

    def start(self, timeout_s: float = 600.0, cancelled: Callable[[], bool] | None = None) -> list[WorkerInfo]:
        """Start every rank and wait until each has loaded (``cancelled()`` true: give up)."""
        ...

    def send(self, cmd: Command) -> None: ...

    def dead(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of every rank that has gone."""
        ...

    def describe_death(self) -> str: ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every rank to leave its loop, then make sure it has."""
        ...

    def kill(self) -> None: ...
