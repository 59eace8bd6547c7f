"""tightfit's kernels: Triton and native CPU kernels, each beside a pure-PyTorch reference, and one dispatcher.

One op per module here (the launchers, references and registration); ``cpu/`` holds the native kernels' C
sources (read by :mod:`tightfit.kernels.sources`, built on first use by :mod:`tightfit.kernels.native`).

A call runs the Triton kernel when every tensor argument is on CUDA and Triton imports, the native
CPU kernel when no tensor is on CUDA and the kernel has one, the reference otherwise; ``TIGHTFIT_KERNELS=reference|triton|native`` (or ``backend=``
on a call) forces one (see :mod:`tightfit.kernels.dispatch`). The first Triton call of each shape class on a device is
checked against the reference on a small probe; a disagreement falls back to the reference with a
:class:`KernelCheckWarning` (:func:`kernel_checks` lists the verdicts). Importing this package never imports Triton.

Kernels here: :mod:`tightfit.kernels.index_rows` (``gather_rows``, ``scatter_rows``, ``scatter_add_rows``),
:mod:`tightfit.kernels.varlen_attention` (``paged_attention``, ``store_kv``; native: :mod:`~tightfit.kernels.varlen_attention_cpu`),
:mod:`tightfit.kernels.elementwise` (``silu_mul``, ``rotary_``: native and reference only),
:mod:`tightfit.kernels.gelu_mul` (``gelu_tanh_mul``, Gemma's GeGLU), :mod:`tightfit.kernels.head_norm` (``rms_norm_heads_``,
per-head q/k norms in place), :mod:`tightfit.kernels.grouped_experts` (``grouped_experts``, an MoE layer's routed experts
in one call; :mod:`tightfit.kernels.grouped_quant_experts` the same on int8 / int4 experts, over the quantized linear
kernels) and :mod:`tightfit.kernels.gumbel` (``gumbel_argmax``: one Gumbel-max draw per row with counter-based
noise): native and reference only.

How to add a kernel (one op per file, ``core/kernels/<op>.py``; Liger-Kernel's layout):

1. Write the ``@triton.jit`` kernel(s) inside a ``functools.cache``-d builder that imports Triton
   and binds the module globals ``triton``/``tl`` (see ``index_rows._kernels``), so importing the
   module does not import Triton and core keeps importing without it.
2. A launcher ``<op>_triton(...)`` that calls the builder, computes the grid and launches; no checks.
3. A reference ``<op>_reference(...)`` with the same signature, pure PyTorch, any device.
4. ``_op = register_kernel("<op>", reference=<op>_reference, triton=<op>_triton, doc="...")`` and a
   public ``<op>(...)`` that validates arguments (errors name the value, the rule and the fix) and
   calls ``_op(..., backend=backend)``; add an ``autograd.Function`` if it must be differentiable.
   Give ``register_kernel`` a ``shape_class`` (what picks the kernel's specialisation: dtypes, widths)
   and a ``probe`` (a small input of that class) for the first-use self-check (``index_rows._row_probe``).
5. Tests: ``tightfit.kernels.testing.assert_matches_reference`` runs both backends under
   ``TRITON_INTERPRET=1`` on CPU tensors (tests/conftest.py sets it) over odd shapes and several dtypes.
6. Benchmark: add a case to ``benchmarks/gpu/kernels.py`` (CUDA-event timing against the reference);
   a comment next to the launcher's block sizes says why they were chosen (the figures stay in the
   benchmark's results); add a CUDA test to
   ``tests/gpu/test_kernels.py`` (run by ``make gpu-check``).
"""

from __future__ import annotations

from tightfit.kernels.dispatch import (
    BACKENDS,
    ENV_VAR,
    Kernel,
    KernelCheckWarning,
    KernelError,
    choose_backend,
    get_kernel,
    kernel_checks,
    kernel_names,
    register_kernel,
    repeated_calls,
    triton_available,
)
from tightfit.kernels.index_rows import gather_rows, scatter_add_rows, scatter_rows

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "Kernel",
    "KernelCheckWarning",
    "KernelError",
    "choose_backend",
    "get_kernel",
    "kernel_checks",
    "kernel_names",
    "register_kernel",
    "repeated_calls",
    "triton_available",
    "gather_rows",
    "scatter_rows",
    "scatter_add_rows",
]
