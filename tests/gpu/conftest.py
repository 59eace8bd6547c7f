"""Each GPU test's outcome, appended as it finishes to ``$TIGHTFIT_GPU_REPORT`` (one JSON line per test).

``make gpu-check`` stops the tests at their time budget; results written as they come survive that,
where a report written at the end would not.
"""

from __future__ import annotations

import json
import os

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("TIGHTFIT_GPU_REPORT")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return  # one line per test: its call, or the setup/teardown that failed or skipped it
    detail = ""
    if report.skipped and isinstance(report.longrepr, tuple):
        detail = str(report.longrepr[2])
    elif report.failed:
        detail = str(report.longreprtext)[-3000:]
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "outcome": outcome, "when": report.when,
                            "seconds": round(report.duration, 3), "detail": detail}) + "\n")
