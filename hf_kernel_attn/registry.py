"""One generic name -> object registry, and the one policy every registry of the package follows (kernels,
long-context tasks, training tasks, training stages).

* registering the same object again under its name is a no-op; so is registering the same *definition* again
  (a class or function with the same ``module:qualname``: a module executed twice, by ``importlib.reload`` or a
  notebook cell run again), which replaces the old object with the new one; two instances are never the same
  definition;
* a different object under a taken name is a ``ValueError`` naming the kind, the name and both objects;
* an object that is not a subclass (or, for a registry of instances, an instance) of the registry's base class is
  a ``TypeError`` naming the base;
* an entry may be lazy, a ``"module:object"`` string: the module is imported and the object checked on the first
  :meth:`Registry.get`;
* an unknown name is an :class:`UnknownNameError` (both a ``KeyError`` and a ``ValueError``) that lists the
  valid names.

This module imports nothing from the package (and neither torch nor transformers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")
_MISSING: Any = object()


class UnknownNameError(KeyError, ValueError):
    """A name that is not registered. A ``KeyError`` (a mapping's lookup, ``registry[name]``) and a
    ``ValueError`` (a bad argument), the two types callers catch; the message names the unknown name and lists
    the valid ones."""

    def __str__(self) -> str:  # KeyError's own __str__ would quote the message
        return str(self.args[0]) if self.args else ""


def describe(obj: Any) -> str:
    """``module:qualname`` of a class or function, of an instance's class, or a lazy entry's own string."""
    if isinstance(obj, str):
        return obj
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(qualname, str):  # an instance: its class
        obj = type(obj)
        qualname = obj.__qualname__
    return f"{getattr(obj, '__module__', '?')}:{qualname}"


class Registry(Generic[T]):
    """Names -> objects of one ``kind`` (a word for messages: ``"kernel"``, ``"training stage"``).

    ``base``: every object must be a subclass of it (``instances=True``: an instance of it); None: no check.
    ``hint``: a sentence added to the unknown-name error (how to add a name of one's own).
    Iteration and :meth:`items` follow registration order; :meth:`names` is sorted."""

    def __init__(self, kind: str, base: type | None = None, *, instances: bool = False,
                 hint: str | None = None) -> None:
        self.kind = kind
        self.base = base
        self.instances = instances
        self.hint = hint
        self._entries: dict[str, T | str] = {}

    # ------------------------------------------------------------------------------------------- adding
    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T | str) -> T | str: ...

    def register(self, name: str, obj: Any = _MISSING) -> Any:
        """Add ``obj`` (or a lazy ``"module:object"`` string) under ``name`` and return it; without ``obj``, a
        decorator that does so. See the module docstring for duplicates and the base-class check."""
        if obj is _MISSING:
            return lambda target: self.register(name, target)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if isinstance(obj, str):
            module, sep, attr = obj.partition(":")
            if not (module and sep and attr):
                raise ValueError(f"{self.kind} {name!r}: a lazy entry is a 'module:object' string, got {obj!r}")
        else:
            self._check_base(obj, f"{self.kind} {name!r}")
        old = self._entries.get(name, _MISSING)
        if old is _MISSING or old is obj:
            self._entries[name] = obj
            return obj
        lazy = isinstance(old, str) or isinstance(obj, str)
        definitions = all(isinstance(getattr(x, "__qualname__", None), str) for x in (old, obj))
        if describe(old) != describe(obj) or not (lazy or definitions):  # two instances are two objects
            theirs = describe(obj) if describe(old) != describe(obj) else f"another instance of {describe(obj)}"
            raise ValueError(f"{self.kind} {name!r} is already registered by {describe(old)}; cannot register "
                             f"{theirs} under the same name: choose another name")
        if not isinstance(obj, str):  # the same definition again: the newer object (a lazy string keeps the old)
            self._entries[name] = obj
        return obj

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        """Remove ``name`` and return its entry (``default`` if absent): to undo a registration, e.g. in tests."""
        if default is _MISSING and name not in self:
            raise UnknownNameError(self._unknown(name))
        return self._entries.pop(name, default)

    # ------------------------------------------------------------------------------------------ reading
    def get(self, name: str) -> T:
        """The object registered as ``name``, a lazy entry imported and checked on first use;
        :class:`UnknownNameError` for an unknown name, ``ImportError`` / ``TypeError`` for a lazy entry that
        cannot be imported or is of the wrong type."""
        if name not in self:
            raise UnknownNameError(self._unknown(name))
        obj = self._entries[name]
        if isinstance(obj, str):
            obj = self._resolve(name, obj)
        return obj

    __getitem__ = get

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """(name, object) pairs in registration order (lazy entries resolved)."""
        return [(name, self.get(name)) for name in list(self._entries)]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # unhashable (a list from a config file): not a name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    # ---------------------------------------------------------------------------------------- internals
    def _check_base(self, obj: Any, what: str) -> None:
        if self.base is None:
            return
        if self.instances:
            if not isinstance(obj, self.base):
                raise TypeError(f"{what}: expected an instance of {describe(self.base)}, got {obj!r}")
        elif not (isinstance(obj, type) and issubclass(obj, self.base)):
            raise TypeError(f"{what}: expected a subclass of {describe(self.base)}, got {obj!r}")

    def _resolve(self, name: str, target: str) -> T:
        module_name, _, attr = target.partition(":")
        what = f"{self.kind} {name!r} (registered as {target!r})"
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"{what}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise ImportError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None
        self._check_base(obj, what)
        self._entries[name] = obj
        return obj

    def _unknown(self, name: object) -> str:
        hint = f" ({self.hint})" if self.hint else ""
        return f"unknown {self.kind} {name!r}; available {self.kind}s: {self.names()}{hint}"
