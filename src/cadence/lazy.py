"""A package namespace whose names are imported on first use (PEP 562), so that importing a light module of a
package does not import every heavy one beside it.

Why: `cadence --help` must answer without importing torch (about 2 s of the 5 s a help took, issue 41), yet
``from cadence import Engine`` and ``from cadence.engine import Engine`` stay the library's API. A package's
``__init__`` names what it exports and where each name lives; the module holding a name is imported the first time
the name is used, and the value is then kept on the package (later uses cost nothing).

A type checker sees ``__getattr__`` and would type every such name Any, so each package's ``__init__`` also imports
the same names under ``if TYPE_CHECKING:`` (never at run time); tests/test_architecture.py keeps the two lists the
same.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast


class _LazyPackage(types.ModuleType):
    """A package whose exported names win over its submodules of the same name.

    Importing ``cadence.config.validate`` binds the submodule to the package's attribute ``validate``, which would
    hide the function ``validate`` the package exports (``from cadence.config import validate`` would give the
    module). An eager ``__init__`` rebound the function afterwards; here the binding of such a submodule is left out,
    so the name resolves through ``__getattr__`` to the export (the submodule stays in sys.modules)."""

    _exported: frozenset[str] = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in self._exported:
            return
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> tuple[
        Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose public names are ``exports``: module -> names."""
    where = {name: module for module, names in exports.items() for name in names}
    if len(where) != sum(len(names) for names in exports.values()):
        raise ValueError(f"{package}: a name is exported from two modules")

    module_object = sys.modules[package]
    module_object.__class__ = _LazyPackage
    cast(_LazyPackage, module_object)._exported = frozenset(where)  # its class is _LazyPackage from the line above

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
