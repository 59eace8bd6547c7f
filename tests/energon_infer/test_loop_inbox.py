"""The streams' inbox: token events from the controller thread reach the event loop in order, each to its own
stream, and the events handed out while the loop has not yet run cost one wake-up of the loop together."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future

from hypothesis import given, settings
from hypothesis import strategies as st

from energon_infer.engine.delivery import Completion, TokenEvent
from energon_infer.serving.openai_format import CompletionReply
from energon_infer.serving.streaming import LoopInbox, TokenStream


class CountingInbox(LoopInbox):
    """A real inbox that counts its wake-ups of the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(loop)
        self.wakeups = 0

    def _deliver(self) -> None:
        self.wakeups += 1
        super()._deliver()


def _event(rid: str, k: int, last: bool) -> TokenEvent:
    done = Completion(rid, [1], list(range(k + 1)), "", "length", 0.0, 0.0, 0.0) if last else None
    return TokenEvent(rid, k, f"<{rid}:{k}>", "length" if last else None, done)


def _stream(inbox: LoopInbox) -> TokenStream:
    s = TokenStream(CompletionReply("cmpl-x", "m", [""], 1, None), include_usage=False, prompt_tokens=1,
                    closing_since=lambda: None, drain_timeout_s=1.0)
    s._inbox = inbox  # every stream of the test on the counting inbox
    return s


async def _texts(stream: TokenStream) -> list[str]:
    out = []
    async for chunk in stream.body([Future()]):  # one choice
        line = chunk.decode()
        if line.startswith("data: {"):
            out.append(json.loads(line[6:])["choices"][0]["text"])
    return out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_a_batch_handed_out_before_the_loop_runs_costs_one_wakeup(lengths):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        inbox = CountingInbox(loop)
        streams = [_stream(inbox) for _ in lengths]
        bodies = [asyncio.ensure_future(_texts(s)) for s in streams]
        await asyncio.sleep(0)  # every body waits for its first event

        def controller() -> None:  # one step's tokens per round, as the controller hands them out
            for k in range(max(lengths)):
                for i, n in enumerate(lengths):
                    if k < n:
                        streams[i].listener(0)(_event(f"r{i}", k, k == n - 1))

        thread = threading.Thread(target=controller)
        thread.start()
        thread.join()  # the loop did not run meanwhile: everything waits in the inbox
        texts = await asyncio.gather(*bodies)
        assert texts == [[f"<r{i}:{k}>" for k in range(n)] for i, n in enumerate(lengths)]
        assert inbox.wakeups == 1
        late = _stream(inbox)  # a later event wakes the loop again
        body = asyncio.ensure_future(_texts(late))
        await asyncio.sleep(0)
        threading.Thread(target=late.listener(0), args=(_event("z", 0, True),)).start()
        assert await asyncio.wait_for(body, 5) == ["<z:0>"] and inbox.wakeups == 2

    asyncio.run(main())


def test_events_after_the_loop_closed_are_dropped_without_an_error():
    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    loop.close()
    stream = object.__new__(TokenStream)  # never read: its loop is gone
    inbox.put(stream, (0, _event("a", 0, False)))
    inbox.put(stream, (0, _event("a", 1, False)))
    assert not inbox._pending


def test_one_inbox_per_loop():
    async def main() -> tuple[LoopInbox, LoopInbox]:
        loop = asyncio.get_running_loop()
        return LoopInbox.of(loop), LoopInbox.of(loop)

    a, b = asyncio.run(main())
    c, _ = asyncio.run(main())
    assert a is b and c is not a
