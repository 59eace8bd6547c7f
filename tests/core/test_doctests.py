"""The examples in core's planner and profile-type docstrings run as written (they are the API's first docs)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["tightfit.planner.tiers", "tightfit.planner.pool", "tightfit.planner.cache", "tightfit.planner.errors",
           "tightfit.planner.cost", "tightfit.checks", "tightfit.serde", "tightfit.planner.experts",
           "tightfit.policy.frequency", "tightfit.policy.experts", "tightfit.profiler.experts"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} doctest examples failed"
    assert result.attempted > 0, f"{name} has no examples to run"
