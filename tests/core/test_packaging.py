from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject():
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = set()
    for top, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join((top, *rel.parts)))
    assert found == listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}; stale: {sorted(listed - found)}"


def test_all_import_names_work():
    out = subprocess.run(
        [sys.executable, "-c", "import tightfit, lightning_elixir, energon_infer, torchrec_cache, sky_strategy"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr


BLOCKER = textwrap.dedent("""
    import sys, importlib.abc
    BLOCKED = ("lightning", "pytorch_lightning", "lightning_fabric", "torchrec", "fbgemm_gpu", "deepspeed",
               "triton", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "httpx",
               "matplotlib", "scipy", "torchmetrics", "tensordict", "torchao")
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked for this test: {name}")
            return None
    sys.meta_path.insert(0, Block())
    import pkgutil, importlib
    import tightfit
    names = ["tightfit"] + [m.name for m in pkgutil.walk_packages(tightfit.__path__, "tightfit.")]
    for name in names:
        importlib.import_module(name)
    from tightfit.cli import main
    assert main(["plugins"]) == 0
    print("imported", len(names), "core modules")
""")


def test_core_imports_with_only_torch_and_entrypoints():
    """Every core module imports with only torch, entrypoints and numpy: host frameworks and the serving,
    weights and plotting packages are blocked."""
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "imported" in out.stdout
    # With the host frameworks blocked, the CLI still lists the plugins.
    assert "elixir" in out.stdout


def test_core_does_not_import_plugins():
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")) and any(
                f" {p}" in stripped.split(" import")[0] + " " or stripped.startswith(f"import {p}")
                for p in ("lightning_elixir", "energon_infer", "torchrec_cache", "sky_strategy")
            ):
                offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert not offenders, "core must not import plugins:\n" + "\n".join(offenders)
