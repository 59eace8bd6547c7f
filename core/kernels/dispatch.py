"""Pick a kernel's Triton implementation, its native CPU implementation or its pure-PyTorch reference, per call.

The rule (``choose_backend``):

1. ``backend=`` given to the call wins, then the environment variable ``TIGHTFIT_KERNELS``
   (``reference``, ``triton`` or ``native``; unset or ``auto`` means decide).
2. ``auto``: Triton when every tensor argument is on a CUDA device and Triton imports; the native CPU
   backend when no tensor is on CUDA and the kernel has one that builds here (C compiled on first use,
   :mod:`tightfit.kernels.native`); the reference otherwise.
3. A forced ``triton`` with CPU tensors is allowed only under Triton's interpreter
   (``TRITON_INTERPRET=1``, how the tests run kernels on CPU); otherwise it raises, naming the fix.
4. A forced ``native`` raises when the library cannot be built or a tensor is on CUDA; through the
   environment it applies only to kernels that have a native backend (the others decide as ``auto``).

Self-check (``TIGHTFIT_KERNEL_CHECK``, on unless set to ``0``): the first time a kernel is sent to
Triton or native code by the rule above (``auto``, or ``TIGHTFIT_KERNELS=triton|native``) for a given
*shape class* (dtypes, ranks and the kernel's own layout keys, e.g. the column count) on a given
device, both backends run on a small probe input of that class and their results are compared
(``atol = rtol`` = 1e-4 fp32, 1e-2 fp16, 5e-2 bf16: loose enough for another summation order, while a
wrong kernel is off by O(1); integers exactly). A difference or an exception falls that class back to
the reference for the rest of the process, with one :class:`KernelCheckWarning` naming the kernel,
the class and the error. A call with an explicit ``backend="triton"`` is never checked: that is how
tests and benchmarks compare the raw kernel with its reference. :func:`kernel_checks` lists every
verdict (``make gpu-check`` reports them). The check costs one small launch of each backend per
class and one host sync; a class has a handful of members in practice (dtypes x layouts).

A model whose layers repeat the same calls (same kernels, shapes, dtypes and devices in every layer of a
step) can run them under :func:`repeated_calls`: there each kernel decides (and self-checks) on its first
call only and later calls go straight to that implementation, which saves the per-call decision (microseconds,
two dozen times a decode step).

Triton is never imported by this module at import time: :func:`triton_available` imports it on
first use and caches the answer, so ``import tightfit`` works where Triton is not installed.

Example:
    >>> import torch
    >>> from tightfit.kernels.dispatch import Kernel
    >>> double = Kernel("double_demo", reference=lambda x: x * 2, triton=lambda x: x * 2)
    >>> double(torch.ones(2)).tolist()      # CPU tensor -> the reference
    [2.0, 2.0]
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "ENV_VAR",
    "CHECK_ENV_VAR",
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
    "KernelCheck",
    "KernelCheckWarning",
    "check_enabled",
    "kernel_checks",
    "reset_kernel_checks",
    "repeated_calls",
]

ENV_VAR = "TIGHTFIT_KERNELS"
CHECK_ENV_VAR = "TIGHTFIT_KERNEL_CHECK"
BACKENDS = ("reference", "triton", "native")
Backend = Literal["reference", "triton", "native"]


class KernelError(RuntimeError):
    """A kernel cannot run as asked (backend unavailable, bad arguments, duplicate name)."""


class KernelCheckWarning(RuntimeWarning):
    """A Triton or native kernel disagreed with its reference on its first-use probe; the reference runs instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelCheck:
    """The verdict of one first-use self-check.

    Args:
        kernel: the kernel's registry name.
        shape_class: the class of inputs it covers (see :class:`Kernel` ``shape_class``).
        device: the device of the inputs (``"cuda:0"``).
        passed: the kernel agreed with the reference on the probe: calls of this class run it.
        error: why it failed (the first mismatch or the exception), ``""`` when it passed.
    """

    kernel: str
    shape_class: Hashable
    device: str
    passed: bool
    error: str = ""


# (kernel name, shape class, device) -> verdict; filled on first use, read by every later call.
_CHECKS: dict[tuple[str, Hashable, str], KernelCheck] = {}
# (kernel name, TIGHTFIT_KERNELS, TIGHTFIT_KERNEL_CHECK, each tensor's is_cuda) -> (the backend the rule
# picked for that combination, whether self-checks are on).
_DECIDED: dict[tuple, tuple[Backend, bool]] = {}
# (kernel name, shape class, torch.device) -> the verdict's ``passed``: _CHECKS without formatting the device.
_PASSED: dict[tuple, bool] = {}


class _Repeat(threading.local):
    # kernel name -> the implementation its first call under repeated_calls() chose (None: not in a block).
    chosen: dict[str, Callable[..., Any]] | None = None


_REPEAT = _Repeat()


@contextlib.contextmanager
def repeated_calls() -> Iterator[None]:
    """Within this block (on this thread), each kernel reuses its first call's implementation.

    For callers that repeat the same calls, e.g. every layer of a model in one step: tensors of the same
    dtypes, shapes and devices, and the environment unchanged. A call with ``backend=`` still decides
    for itself. Blocks nest; the inner one starts afresh.
    """
    outer = _REPEAT.chosen
    _REPEAT.chosen = {}
    try:
        yield
    finally:
        _REPEAT.chosen = outer


def check_enabled() -> bool:
    """Whether first-use self-checks run (``TIGHTFIT_KERNEL_CHECK``, default on; ``0`` turns them off)."""
    return os.environ.get(CHECK_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def kernel_checks() -> list[KernelCheck]:
    """Every self-check verdict reached in this process, in the order they were reached."""
    return list(_CHECKS.values())


def reset_kernel_checks() -> None:
    """Forget every verdict (the next call of each class is checked again); for tests and benchmarks."""
    _CHECKS.clear()
    _PASSED.clear()


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


def choose_backend(*tensors: torch.Tensor, backend: str | None = None, name: str = "kernel",
                   native_error: Callable[[], str] | None = None, has_triton: bool = True) -> Backend:
    """The backend a kernel call on ``tensors`` uses (see the module docstring for the rule).

    ``native_error`` is the kernel's "why its native library is unavailable" ('' when it is); ``None``: the
    kernel has no native backend. ``has_triton=False``: the kernel has no Triton backend (CUDA tensors then
    take the reference, and forcing Triton on it raises).
    """
    if backend is not None and backend not in (*BACKENDS, "auto"):
        raise KernelError(f"{name}: backend={backend!r} is not one of {', '.join(BACKENDS)}, 'auto'")
    from_env = backend in (None, "auto")
    wanted = forced_backend() if from_env else backend
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    any_cuda = any(t.is_cuda for t in tensors)
    if wanted == "reference":
        return "reference"
    if wanted == "native" and not (from_env and (native_error is None or any_cuda)):
        if native_error is None:
            raise KernelError(f"{name}: backend='native' was asked for but this kernel has no native CPU backend; "
                              "use 'reference' or 'auto'")
        if any_cuda:
            raise KernelError(f"{name}: the native backend runs on CPU tensors only; these are on CUDA. Use "
                              "'triton', 'reference' or 'auto'")
        why = native_error()
        if why:
            raise KernelError(f"{name}: the native backend was forced ({ENV_VAR} or backend=) but it cannot be "
                              f"built here ({why}); use {ENV_VAR}=reference or install a C compiler")
        return "native"
    if wanted == "triton" and not has_triton:
        if not from_env:
            raise KernelError(f"{name}: backend='triton' was asked for but this kernel has no Triton backend; use "
                              "'reference', 'native' or 'auto'")
        wanted = None
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
    if on_cuda and has_triton and triton_available():
        return "triton"
    if not any_cuda and native_error is not None and not native_error():
        return "native"
    return "reference"


@dataclass(frozen=True)
class Kernel:
    """One op with two or three implementations of the same signature; calling it dispatches.

    Args:
        name: registry key (``"gather_rows"``).
        reference: the pure-PyTorch implementation (any device; the ground truth in tests).
        triton: the Triton launcher; it imports Triton itself (inside the function), so defining a
            :class:`Kernel` never imports Triton. ``None`` for a kernel with only a native CPU backend
            (CUDA tensors then take the reference).
        doc: one line for listings.
        native: the native CPU launcher (optional; see :mod:`tightfit.kernels.native`).
        native_error: ``() -> str``, why the native library is unavailable ('' when it is); required with ``native``.

        shape_class: ``(*args, **kwargs) -> hashable``: which inputs one self-check covers. Default:
            each tensor argument's dtype and rank, and every non-tensor argument.
        probe: ``(*args, **kwargs) -> (args, kwargs)``: a small input of the same shape class for the
            self-check. Default: clones of the call's own arguments (fine for small inputs only).

    Every positional or keyword tensor argument takes part in the device check. ``backend=`` on a
    call overrides the environment for that call (and skips the self-check).
    """

    name: str
    reference: Callable[..., Any]
    triton: Callable[..., Any] | None
    doc: str = ""
    shape_class: Callable[..., Hashable] | None = None
    probe: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    native: Callable[..., Any] | None = None
    native_error: Callable[[], str] | None = None

    def backend_for(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Backend:
        """The backend a call with these arguments would use."""
        return self._rule(_tensors_of(args, kwargs), backend)

    def _rule(self, tensors: list[torch.Tensor], backend: str | None) -> Backend:
        return choose_backend(*tensors, backend=backend, name=self.name,
                              native_error=self.native_error if self.native is not None else None,
                              has_triton=self.triton is not None)

    def __call__(self, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        repeat = _REPEAT.chosen
        if backend is None and repeat is not None:
            impl = repeat.get(self.name)
            if impl is None:
                impl = repeat[self.name] = self._impl(self._decide(args, kwargs))
            return impl(*args, **kwargs)
        if backend in (None, "auto"):
            chosen = self._decide(args, kwargs)
        else:
            chosen = self._rule(_tensors_of(args, kwargs), backend)
        return self._impl(chosen)(*args, **kwargs)

    def _decide(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Backend:
        """The backend ``auto`` gives this call (the environment's choice, self-checked on first use)."""
        # The rule's inputs are the environment and where the tensors are (Triton's and the native
        # library's availability are fixed per process; Triton reads TRITON_INTERPRET at import): its
        # answer is remembered per combination. A model calls a handful of kernels per layer, and
        # deciding afresh cost a noticeable share of a small model's decode step.
        env = os.environ
        tensors = _tensors_of(args, kwargs)
        key = (self.name, env.get(ENV_VAR), env.get(CHECK_ENV_VAR), *(t.is_cuda for t in tensors))
        decided = _DECIDED.get(key)
        if decided is None:
            decided = _DECIDED[key] = (self._rule(tensors, None), check_enabled())
        chosen, check = decided
        if chosen != "reference" and check and not self._verified(chosen, args, kwargs, tensors):
            chosen = "reference"
        return chosen

    def _impl(self, backend: str) -> Callable[..., Any]:
        if backend == "native" and self.native is not None:
            return self.native
        if backend == "triton" and self.triton is not None:
            return self.triton
        return self.reference

    # ---- first-use self-check ----------------------------------------------------------------------
    def _verified(self, backend: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  tensors: list[torch.Tensor]) -> bool:
        """Whether ``backend`` may run this call's class (checking it now if it is the first of its class)."""
        cls = self.shape_class(*args, **kwargs) if self.shape_class is not None else _default_class(args, kwargs)
        fast_key = (self.name, cls, tensors[0].device if tensors else None)
        passed = _PASSED.get(fast_key)
        if passed is not None:  # the common case, without formatting the device's name
            return passed
        device = str(tensors[0].device) if tensors else "none"
        key = (self.name, cls, device)
        verdict = _CHECKS.get(key)
        if verdict is None:
            error = self._compare_on_probe(args, kwargs, backend)
            verdict = _CHECKS[key] = KernelCheck(kernel=self.name, shape_class=cls, device=device,
                                                 passed=not error, error=error)
            if error:
                warnings.warn(
                    f"kernel {self.name!r}: the {backend} result differs from the reference on its first-use check "
                    f"(class {cls}, {device}): {error}; using the reference for this class from now on. Report it "
                    f"with this message; {ENV_VAR}=reference silences the check, {CHECK_ENV_VAR}=0 skips it",
                    KernelCheckWarning, stacklevel=3)
        _PASSED[fast_key] = verdict.passed
        return verdict.passed

    def _compare_on_probe(self, args: tuple[Any, ...], kwargs: dict[str, Any], backend: str = "triton") -> str:
        """'' when both backends agree on a probe of this call's class, else what went wrong."""
        try:
            p_args, p_kwargs = (self.probe(*args, **kwargs) if self.probe is not None
                                else ([_clone(a) for a in args], {k: _clone(v) for k, v in kwargs.items()}))
            t_args, t_kwargs = [_clone(a) for a in p_args], {k: _clone(v) for k, v in p_kwargs.items()}
            r_args, r_kwargs = [_clone(a) for a in p_args], {k: _clone(v) for k, v in p_kwargs.items()}
            got = self._impl(backend)(*t_args, **t_kwargs)
            want = self.reference(*r_args, **r_kwargs)
            pairs = [("result", got, want), *((f"argument {i}", a, b) for i, (a, b) in enumerate(zip(t_args, r_args))),
                     *((f"argument {k!r}", t_kwargs[k], r_kwargs[k]) for k in r_kwargs)]
            for what, a, b in pairs:
                for x, y in zip(_tensors(a), _tensors(b)):
                    if x.shape != y.shape or x.dtype != y.dtype:
                        return (f"{what}: {backend} gave {x.dtype} {tuple(x.shape)}, reference {y.dtype} "
                                f"{tuple(y.shape)}")
                    tol = _CHECK_TOL.get(y.dtype, 0.0)
                    close = torch.isclose(x, y, atol=tol, rtol=tol, equal_nan=True)
                    if not bool(close.all()):
                        bad = int((~close).sum())
                        diff = (x.double() - y.double()).abs().nan_to_num(float("inf")).max().item()
                        return f"{what}: {bad} of {y.numel()} elements differ (max abs difference {diff:.3g})"
        except Exception as exc:  # a kernel that cannot even run on this class falls back too
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return ""


# atol = rtol of the self-check per dtype (integers and bools: exact).
_CHECK_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _tensors_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensor arguments of a call, positional then keyword (the ones the backend rule looks at)."""
    if kwargs:
        return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return [x for x in args if isinstance(x, torch.Tensor)]


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _default_class(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    def key(x: Any) -> Hashable:
        if isinstance(x, torch.Tensor):
            return (str(x.dtype), x.dim())
        return x if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__
    return (tuple(key(a) for a in args), tuple((k, key(v)) for k, v in sorted(kwargs.items())))


_REGISTRY: dict[str, Kernel] = {}


def register_kernel(name: str, *, reference: Callable[..., Any], triton: Callable[..., Any] | None, doc: str = "",
                    shape_class: Callable[..., Hashable] | None = None,
                    probe: Callable[..., tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
                    native: Callable[..., Any] | None = None,
                    native_error: Callable[[], str] | None = None) -> Kernel:
    """Create and register a :class:`Kernel`; a second kernel under the same name raises.

    ``shape_class`` and ``probe`` shape its first-use self-check (see :class:`Kernel`); ``native`` and
    ``native_error`` give it a native CPU backend.
    """
    if name in _REGISTRY:
        raise KernelError(f"a kernel named {name!r} is already registered; pick another name")
    if (native is None) != (native_error is None):
        raise KernelError(f"kernel {name!r}: give native and native_error together (or neither)")
    kernel = Kernel(name, reference=reference, triton=triton, doc=doc, shape_class=shape_class, probe=probe,
                    native=native, native_error=native_error)
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
