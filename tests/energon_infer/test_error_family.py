"""energon's one error family: every exception class is an EnergonError that keeps its builtin base and carries its
HTTP status; the server answers an EnergonError with that status and anything else (a ValueError included) with
500, logged with its traceback; ``tightfit serve`` ends with 2 and one line for an EnergonError, with a traceback and
1 for anything else."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

from energon_infer.errors import BadInputError, BusyError, EnergonError, UnavailableError
from tests.helpers.runif import RunIf

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "energon_infer"

# class -> (its builtin base, the status a client gets)
EXPECTED = {
    "CheckpointChangedError": (RuntimeError, 400), "ConfigError": (ValueError, 400), "UnsupportedModelError": (ValueError, 400),
    "ContextLengthError": (ValueError, 400), "WeightError": (ValueError, 400),
    "ModelTooLargeError": (ValueError, 400), "InvalidRequestError": (ValueError, 400),
    "QuantizationError": (ValueError, 400), "StructuredOutputError": (ValueError, 400),
    "OptionError": (ValueError, 400), "UnknownOptionError": (TypeError, 400),
    "MissingFileError": (FileNotFoundError, 400), "QueueFullError": (RuntimeError, 429),
    "WorkerFailedError": (RuntimeError, 503), "EngineClosedError": (RuntimeError, 503),
    "WorkerStartError": (RuntimeError, 503), "RequestFailedError": (RuntimeError, 500),
    "RequestRefusedError": (RuntimeError, 400),
    "KVCacheFullError": (RuntimeError, 500), "UnknownSequenceError": (KeyError, 500),
}


def _exception_classes() -> dict[str, str]:
    """Every class in the plugin whose name ends in Error and that is an exception: name -> module."""
    import importlib

    found = {}
    for path in sorted(PLUGIN.rglob("*.py")):  # the role folders too (loading/, worker/, ...)
        module = ".".join(("energon_infer", *path.relative_to(PLUGIN).with_suffix("").parts))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                obj = getattr(importlib.import_module(module), node.name)
                if isinstance(obj, type) and issubclass(obj, BaseException):
                    found[node.name] = module
    return found


def test_every_exception_class_is_an_energon_error_with_its_builtin_base_and_status():
    import importlib

    found = _exception_classes()
    found.pop("ApiError")  # its status is per instance (the server's own answers), checked below
    family = {"EnergonError", "BadInputError", "BusyError", "UnavailableError"}
    assert set(found) - family == set(EXPECTED)
    for name, (builtin, status) in EXPECTED.items():
        cls = getattr(importlib.import_module(found[name]), name)
        assert issubclass(cls, EnergonError) and issubclass(cls, builtin), name
        assert cls.http_status == status, name
    from energon_infer.serving.http_guard import ApiError

    assert issubclass(ApiError, EnergonError) and ApiError(413, "too big").http_status == 413


def test_engine_error_answers_by_class_and_an_unknown_error_is_a_logged_500(caplog):
    from energon_infer.engine.controller import WorkerFailedError
    from energon_infer.scheduling.scheduler_config import QueueFullError
    from energon_infer.serving.http_guard import engine_error

    full = engine_error(QueueFullError(3, 3))
    assert (full.status, full.type, full.headers) == (429, "rate_limit_error", {"Retry-After": "1"})
    gone = engine_error(WorkerFailedError("worker 1 died"))
    assert (gone.status, gone.type, gone.headers["Retry-After"]) == (503, "service_unavailable", "5")
    bad = engine_error(BadInputError("prompt too long"))
    assert (bad.status, bad.type, bad.message) == (400, "invalid_request_error", "prompt too long")
    for family, status in ((BusyError, 429), (UnavailableError, 503), (EnergonError, 500)):
        assert engine_error(family("x")).status == status
    with caplog.at_level(logging.ERROR, logger="energon_infer"):
        try:
            int("not a number")
        except ValueError as exc:
            unknown = engine_error(exc)
    assert unknown.status == 500 and unknown.type == "server_error"  # a ValueError is not the client's fault
    record = next(r for r in caplog.records if "unexpected ValueError" in r.getMessage())
    assert record.exc_info is not None and record.exc_info[0] is ValueError  # logged with its traceback


@RunIf(serve=True)
def test_the_server_maps_errors_raised_in_an_endpoint(tmp_path, caplog):
    from fastapi.testclient import TestClient

    from energon_infer.engine.engine import Engine
    from energon_infer.scheduling.scheduler_config import QueueFullError
    from energon_infer.serving.server import EnergonServer, ServerConfig

    with Engine.from_pretrained(_model(tmp_path), progress=False, threads_per_worker=1, max_queue=2) as engine:
        server = EnergonServer(engine, ServerConfig(port=0))

        async def full() -> None:
            raise QueueFullError(2, 2)

        async def bug() -> None:
            raise ValueError("a bug, not the client's input")

        server.app.add_api_route("/full", full)
        server.app.add_api_route("/bug", bug)
        with caplog.at_level(logging.ERROR, logger="energon_infer"), \
                TestClient(server.app, raise_server_exceptions=False) as client:
            r = client.get("/full")
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "max_queue=2" in r.json()["error"]["message"]
            r = client.get("/bug")
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            too_long = client.post("/v1/completions", json={"prompt": list(range(1, 200)), "max_tokens": 1})
            assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
        assert any("unexpected ValueError" in r.getMessage() and r.exc_info for r in caplog.records)


def _model(tmp_path):
    from energon_infer.demo import write_random_llama

    return write_random_llama(tmp_path / "tiny", layers=1, hidden=16, heads=2, kv_heads=1, intermediate=32,
                              max_positions=64)


@RunIf(serve=True)
def test_tightfit_serve_ends_bad_input_with_one_line_and_2(tmp_path, capsys):
    from energon_infer.serving.serve import main

    assert main([str(_model(tmp_path)), "--tp", "3", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit serve: tp=3 does not divide") and "Traceback" not in err
    assert main([str(tmp_path / "tiny"), "--memory-pool", "7", "--port", "0"]) == 2
    assert "fraction=7.0 must be in [0, 1]" in capsys.readouterr().err


@RunIf(serve=True)
def test_tightfit_serve_ends_a_bug_with_its_traceback_and_1(tmp_path, capsys, monkeypatch):
    from energon_infer.engine.engine import Engine
    from energon_infer.serving.serve import main

    def broken(*args, **kwargs):  # stands for a bug anywhere below the command
        raise ZeroDivisionError("division by zero deep in the engine")

    monkeypatch.setattr(Engine, "from_pretrained", broken)
    assert main([str(_model(tmp_path)), "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ZeroDivisionError" in err and "a bug in energon" in err
