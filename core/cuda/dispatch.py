"""Pick a kernel's Triton implementation or its pure-PyTorch reference, per call.

The rule (``choose_backend``):

1. ``backend=`` given to the call wins, then the environment variable ``TIGHTFIT_KERNELS``
   (``reference`` or ``triton``; unset or ``auto`` means decide).
2. ``auto``: Triton when every tensor argument is on a CUDA device and Triton imports; the reference
   otherwise (CPU tensors, no Triton, a Triton that fails to import).
3. A forced ``triton`` with CPU tensors is allowed only under Triton's interpreter
   (``TRITON_INTERPRET=1``, how the tests run kernels on CPU); otherwise it raises, naming the fix.

Triton is never imported by this module at import time: :func:`triton_available` imports it on
first use and caches the answer, so ``import tightfit`` works where Triton is not installed.

Example:
    >>> import torch
    >>> from tightfit.cuda.dispatch import Kernel
    >>> double = Kernel("double_demo", reference=lambda x: x * 2, triton=lambda x: x * 2)
    >>> double(torch.ones(2)).tolist()      # CPU tensor -> the reference
    [2.0, 2.0]
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "ENV_VAR",
    "BACKENDS",
    "Backend",
    "KernelError",
    "Kernel",
    "triton_available",
    "triton_import_error",
    "interpreter_enabled",
    "forced_backend",
    "choose_backend",
    "register_kernel",
    "get_kernel",
    "kernel_names",
]

ENV_VAR = "TIGHTFIT_KERNELS"
BACKENDS = ("reference", "triton")
Backend = Literal["reference", "triton"]


class KernelError(RuntimeError):
    """A kernel cannot run as asked (backend unavailable, bad arguments, duplicate name)."""


@functools.cache
def _probe_triton() -> str:
    """'' when ``import triton`` works, else the error text (cached: imported once per process)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # a broken install (e.g. a CUDA mismatch) counts as absent
        return f"{type(exc).__name__}: {exc}"
    return ""


def triton_available() -> bool:
    """Whether Triton imports here (imports it the first time it is asked)."""
    return _probe_triton() == ""


def triton_import_error() -> str:
    """Why Triton is unavailable ('' when it is available)."""
    return _probe_triton()


def interpreter_enabled() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, set before import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0", "false", "False")


def forced_backend() -> Backend | None:
    """The backend ``TIGHTFIT_KERNELS`` forces, or ``None`` (unset or ``auto``). Read on every call."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise KernelError(
            f"{ENV_VAR}={value!r} is not a kernel backend: use one of {', '.join(BACKENDS)} or 'auto' "
            f"(or unset {ENV_VAR})"
        )
    return value  # type: ignore[return-value]


def choose_backend(*tensors: torch.Tensor, backend: str | None = None, name: str = "kernel") -> Backend:
    """The backend a kernel call on ``tensors`` uses (see the module docstring for the rule)."""
    if backend is not None and backend not in (*BACKENDS, "auto"):
        raise KernelError(f"{name}: backend={backend!r} is not one of {', '.join(BACKENDS)}, 'auto'")
    wanted = forced_backend() if backend in (None, "auto") else backend
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if wanted == "reference":
        return "reference"
    if wanted == "triton":
        if not triton_available():
            raise KernelError(
                f"{name}: the Triton backend was forced ({ENV_VAR} or backend=) but Triton does not import "
                f"({triton_import_error()}); install it with `pip install 'tightfit[kernels]'` or use "
                f"{ENV_VAR}=reference"
            )
        if not on_cuda and not interpreter_enabled():
            devices = sorted({str(t.device) for t in tensors})
            raise KernelError(
                f"{name}: the Triton backend was forced but the tensors are on {', '.join(devices) or 'no device'}; "
                "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before Triton is imported to run "
                f"them on the CPU interpreter (slow; for tests), or {ENV_VAR}=reference"
            )
        return "triton"
    return "triton" if on_cuda and triton_available() else "reference"


@dataclass(frozen=True)
class Kernel:
    """One op with two implementations of the same signature; calling it dispatches.

    Args:
        name: registry key (``"gather_rows"``).
        reference: the pure-PyTorch implementation (any device; the ground truth in tests).
        triton: the Triton launcher; it imports Triton itself (inside the function), so defining a
            :class:`Kernel` never imports Triton.
        doc: one line for listings.

    Every positional or keyword tensor argument takes part in the device check. ``backend=`` on a
    call overrides the environment for that call.
    """

    name: str
    reference: Callable[..., Any]
    triton: Callable[..., Any]
    doc: str = ""

    def backend_for(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Backend:
        """The backend a call with these arguments would use."""
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        return choose_backend(*tensors, backend=backend, name=self.name)

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        chosen = self.backend_for(*args, backend=backend, **kwargs)
        impl = self.triton if chosen == "triton" else self.reference
        return impl(*args, **kwargs)


_REGISTRY: dict[str, Kernel] = {}


def register_kernel(name: str, *, reference: Callable[..., Any], triton: Callable[..., Any], doc: str = "") -> Kernel:
    """Create and register a :class:`Kernel`; a second kernel under the same name raises."""
    if name in _REGISTRY:
        raise KernelError(f"a kernel named {name!r} is already registered; pick another name")
    kernel = Kernel(name, reference=reference, triton=triton, doc=doc)
    _REGISTRY[name] = kernel
    return kernel


def get_kernel(name: str) -> Kernel:
    """The registered kernel ``name``; an unknown name raises listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none (import the module that defines it)"
        raise KernelError(f"unknown kernel {name!r}; registered kernels: {known}") from None


def kernel_names() -> list[str]:
    """Names of the registered kernels (those whose modules have been imported)."""
    return sorted(_REGISTRY)
