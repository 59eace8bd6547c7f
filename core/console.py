"""What the ``tightfit`` command shows a person: logging set-up, progress and the terminal's width.

Messages go through :mod:`logging` (logger ``"tightfit"``): ``-q`` keeps warnings and errors, ``-v``
adds debug lines. Progress is a ``tqdm`` bar when stderr is a terminal and one log line per stage
otherwise (a CI log or ``| tee`` file gets no ``\\r`` frames). Tables are fitted to the terminal's
width (``$COLUMNS`` or the real size; 120 columns when stdout is not a terminal).

Example:
    >>> report = progress("plan", tty=False)
    >>> report(1, 4, "greedy descent")  # logs "[plan] greedy descent (1/4)" at INFO
    >>> report.close()
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["setup_logging", "progress", "Progress", "terminal_width", "fit_text", "drop_framework_tips", "heartbeat", "log",
           "reporter"]

log = logging.getLogger("tightfit")

# Wide enough for the plan tables' essential columns, narrow enough for a side-by-side terminal;
# used when stdout is a file or a pipe and $COLUMNS is not set.
DEFAULT_WIDTH = 120


def setup_logging(verbosity: int = 0) -> None:
    """Route the ``tightfit`` logger to stderr: ``verbosity`` -1 = warnings only, 0 = info, 1+ = debug."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s" if verbosity < 1 else "%(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted (a test's capture, a redirect
    made after import), not the stream that was current when the handler was made."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


def reporter(logger: logging.Logger, label: str, enabled: bool = True) -> Callable[[str], None]:
    """``say(msg)`` for a library call's ``progress=True``: logs ``[label] msg`` at INFO on ``logger``.

    Asking for progress should show it, so when no handler would receive the record (nothing configured: not
    the ``tightfit`` CLI's :func:`setup_logging`, not the application's ``logging.basicConfig``, not pytest),
    ``logger`` gets a stderr handler at INFO once, as Lightning does for its own logger. Otherwise the
    application's logging decides (its level, its format, its files). ``enabled=False`` gives a no-op.

        >>> say = reporter(logging.getLogger("tightfit.doc"), "doc", enabled=False)
        >>> say("nothing is logged")
    """
    if not enabled:
        return lambda msg: None
    if not logger.hasHandlers():
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    return lambda msg: logger.info("[%s] %s", label, msg)


def terminal_width() -> int:
    """Columns to fit a table into: ``$COLUMNS``, the terminal's width, or 120 when stdout is not a terminal."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def drop_framework_tips() -> None:
    """Drop Lightning's advertising lines ("💡 Tip: ... try installing litlogger", 232 characters, once per
    Trainer) from its rank-zero logger; its other messages are kept. Used by the demos and examples."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in logger.filters):
        logger.addFilter(_NoTips())


def heartbeat(label: str, every_s: float = 3.0) -> Any:
    """A Lightning callback: rank 0 says it is alive every ``every_s`` seconds until fit's ``setup`` hook.

    Until then Lightning starts the second process, which imports torch and Lightning again (seconds of
    silence on a busy machine) before the group forms. Lightning is imported here, on call, so that core
    keeps importing without it.
    """
    import threading

    import lightning as L

    class Heartbeat(L.Callback):
        def __init__(self) -> None:
            self._done, self._start = threading.Event(), time.perf_counter()
            if os.environ.get("LOCAL_RANK", "0") == "0":
                threading.Thread(target=self._beat, daemon=True).start()

        def _beat(self) -> None:
            while not self._done.wait(every_s):
                print(f"[{label}] starting the second process ({time.perf_counter() - self._start:.0f} s)",
                      flush=True)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._done.set()

    return Heartbeat()


def fit_text(text: str, width: int | None = None) -> str:
    """``text`` with every line longer than ``width`` (default: :func:`terminal_width`) wrapped at spaces,
    continuation lines indented by 4; shorter lines (table rows) are left as they are.

        >>> print(fit_text("short\\nthe quick brown fox jumps", width=13))
        short
        the quick
            brown fox
            jumps
    """
    import textwrap

    width = width or terminal_width()
    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
        else:
            out += textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False,
                                 break_long_words=False) or [line]
    return "\n".join(out)


class Progress:
    """A ``progress(done, total, what)`` callback: a tqdm bar on a terminal, a log line per stage elsewhere.

    A "stage" is a change of ``what``; within one stage a line is logged at most every
    ``every_s`` seconds so a long stage still shows it is alive.
    """

    def __init__(self, label: str, *, tty: bool | None = None, every_s: float = 5.0) -> None:
        self.label = label
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every_s = every_s
        self._bar: Any = None
        self._stage = ""
        self._last = 0.0
        self._start = time.perf_counter()

    def __call__(self, done: int, total: int, what: str) -> None:
        if self.tty and log.isEnabledFor(logging.INFO):
            self._draw(done, total, what)
            return
        now = time.perf_counter()
        if what != self._stage or now - self._last >= self.every_s or done >= total:
            self._stage, self._last = what, now
            log.info("[%s] %s (%d/%d, %.1f s)", self.label, what, done, total, now - self._start)

    def _draw(self, done: int, total: int, what: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # no tqdm: a line per stage on the terminal too
            self.tty = False
            self(done, total, what)
            return
        if self._bar is None or self._bar.total != total:
            self.close()
            self._bar = tqdm(total=total, desc=f"[{self.label}]", leave=False, dynamic_ncols=True, file=sys.stderr)
        self._bar.set_postfix_str(what[:40], refresh=False)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress(label: str, *, tty: bool | None = None) -> Progress:
    """A :class:`Progress` callback labelled ``label`` (``tty=None``: detect from stderr)."""
    return Progress(label, tty=tty)
