"""Structured-output requests held out of the batch until the rank that samples holds their grammar.

A fresh constraint's grammar takes the rank that samples from milliseconds to seconds to compile (a few hundred
properties). Compiled in the step that first holds its request, it would hold up every request of that step. So the
engine's scheduler keeps such a request out of its queue (:meth:`GrammarWait.queue`) and asks the rank to compile
the grammar on its grammar thread (:meth:`GrammarWait.take_asks`, sent as
:class:`~energon_infer.protocol.CompileGrammars`); the other requests keep stepping. The rank's answer
(:class:`~energon_infer.protocol.GrammarReady`) releases every request held for that constraint
(:meth:`GrammarWait.release`) into the queue at their arrival places (ahead of the requests queued after them, so
the compile is not followed by a wait behind them), or finishes them with its error. A constraint the rank answered
for recently counts as ready (the last ``size`` by key, fewer than the rank keeps), so its next request is queued at
once. Should the rank have dropped it meanwhile, the step that admits the request compiles it again, as a
runner driven in-process does (``hold=False``: nothing is held).

A held request is this object's until it is released: it finishes it (an abort, a grammar that failed) as the
scheduler finishes a waiting one.

Example:
    >>> from energon_infer.sampling import SamplingParams
    >>> from energon_infer.scheduling.requests import Request
    >>> from energon_infer.structured import StructuredOutput
    >>> wait, queue = GrammarWait(hold=True), []
    >>> so = StructuredOutput(choice=("yes", "no"))
    >>> for name in "ab":
    ...     wait.queue(Request(name, [1], SamplingParams(structured=so)), queue)
    >>> wait.queue(Request("free", [1], SamplingParams()), queue)
    >>> [r.request_id for r in queue], len(wait.take_asks()), wait.num_held
    (['free'], 1, 2)
    >>> _ = wait.release(so.key, None, queue)
    >>> wait.queue(Request("c", [1], SamplingParams(structured=so)), queue)
    >>> [r.request_id for r in queue]
    ['a', 'b', 'free', 'c']
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, MutableSequence

from energon_infer.scheduling.requests import Request
from energon_infer.structured import StructuredOutput

__all__ = ["GrammarWait", "READY"]

#: Constraints counted as ready (the rank keeps ``energon_infer.worker.grammar.GRAMMARS``, 64: fewer here, so a
#: constraint the scheduler counts as ready is rarely one the rank has dropped).
READY = 32


class GrammarWait:
    """The requests held for their grammar, by constraint, and the constraints the rank holds (module docstring).

    Args:
        hold: hold a constrained request until the rank answers for its constraint (the engine's scheduler); False:
            every constraint counts as ready (a runner that compiles in its own steps).
        size: constraints remembered as ready (the least recently used forgotten).
        clock: the time source of each request's wait.
    """

    def __init__(self, *, hold: bool = False, size: int = READY, clock: Callable[[], float] = time.monotonic):
        self.enabled, self.size, self.clock = hold, size, clock
        self._ready: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._held: dict[tuple[str, str], list[tuple[Request, float]]] = {}  # in arrival order, with when held
        self._asks: list[StructuredOutput] = []
        self._asked: dict[tuple[str, str], StructuredOutput] = {}  # asked for (or to be), not yet answered
        self._arrivals = itertools.count(1)  # Request.queue_order of each request queued here, held or not

    @property
    def num_held(self) -> int:
        return sum(len(v) for v in self._held.values())

    def queue(self, req: Request, queue: MutableSequence[Request]) -> None:
        """Append ``req`` to ``queue``, or hold it if its constraint's grammar is not ready (the first request held
        for a constraint asks for it). Either way ``req`` takes its arrival place (:attr:`Request.queue_order`)."""
        req.queue_order = next(self._arrivals)
        so = req.params.structured
        key = so.key if self.enabled and so is not None else None
        if key is None or key in self._ready:
            if key is not None:
                self._ready.move_to_end(key)
            queue.append(req)
            return
        if key not in self._asked:  # once per constraint, however many wait for it (or were aborted meanwhile)
            self._asked[key] = so  # type: ignore[assignment]
            self._asks.append(so)  # type: ignore[arg-type]
        self._held.setdefault(key, []).append((req, self.clock()))

    @property
    def asking(self) -> bool:  # constraints not yet taken by take_asks
        return bool(self._asks)

    def take_asks(self) -> list[StructuredOutput]:
        """The constraints to send to the rank (each once until answered, or again after :meth:`restart`)."""
        asks, self._asks = self._asks, []
        return asks

    def release(self, key: tuple[str, str], error: str | None, queue: MutableSequence[Request]
                ) -> list[tuple[Request, float]]:
        """The rank answered for ``key``: its held requests join ``queue`` at their arrival places (each ahead of the
        requests at its back that arrived after it), and ``key`` counts as ready from now on; or it could not compile
        the grammar (``error``): they finish with it (``finish_reason="error"``, as a row that failed in a worker).
        Each with the seconds it waited, oldest first."""
        self._asked.pop(key, None)
        if error is None:
            self._ready[key] = None
            self._ready.move_to_end(key)
            while len(self._ready) > self.size:
                self._ready.popitem(last=False)
        now = self.clock()
        released = [(req, now - since) for req, since in self._held.pop(key, [])]
        for req, _ in released:
            if error is None:
                at = len(queue)
                while at and queue[at - 1].queue_order > req.queue_order:
                    at -= 1
                queue.insert(at, req)
            else:
                req.state, req.finish_reason, req.error = "finished", "error", error
        return released

    def remove(self, request_id: str) -> Request | None:
        """Abort a held request (``finish_reason="abort"``) and return it; None if none is held by that id."""
        for key, held in self._held.items():
            for i, (req, _) in enumerate(held):
                if req.request_id == request_id:
                    del held[i]
                    if not held:  # the rank's answer, when it comes, releases nobody
                        del self._held[key]
                    req.state, req.finish_reason = "finished", "abort"
                    return req
        return None

    def drain(self) -> list[Request]:
        """Every held request, taken out (shutdown, or no workers left: the caller finishes them)."""
        out = [req for held in self._held.values() for req, _ in held]
        self._held.clear()
        return out

    def restart(self) -> None:
        """A new worker group holds no grammar: nothing counts as ready, and every constraint not yet answered is
        asked again."""
        self._ready.clear()
        self._asks = list(self._asked.values())
