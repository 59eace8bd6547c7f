"""The plugins' shape, checked from their source: one way through each plugin.

docs/architecture.md: no import cycle inside a plugin (imports that only a type checker sees are not
counted: they run nothing), no file in ``plugins/`` over 500 lines and no function over 80 lines. A
module that needs its caller's behaviour takes it as an argument or a return value, never an import back.

Run one plugin's checks while working on it: ``pytest tests/test_layout.py -k energon_infer``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.name for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").is_file())
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules(plugin: str) -> dict[str, Path]:
    base = ROOT / "plugins" / plugin
    out = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join((plugin, *parts))] = path
    return out


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                return True
    return False


def import_graph(plugin: str) -> dict[str, set[str]]:
    """Module -> the modules of the same plugin it imports at run time (function-level imports included)."""
    modules = _modules(plugin)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            if _type_checking_only(node, parents):
                continue
            for t in targets:
                # "from pkg import mod" names a module; "from pkg.mod import f" names pkg.mod.
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                # A module importing its own package's __init__ (or a sibling through it) runs that __init__
                # first, which is a real edge; an __init__ importing its submodules is one too.
                if t and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_find_cycle_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("plugin", PLUGINS)
def test_no_import_cycle_inside_a_plugin(plugin):
    cycle = find_cycle(import_graph(plugin))
    assert cycle is None, f"{plugin}: import cycle {' -> '.join(cycle or [])}; pass what the callee needs instead"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_files_stay_under_500_lines(plugin):
    long = {str(p.relative_to(ROOT)): n for p in _modules(plugin).values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split by role): {long}"


@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_functions_stay_under_80_lines(plugin):
    long = {}
    for path in _modules(plugin).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# energon_infer is grouped by role, bottom to top; a group imports only groups below it and the shared modules
# at the package's root (docs/architecture.md). The root's entry modules (the package, the demos) may import any.
ENERGON_GROUPS = ("loading", "scheduling", "worker", "engine", "serving")
ENERGON_SHARED = ("errors", "sampling", "structured", "protocol", "parallel")
ENERGON_ENTRY = ("", "demo", "engine_demo")


def _energon_level(module: str) -> tuple[str, int]:
    """(where, rank): shared modules rank -1, groups 0..4 bottom to top, entry modules above them all."""
    rest = module.removeprefix("energon_infer").removeprefix(".")
    head = rest.split(".")[0]
    if head in ENERGON_GROUPS:
        return head, ENERGON_GROUPS.index(head)
    if head in ENERGON_SHARED:
        return head, -1
    assert head in ENERGON_ENTRY, f"energon_infer.{rest} is in no group: add it to a role folder or to the lists here"
    return head or "energon_infer", len(ENERGON_GROUPS)


def test_energon_groups_import_one_way():
    back = []
    for module, targets in import_graph("energon_infer").items():
        where, rank = _energon_level(module)
        for target in targets:
            there, level = _energon_level(target)
            shared_to_shared = rank == -1 and level == -1
            if (level > rank or (rank == -1 and not shared_to_shared)) and module != "energon_infer":
                back.append(f"{module} ({where}) -> {target} ({there})")
    assert not back, "imports against the groups' order (" + " < ".join(ENERGON_GROUPS) + "): " + "; ".join(back)
