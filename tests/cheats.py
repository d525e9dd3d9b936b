"""Shared by the red-team tests (tests/test_exercise_cheats_chNN.py): every exercise's honest solution must pass
its checker, and every shortcut a student could take must fail it."""
import pytest


def must_pass(check, fn, **kwargs):
    """The honest solution passes (hidden cases drawn from a fresh seed every run)."""
    check(fn, **kwargs)


def must_fail(check, fn, why: str = "", **kwargs):
    """A cheat fails the checker with AssertionError (a wrong answer, a hidden case missed, or an off-limits call).
    ``why`` names the shortcut in the failure message if the cheat gets through."""
    with pytest.raises(AssertionError):
        check(fn, **kwargs)
        pytest.fail(f"a cheat passed the checker: {why or fn}")  # reached only if check() did not raise
