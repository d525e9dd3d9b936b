"""Deprecated since 0.2.0: moved to ``labutils.torchrun`` (this path goes in 1.0.0; the table in _deprecate.py)."""
from ._deprecate import moved_module

if __name__ == "__main__":  # python -m labutils.entry keeps working
    import sys

    from .torchrun import main

    sys.exit(main())

__getattr__ = moved_module(__name__)
