"""energon's error family: every exception energon raises on purpose is an :class:`EnergonError`.

Each class carries the HTTP status a client gets when it reaches the server (``http_status``), so the
server maps an error by its class, not by guessing from a builtin base: anything that is *not* an
:class:`EnergonError` is a bug and answers 500 (logged with its traceback), even a ``ValueError``.
The classes keep their builtin base too (``class ConfigError(BadInputError, ValueError)``), so code
that catches ``ValueError`` / ``RuntimeError`` / ``KeyError`` still works. The CLI (``tightfit serve``)
ends with exit code 2 and one line for an :class:`EnergonError`, with a traceback and 1 for anything else.

The statuses, by what went wrong:

* 400 :class:`BadInputError`: a value the caller gave breaks a rule (the message names the fix);
* 429 :class:`BusyError`: no room now, the same request succeeds later (``Retry-After``);
* 503 :class:`UnavailableError`: no workers to run it (failed, restarting, shut down);
* 500 :class:`EnergonError` itself: energon's own side failed (a worker could not finish one request).

Example:
    >>> from energon_infer.scheduling.scheduler_config import QueueFullError
    >>> err = QueueFullError(4, 4)
    >>> isinstance(err, EnergonError), isinstance(err, RuntimeError), err.http_status
    (True, True, 429)
"""

from __future__ import annotations

from typing import Any, get_args

__all__ = ["EnergonError", "BadInputError", "BusyError", "UnavailableError", "InvalidRequestError", "OptionError",
           "UnknownOptionError", "MissingFileError", "ContextLengthError", "check_choice"]


class EnergonError(Exception):
    """Base of every error energon raises on purpose; ``http_status`` is what the server answers for it."""

    http_status: int = 500


class BadInputError(EnergonError):
    """A value the caller gave (a request, an option, a checkpoint) breaks a rule; HTTP 400."""

    http_status = 400


class BusyError(EnergonError):
    """No room now; the same call succeeds later (HTTP 429 with ``Retry-After``)."""

    http_status = 429


class UnavailableError(EnergonError):
    """No worker group can run the request: it failed, is restarting or was shut down (HTTP 503)."""

    http_status = 503


class InvalidRequestError(BadInputError, ValueError):
    """A request that can never run as given: an empty or too long prompt, token ids outside the vocabulary."""


class ContextLengthError(BadInputError, ValueError):
    """A sequence would grow past the model's context (:class:`~energon_infer.worker.runtime.ModelRunner`)."""


class OptionError(BadInputError, ValueError):
    """An engine option (a field of :class:`~energon_infer.engine.engine_config.EngineConfig` or one of its parts)
    breaks a rule; the message names the field, the value and what it may be."""


class UnknownOptionError(BadInputError, TypeError):
    """A keyword that names no option; the message lists the known ones."""


class MissingFileError(BadInputError, FileNotFoundError):
    """A model directory, checkpoint or ``config.json`` the caller named is not there."""


def check_choice(name: str, value: Any, choices: Any) -> None:
    """Raise :class:`OptionError` in one line unless ``value`` is one of ``choices`` (a ``Literal[...]`` or a tuple).

    Example:
        >>> from typing import Literal
        >>> check_choice("policy", "greedy", Literal["continuous", "static"])
        Traceback (most recent call last):
        ...
        energon_infer.errors.OptionError: policy='greedy' must be one of ('continuous', 'static')
    """
    allowed = get_args(choices) or tuple(choices)
    if value not in allowed:
        raise OptionError(f"{name}={value!r} must be one of {allowed}")
