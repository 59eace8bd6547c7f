"""tightfit core: profilers, planners, kernels, plugin discovery and the ``tightfit`` command.

Core imports with only torch and ``entrypoints`` installed; host frameworks (Lightning, TorchRec,
DeepSpeed, Triton) are imported by the plugins that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
