from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tightfit.plugins import Plugin, PluginError, PluginRegistry, discover

BUILTIN = {"elixir", "energon", "torchrec_cache", "sky"}


def _fake_distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """A real installed distribution as pip would leave it: a *.dist-info with entry_points.txt."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tightfit.plugins]\n{lines}\n")
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    return root


THIRD_PARTY = {
    "acme_planner": """
        from tightfit.plugins import Plugin
        plugin = Plugin(name="acme", kind="planner", summary="ACME's own planner",
                        demo=lambda quick: "acme demo ran")
    """,
    "broken_plugin": """
        raise ImportError("broken_plugin needs libfoo 9, found 8")
    """,
}


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    root = _fake_distribution(tmp_path, "acme_tightfit", {"acme": "acme_planner:plugin", "broken": "broken_plugin:plugin"},
                              THIRD_PARTY)
    monkeypatch.syspath_prepend(str(root))
    return root


def test_builtin_plugins_are_discovered():
    results = {r.name: r for r in discover(into=PluginRegistry())}
    assert BUILTIN <= set(results)
    for name in BUILTIN:
        assert results[name].ok, results[name].error
        assert results[name].distribution == "tightfit"


def test_third_party_plugin_discovered_and_broken_one_reported(third_party):
    reg = PluginRegistry()
    results = {r.name: r for r in discover(into=reg)}
    assert results["acme"].ok and results["acme"].distribution == "acme_tightfit"
    assert reg.get("acme").summary == "ACME's own planner"
    broken = results["broken"]
    assert not broken.ok
    assert "libfoo 9" in broken.error and "ImportError" in broken.error
    assert "broken" not in reg
    # the broken one did not stop the others
    assert BUILTIN <= {n for n, r in results.items() if r.ok}


def test_cli_lists_third_party_and_broken_plugins(third_party):
    env = dict(os.environ, PYTHONPATH=str(third_party) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "tightfit.cli", "plugins"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for name in BUILTIN | {"acme", "broken"}:
        assert name in out.stdout
    assert "error: ImportError: broken_plugin needs libfoo 9" in out.stdout


def test_entry_point_must_name_a_plugin(tmp_path, monkeypatch):
    root = _fake_distribution(tmp_path, "wrong", {"wrong": "wrong_mod:plugin", "misnamed": "wrong_mod:other"},
                              {"wrong_mod": """
                                  from tightfit.plugins import Plugin
                                  plugin = object()
                                  other = Plugin(name="else", kind="kernel", summary="x")
                              """})
    monkeypatch.syspath_prepend(str(root))
    results = {r.name: r for r in discover(into=PluginRegistry())}
    assert "is a object, not a tightfit.plugins.Plugin" in results["wrong"].error
    assert "entry point name and Plugin.name must match" in results["misnamed"].error


def test_registry_is_strict():
    reg = PluginRegistry()
    a = Plugin(name="a", kind="planner", summary="first")
    reg.add(a)
    reg.add(a)  # the same object again is idempotent (discover() may run twice)
    with pytest.raises(PluginError, match="already registered .*'first'.*rename one"):
        reg.add(Plugin(name="a", kind="planner", summary="second"))
    with pytest.raises(PluginError, match="unknown plugin 'zzz'; known plugins: a"):
        reg.get("zzz")
    with pytest.raises(PluginError, match="not a tightfit.plugins.Plugin"):
        reg.add("a")  # type: ignore[arg-type]


def test_plugin_validation_and_status():
    with pytest.raises(PluginError, match="kind 'nope'; it must be one of"):
        Plugin(name="x", kind="nope", summary="")
    with pytest.raises(PluginError, match="name 'a b' is invalid"):
        Plugin(name="a b", kind="planner", summary="")
    with pytest.raises(PluginError, match="give a `reason`"):
        Plugin(name="x", kind="planner", summary="", available=False)
    with pytest.raises(PluginError, match="both `command` and `cli`"):
        Plugin(name="x", kind="planner", summary="", command="go")
    with pytest.raises(PluginError, match="both `planner` and `plan_cli`"):
        Plugin(name="x", kind="planner", summary="", planner="go")
    needs = Plugin(name="x", kind="planner", summary="", requires=("no_such_module_xyz",))
    assert needs.status().startswith("unavailable: needs no_such_module_xyz")
    assert not needs.is_usable()
    calls = []
    hooked = Plugin(name="y", kind="planner", summary="", register_hook=lambda: calls.append(1))
    hooked.register()
    assert calls == [1]
    needs_hook = Plugin(name="z", kind="planner", summary="", requires=("no_such_module_xyz",),
                        register_hook=lambda: calls.append(2))
    needs_hook.register()
    assert calls == [1], "an unusable plugin must not register itself"
