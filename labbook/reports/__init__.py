"""labbook.reports: the book's sentences, written from what a chapter measured (issue 39).

A chapter measures into one plain dict of results (``R``), checks it in its own cells, and narrates it here:
``labbook/reports/chNN.py`` holds one function per paragraph, ``f(R) -> str`` returning Markdown, so a teaching
cell reads ``show(ch02.summary(R))`` instead of forty lines of f-strings. Each function is tested
(``tests/test_reports_chNN.py``) on a recorded results dict and on a second one where the verdict flips: the
sentence must change with it.
"""
from __future__ import annotations

__all__ = ["show"]


def show(markdown: str) -> None:
    """Display ``markdown`` as Markdown in a notebook; print it anywhere else (a script, a test)."""
    if not isinstance(markdown, str):
        raise TypeError(f"show(markdown) takes the str a report function returns, got {type(markdown).__name__}")
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # pragma: no cover - IPython ships with Jupyter
        print(markdown)
        return
    if get_ipython() is None:
        print(markdown)
    else:
        display(Markdown(markdown))
