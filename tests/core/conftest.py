"""Fixtures shared by core's tests."""

from __future__ import annotations

import pytest

from tightfit.storage import aio


@pytest.fixture(params=["aio", "threads"])
def io_path(request, monkeypatch):
    """The I/O path a :class:`tightfit.storage.TensorStore` test runs on: kernel AIO, or the worker threads
    (``TIGHTFIT_AIO=0``)."""
    if request.param == "threads":
        monkeypatch.setenv("TIGHTFIT_AIO", "0")
    elif not aio.available():
        pytest.skip("kernel AIO is not available here")
    return request.param
