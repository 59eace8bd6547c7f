"""Plugin descriptors, entry-point discovery and the strict plugin registry.

Each plugin package exposes one module-level ``plugin`` object (a :class:`Plugin`) and lists it in
its distribution's metadata under the entry-point group ``tightfit.plugins``. :func:`discover`
loads that group with the ``entrypoints`` package; a plugin whose import fails is reported with its
error instead of breaking the others.

Example:
    >>> from tightfit.plugins import discover
    >>> found = discover()
    >>> sorted(r.name for r in found if r.ok)  # doctest: +SKIP
    ['elixir', 'energon', 'sky', 'torchrec_cache']
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "Plugin",
    "PluginError",
    "DiscoveryResult",
    "PluginRegistry",
    "registry",
    "discover",
    "missing_modules",
    "registers_on_import",
]

ENTRY_POINT_GROUP = "tightfit.plugins"
"""The entry-point group :func:`discover` reads: a package registers a plugin under it."""

KINDS = ("lightning-strategy", "inference-backend", "embedding-cache", "planner", "kernel")
"""What a plugin plugs into. Third-party plugins pick one of these."""


class PluginError(RuntimeError):
    """A plugin is malformed, registered twice, or unknown."""


def missing_modules(*modules: str) -> list[str]:
    """Names among ``modules`` that cannot be imported here (checked without importing them)."""
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


@dataclass(frozen=True, kw_only=True)
class Plugin:
    """What a plugin package declares about itself.

    Args:
        name: registry key, unique across installed plugins (``"elixir"``).
        kind: one of :data:`KINDS`.
        summary: one line for ``tightfit plugins``.
        requires: import names of the host framework(s) the plugin needs; missing ones make the
            plugin unavailable, with the reason naming them.
        available: ``False`` marks a plugin as not yet usable even when its requirements are met.
        reason: why ``available`` is ``False`` (shown by ``tightfit plugins``).
        register_hook: called once by :meth:`register` (e.g. to add names to Lightning's
            ``StrategyRegistry``).
        demo: optional callable ``demo(quick: bool) -> str`` run by ``tightfit demo``; returns a summary.
        command: optional name of a ``tightfit`` subcommand the plugin provides (``"serve"``).
        cli: ``cli(argv: list[str]) -> int`` run for ``tightfit <command> ...``.
        planner: optional name of a ``tightfit plan`` planner the plugin provides (``"serve"``).
        plan_cli: ``plan_cli(argv: list[str]) -> int`` run for ``tightfit plan <planner> ...``.

    Example:
        >>> p = Plugin(name="mine", kind="planner", summary="my planner")
        >>> p.status()
        'available'
    """

    name: str
    kind: str
    summary: str
    requires: tuple[str, ...] = ()
    available: bool = True
    reason: str = ""
    register_hook: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    demo: Callable[[bool], str] | None = field(default=None, compare=False, repr=False)
    command: str | None = None
    cli: Callable[[list[str]], int] | None = field(default=None, compare=False, repr=False)
    planner: str | None = None
    plan_cli: Callable[[list[str]], int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise PluginError(
                f"plugin name {self.name!r} is invalid: use letters, digits, '-' and '_' only "
                "(e.g. 'my_plugin')"
            )
        if self.kind not in KINDS:
            raise PluginError(
                f"plugin {self.name!r} has kind {self.kind!r}; it must be one of {', '.join(KINDS)}"
            )
        if (self.command is None) != (self.cli is None):
            raise PluginError(f"plugin {self.name!r}: give both `command` and `cli`, or neither")
        if (self.planner is None) != (self.plan_cli is None):
            raise PluginError(f"plugin {self.name!r}: give both `planner` and `plan_cli`, or neither")
        if not self.available and not self.reason:
            raise PluginError(f"plugin {self.name!r} is marked unavailable: give a `reason` saying why")

    def missing(self) -> list[str]:
        """Required host frameworks that are not installed."""
        return missing_modules(*self.requires)

    def is_usable(self) -> bool:
        return self.available and not self.missing()

    def status(self) -> str:
        """``'available'`` or ``'unavailable: <why>'``."""
        if not self.available:
            return f"unavailable: {self.reason}"
        missing = self.missing()
        if missing:
            return f"unavailable: needs {', '.join(missing)} (pip install 'tightfit[all]')"
        return "available"

    def register(self) -> None:
        """Run the plugin's registration hook (idempotent per hook)."""
        if self.register_hook is not None and self.is_usable():
            self.register_hook()


@dataclass(frozen=True)
class DiscoveryResult:
    """One entry point of the group: the loaded plugin, or the error that stopped it."""

    name: str
    target: str
    distribution: str
    plugin: Plugin | None = None
    error: str = ""
    traceback: str = ""

    @property
    def ok(self) -> bool:
        return self.plugin is not None

    def status(self) -> str:
        if self.plugin is None:
            return f"error: {self.error}"
        return self.plugin.status()


class PluginRegistry:
    """String-keyed, strict: a duplicate name raises, an unknown name raises listing the known ones."""

    def __init__(self) -> None:
        self._plugins: dict[str, Plugin] = {}

    def add(self, plugin: Plugin) -> None:
        if not isinstance(plugin, Plugin):
            raise PluginError(
                f"{plugin!r} is not a tightfit.plugins.Plugin; an entry point of {ENTRY_POINT_GROUP!r} "
                "must name a module-level `plugin = Plugin(...)` object"
            )
        known = self._plugins.get(plugin.name)
        if known is not None and known is not plugin:
            raise PluginError(
                f"a plugin named {plugin.name!r} is already registered ({known.summary!r}); "
                "rename one of them or uninstall the duplicate"
            )
        self._plugins[plugin.name] = plugin

    def get(self, name: str) -> Plugin:
        try:
            return self._plugins[name]
        except KeyError:
            known = ", ".join(sorted(self._plugins)) or "none"
            raise PluginError(
                f"unknown plugin {name!r}; known plugins: {known}. Run `tightfit plugins` to see "
                "what is installed"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def __contains__(self, name: object) -> bool:
        return name in self._plugins

    def __iter__(self):
        return iter(self._plugins[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._plugins)

    def clear(self) -> None:
        self._plugins.clear()


registry = PluginRegistry()
"""The process's plugin registry: what :func:`discover` fills."""


# True while discover(register=False) loads plugins: their packages then skip the registration they do
# at import (Lightning's StrategyRegistry needs `import lightning`, ~8 s), so `tightfit plugins` stays fast.
_deferring = False


def registers_on_import() -> bool:
    """Whether a plugin package should run its registration hook while it is being imported.

    ``False`` only inside ``discover(register=False)``: such a run lists plugins without registering
    them; call ``plugin.register()`` (or ``discover()``) afterwards to register.
    """
    return not _deferring


def _entry_points() -> Iterable[tuple[str, str, str, Callable[[], object]]]:
    import entrypoints

    group = entrypoints.get_group_all(ENTRY_POINT_GROUP)
    seen: set[tuple[str, str]] = set()
    for ep in group:
        target = f"{ep.module_name}:{ep.object_name}" if ep.object_name else ep.module_name
        dist = ep.distro.name if ep.distro is not None else "?"
        # The same distribution can be visible twice (an editable install and a build dir).
        if (ep.name, target) in seen:
            continue
        seen.add((ep.name, target))
        yield ep.name, target, dist, ep.load


def discover(*, register: bool = True, into: PluginRegistry | None = None) -> list[DiscoveryResult]:
    """Load every plugin in the ``tightfit.plugins`` entry-point group.

    Args:
        register: add each loaded plugin to the registry and run its ``register()`` hook.
        into: the registry to fill (default: the module-level :data:`registry`).

    Returns one :class:`DiscoveryResult` per entry point, sorted by name; failures carry the error.
    """
    global _deferring
    target_registry = registry if into is None else into
    results: list[DiscoveryResult] = []
    for name, target, dist, load in _entry_points():
        try:
            _deferring = not register
            try:
                obj = load()
            finally:
                _deferring = False
            if not isinstance(obj, Plugin):
                raise PluginError(
                    f"entry point {name!r} -> {target} is a {type(obj).__name__}, not a "
                    "tightfit.plugins.Plugin; point it at a module-level `plugin = Plugin(...)`"
                )
            if obj.name != name:
                raise PluginError(
                    f"entry point {name!r} -> {target} loads a plugin named {obj.name!r}; the entry "
                    "point name and Plugin.name must match"
                )
            if register:
                target_registry.add(obj)
                obj.register()
            results.append(DiscoveryResult(name, target, dist, plugin=obj))
        except Exception as exc:  # one broken plugin must not break the others
            results.append(
                DiscoveryResult(
                    name,
                    target,
                    dist,
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(),
                )
            )
    return sorted(results, key=lambda r: r.name)
