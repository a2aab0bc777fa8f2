"""One small utility for every change the plugin makes to a vLLM class.

A :class:`Patch` names its target attribute and builds the replacement from the original, which
it keeps and calls. Applying a patch twice is a no-op (vLLM loads general plugins in every
process, sometimes twice). Several features may hook one attribute: each patch wraps what is
there, so they run in the order they are applied (the registry's, ``patches/__init__.py``), the
last applied outermost; a patch is reverted only from the outside in.
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
        return self.id in applied_ids(self.target.__dict__.get(self.name))

    def apply(self) -> bool:
        """Installs the patch over whatever is there. Returns False if it was already
        installed."""
        current = self.target.__dict__.get(self.name)
        if self.id in applied_ids(current):
            return False
        if self.new and current is not None:
            raise PatchError(f"{self.attribute} exists; the plugin only adds what is missing")
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
        """Restores what the patch replaced (used by tests). A patch with another applied over
        it is refused: revert that one first."""
        current = self.target.__dict__.get(self.name)
        ids = applied_ids(current)
        if self.id not in ids:
            return
        if ids[0] != self.id:
            raise PatchError(f"{self.attribute}: revert {ids[0]} first")
        original = getattr(current, _ORIGINAL)
        if original is None:
            delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, original)


def applied_ids(attribute: Any) -> list[str]:
    """The ids of the patches applied to an attribute, outermost first."""
    ids = []
    while (mark := getattr(attribute, _MARK, None)) is not None:
        ids.append(mark)
        attribute = getattr(attribute, _ORIGINAL)
    return ids


def original(replacement: Any) -> Any:
    """The attribute a patch replaced."""
    return getattr(replacement, _ORIGINAL)
