"""The modules' old import paths (``tensorstash.disk``, ``tensorstash.lightning``, ...),
from before the package was grouped into subpackages, name the same module objects.

The modules the package imports anyway are entered in ``sys.modules`` (and as the
package's attributes, where no public name has it) at once; the integrations, which
import optional libraries, are found on first import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

OLD_PATHS = {
    "policy": "core.policy",
    "stats": "core.stats",
    "_layout": "core._layout",
    "_reasons": "core._reasons",
    "_timers": "core._timers",
    "_fastpath": "core._fastpath",
    "_memory": "memory._memory",
    "_trim": "memory._trim",
    "_pool": "memory._pool",
    "cpu": "tiers.cpu",
    "compress": "tiers.compress",
    "_codec": "tiers._codec",
    "disk": "tiers.disk",
    "_spilldir": "tiers._spilldir",
    "_buffers": "tiers._buffers",
    "recompute": "tiers.recompute",
    "_names": "tiers._names",
    "stash": "session.stash",
    "_modules": "session._modules",
    "_verify": "session._verify",
    "_dtensor": "session._dtensor",
    "auto": "planning.auto",
    "profile": "planning.profile",
    "plan": "planning.plan",
    "_rates": "planning._rates",
    "compiler": "planning.compiler",
    "lightning": "integrations.lightning",
    "hf": "integrations.hf",
    "distributed": "integrations.distributed",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``tensorstash.<old>`` and loads it as the module at its new path."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        package, _, old = name.partition(".")
        if package != "tensorstash" or old not in OLD_PATHS:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(f"tensorstash.{OLD_PATHS[spec.name.partition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module ran at its new path


def install() -> None:
    """Enter the old paths of the modules already imported; find the others on demand."""
    package = sys.modules["tensorstash"]
    for old, new in OLD_PATHS.items():
        module = sys.modules.get(f"tensorstash.{new}")
        if module is not None:
            sys.modules.setdefault(f"tensorstash.{old}", module)
            if not hasattr(package, old):  # ts.auto, as before; ts.stash stays the function
                setattr(package, old, module)
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
