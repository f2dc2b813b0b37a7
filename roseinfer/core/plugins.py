"""The plugin manager: built-in plugins, entry-point plugins, lookup by name."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from roseinfer.core import hookspecs

# Built-ins are plugins like any other; core names them only as strings.
BUILTIN_PLUGINS = (
    "roseinfer.plugins.tool_parsers",
    "roseinfer.plugins.reasoning_parsers",
    "roseinfer.plugins.kv_append.torch_index",
    "roseinfer.plugins.kv_append.triton_append",
    "roseinfer.plugins.metadata.slots",
    "roseinfer.plugins.metadata.arrays",
    "roseinfer.plugins.attention.torch_sdpa",
    "roseinfer.plugins.attention.triton_paged",
    "roseinfer.plugins.models",
    "roseinfer.plugins.structured_output",
    "roseinfer.plugins.quantization",
    "roseinfer.plugins.speculative",
)

KINDS = {
    "kv_append": "roseinfer_register_kv_append_backends",
    "metadata": "roseinfer_register_metadata_stores",
    "attention": "roseinfer_register_attention_backends",
    "model": "roseinfer_register_model_architectures",
    "logits_processor": "roseinfer_register_logits_processors",
    "quantization": "roseinfer_register_quantization_methods",
    "proposer": "roseinfer_register_proposers",
    "tool_parser": "roseinfer_register_tool_parsers",
    "reasoning_parser": "roseinfer_register_reasoning_parsers",
}


class UnknownPluginError(ValueError):
    pass


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    factory: Callable[..., Any]
    origin: str


class PluginRegistry:
    def __init__(self, load_entry_points: bool = True):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for modname in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(modname), name=modname)
        if load_entry_points:
            self.pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        self._cache: dict[str, dict[str, Registration]] = {}

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register an outside plugin object (tests, embedding applications)."""
        self.pm.register(plugin, name=name)
        self._cache.clear()

    def registrations(self, kind: str) -> dict[str, Registration]:
        if kind not in self._cache:
            self._cache[kind] = self._collect(kind)
        return self._cache[kind]

    def _collect(self, kind: str) -> dict[str, Registration]:
        found: dict[str, Registration] = {}
        hook = getattr(self.pm.hook, KINDS[kind])
        for impl in hook.get_hookimpls():
            origin = self.pm.get_name(impl.plugin) or repr(impl.plugin)

            def register(name: str, factory, _origin=origin) -> None:
                if name in found:
                    raise ValueError(
                        f"{kind} plugin {name!r} registered twice "
                        f"({found[name].origin} and {_origin})"
                    )
                found[name] = Registration(kind, name, factory, _origin)

            impl.function(register=register)
        return found

    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations(kind))

    def get(self, kind: str, name: str) -> Registration:
        regs = self.registrations(kind)
        if name not in regs:
            raise UnknownPluginError(
                f"unknown {kind} plugin {name!r}; registered: "
                f"{', '.join(sorted(regs)) or 'none'}. {_missing_hint(name)}"
            )
        return regs[name]

    def create(self, kind: str, name: str, *args, **kwargs):
        return self.get(kind, name).factory(*args, **kwargs)


def _missing_hint(name: str) -> str:
    from roseinfer.core.triton_support import triton

    if name.startswith("triton") and triton is None:
        return ("Triton's plugins load only where their kernels run: on CUDA, or under "
                "TRITON_INTERPRET=1 (slow; for tests).")
    return "Is the plugin installed?"


_default: PluginRegistry | None = None


def default_registry() -> PluginRegistry:
    global _default
    if _default is None:
        _default = PluginRegistry()
    return _default
