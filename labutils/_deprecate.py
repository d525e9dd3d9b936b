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
    alias.__deprecated__ = message  # PEP 702's marker, read by type checkers and IDEs
    return alias
