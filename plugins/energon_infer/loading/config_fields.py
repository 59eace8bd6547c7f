"""Reading one ``config.json`` field: the two errors and the number checks every family's reader shares.

Every check names the field as ``config.json`` names it and the fix, so a bad value is refused in one line at
load, never as a ``KeyError`` or a ``ZeroDivisionError`` from deep in the model.

Example:
    >>> whole(12, "num_hidden_layers"), real(1e-6, "rms_norm_eps")
    (12, 1e-06)
    >>> refuse("qwen3", "rope_type", "foo", "use one of default, linear")
    Traceback (most recent call last):
    ...
    energon_infer.loading.config_fields.UnsupportedModelError: qwen3: rope_type='foo' is not supported; use one of default, linear
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from energon_infer.errors import BadInputError

__all__ = ["ConfigError", "UnsupportedModelError", "divides", "eos_ids", "or_default", "real", "refuse", "required",
           "whole"]


class UnsupportedModelError(BadInputError, ValueError):
    """The checkpoint's architecture or one of its options is not one this runtime implements."""


class ConfigError(BadInputError, ValueError):
    """``config.json`` (or a :class:`~energon_infer.loading.config.ModelConfig`) holds a value of the wrong type or
    out of range."""


def refuse(model_type: str, option: str, value: Any, fix: str) -> NoReturn:
    """Raise :class:`UnsupportedModelError` for an option of a supported family this runtime does not run:
    the family, the option, the value and the fix, in one line."""
    raise UnsupportedModelError(f"{model_type}: {option}={value!r} is not supported; {fix}")


def or_default(value: object, default: int) -> object:
    """GPT-2's "null or 0 means the default" (an empty string or False is a mistake, not a default)."""
    return default if value is None or (type(value) is int and value == 0) else value


def whole(value: Any, name: str, *, low: int = 1) -> int:
    """``value`` as a whole number >= ``low``; a bool, a string or ``2.5`` raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and (not math.isfinite(value) or value != int(value))):
        raise ConfigError(f"{name}={value!r} must be a whole number >= {low}; fix config.json "
                          "(numbers without quotes, e.g. 12)")
    if value < low:
        raise ConfigError(f"{name}={value!r} must be a whole number >= {low}; fix config.json")
    return int(value)


def real(value: Any, name: str, *, positive: bool = True) -> float:
    """``value`` as a finite float (> 0 when ``positive``); raises naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            positive and not value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number{' > 0' if positive else ''}; fix config.json "
                          "(e.g. 1e-5 for a norm epsilon, 10000.0 for rope_theta)")
    return float(value)


def required(raw: dict[str, Any], key: str) -> int:
    """Required whole-number field ``key`` of config.json, named as config.json names it."""
    if key not in raw:
        raise ConfigError(f"config.json has no {key!r}, which model_type {raw.get('model_type')!r} needs; "
                          "save the config with transformers' save_pretrained")
    return whole(raw[key], key)


def eos_ids(value: Any) -> tuple[int, ...]:
    """``eos_token_id`` (a token id, a list of them, or null) as a tuple."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigError(f"eos_token_id={value!r} must be a token id or a list of token ids; fix config.json")
    return tuple(value)


def divides(size: int, heads: int, size_name: str, heads_name: str) -> None:
    if size % heads:
        raise ConfigError(f"{size_name}={size} is not divisible by {heads_name}={heads}: every head gets "
                          f"{size_name} / {heads_name} features; fix config.json")
