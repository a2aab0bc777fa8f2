"""One small utility for every change the plugin makes to a vLLM class.

A :class:`Patch` names its target attribute and builds the replacement from the original, which
it keeps and calls. Applying a patch twice is a no-op (vLLM loads general plugins in every
process, sometimes twice); a *different* patch on an attribute that is already patched is refused.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_MARK = "__nwor_patch__"
_ORIGINAL = "__nwor_original__"


class PatchError(RuntimeError):
    """A patch that cannot be applied safely."""


@dataclass(frozen=True)
class Patch:
    """Replaces ``target.name`` with ``wrap(original)`` (``target``: a class, or a module for a
    function that vLLM calls by its module-level name).

    ``wrap`` receives the original attribute (``None`` for ``new=True`` additions) and returns the
    replacement. ``why`` says what the patch does and what upstream change would retire it.
    """

    target: type | types.ModuleType
    name: str
    wrap: Callable[[Any], Any]
    why: str
    new: bool = False

    @property
    def owner(self) -> str:
        """The target's full name."""
        if isinstance(self.target, types.ModuleType):
            return self.target.__name__
        return f"{self.target.__module__}.{self.target.__qualname__}"

    @property
    def attribute(self) -> str:
        return f"{self.owner}.{self.name}"

    @property
    def id(self) -> str:
        """The attribute and the wrapper that replaces it."""
        return f"{self.attribute} <- {self.wrap.__module__}.{self.wrap.__qualname__}"

    def is_applied(self) -> bool:
        current = self.target.__dict__.get(self.name)
        return getattr(current, _MARK, None) == self.id

    def apply(self) -> bool:
        """Installs the patch. Returns False if it was already installed."""
        current = self.target.__dict__.get(self.name)
        mark = getattr(current, _MARK, None)
        if mark == self.id:
            return False
        if mark is not None:
            raise PatchError(f"{self.attribute} is already patched ({mark})")
        if self.new and current is not None:
            raise PatchError(f"{self.attribute} exists; the plugin only adds it to vLLM 0.26")
        if not self.new and current is None:
            raise PatchError(f"{self.attribute} is not defined on {self.owner}")
        replacement = self.wrap(current)
        if current is not None and callable(current):
            functools.update_wrapper(replacement, current)
        setattr(replacement, _MARK, self.id)
        setattr(replacement, _ORIGINAL, current)
        setattr(self.target, self.name, replacement)
        return True

    def revert(self) -> None:
        """Restores the original (used by tests)."""
        current = self.target.__dict__.get(self.name)
        if getattr(current, _MARK, None) != self.id:
            return
        original = getattr(current, _ORIGINAL)
        if original is None:
            delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, original)


def original(replacement: Any) -> Any:
    """The attribute a patch replaced."""
    return getattr(replacement, _ORIGINAL)
