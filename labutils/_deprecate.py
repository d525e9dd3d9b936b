"""Deprecated aliases: a renamed public function keeps working, with a warning, until a stated version.

    # labutils/compare.py, after renaming cmp_tensors -> compare_tensors in 0.2.0:
    cmp_tensors = deprecated("cmp_tensors", compare_tensors, since="0.2.0", removed_in="1.0.0")

The policy (CHANGELOG.md): public names are never deleted in a minor release; they become aliases made with
:func:`deprecated`, listed under "Deprecated", and go away no earlier than the major release named by
``removed_in``.
"""
from __future__ import annotations

import functools
import re
import warnings

_VERSION = re.compile(r"^\d+(\.\d+){1,2}$")


def _version(text: str, what: str) -> tuple:
    if not isinstance(text, str) or not _VERSION.match(text):
        raise ValueError(f"{what} must be a version like '0.2.0', got {text!r}")
    return tuple(int(part) for part in text.split("."))


def deprecated(alias_name: str, new_callable, since: str, removed_in: str | None = None):
    """Return ``alias_name``: calls ``new_callable`` and emits a DeprecationWarning naming the replacement.

    ``since`` is the version that deprecated the alias; ``removed_in`` (optional, later than ``since``) the
    version that may remove it. The warning points at the caller's line. Works for functions and classes
    (calling a deprecated class alias builds an instance of the new class).
    """
    if not callable(new_callable):
        raise TypeError(f"new_callable must be callable, got {new_callable!r}")
    if not alias_name.isidentifier():
        raise ValueError(f"alias_name must be an identifier, got {alias_name!r}")
    if removed_in is not None and _version(removed_in, "removed_in") <= _version(since, "since"):
        raise ValueError(f"removed_in={removed_in} must be later than since={since}")
    _version(since, "since")
    new_name = f"{new_callable.__module__}.{new_callable.__qualname__}"
    message = (f"{alias_name} is deprecated since labutils {since}"
               + (f" and will be removed in {removed_in}" if removed_in else "")
               + f"; use {new_name} instead")

    @functools.wraps(new_callable, updated=())  # not a class's __dict__
    def alias(*args, **kwargs):
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return new_callable(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = alias_name
    alias.__doc__ = f"Deprecated: {message}.\n\n{new_callable.__doc__ or ''}".rstrip()
    # PEP 702's marker, read by type checkers and IDEs
    alias.__deprecated__ = message  # pyright: ignore[reportAttributeAccessIssue]
    return alias


def moved_module(old: str, *new: str, since: str = "0.2.0", removed_in: str = "1.0.0"):
    """The ``__getattr__`` of a module that moved: ``old.name`` forwards to ``new.name`` with a warning.

    A moved module keeps a three-line file at its old path (``labutils/dist.py`` after the move to
    ``labutils/collectives.py``)::

        from ._deprecate import moved_module
        __getattr__ = moved_module(__name__, "collectives")

    so ``from labutils.dist import all_to_all`` keeps working until ``removed_in``, with a warning. Each of
    ``new`` (tried in order, for a module split in two) is relative to the top package, so a renamed copy of
    the package (``mylab/``) keeps its shims working.
    """
    import importlib

    top = old.split(".")[0]
    targets = [f"{top}.{n}" for n in new]

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        for target in targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                warnings.warn(f"{old} moved to {target} in labutils {since} (the old path goes in {removed_in}): "
                              f"use {target}.{name}", DeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} (moved to {' and '.join(targets)}) has no attribute {name!r}")

    return __getattr__
