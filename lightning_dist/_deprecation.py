"""Names kept importable for one release after a rename, each with a ``DeprecationWarning`` on use.

A module that renamed ``Old`` to ``New`` ends with ``__getattr__ = renamed(__name__, {"Old": New})``: Python calls
a module's ``__getattr__`` only for names it does not define, so the new names cost nothing, and the old one resolves
to the very same object (``isinstance`` checks and Hydra's ``_target_`` keep working) with a warning that names its
replacement.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional


def renamed(module: str, names: Mapping[str, Any], hints: Optional[Mapping[str, str]] = None
            ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``names`` (old name -> the object now under its new name); ``hints`` (old name
    -> what to use instead) replaces the warning's ``use <module>.<new name>`` where the replacement is not simply
    the new name."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = names[name]
        hint = (hints or {}).get(name, f"{module}.{new.__name__}")
        warnings.warn(f"{module}.{name} is deprecated and will be removed in the next release; use {hint}",
                      DeprecationWarning, stacklevel=2)
        return new

    return __getattr__
