"""Bad input of the book's check helpers (:mod:`labutils.compare`), audited with issue 41's habit: ``must_fail``
(added since round four) refuses, before its block runs, a control without a name and an ``errors`` that is not
an exception class. Before, ``must_fail(ValueError)`` let the block's ValueError through as if the check had
broken, and ``errors="ValueError"`` was Python's "catching classes that do not inherit from BaseException is not
allowed", raised only once the block raised. A positive control beside each refusal."""
import pytest

from labutils.compare import must_fail


def _raises(exc):
    def block():
        raise exc
    return block


def _run(block, *args, **kwargs):
    with must_fail(*args, **kwargs):
        block()


@pytest.mark.parametrize("name, hint", [
    (ValueError, r"<class 'ValueError'> \(an exception class goes to errors=: must_fail\('what the control shows', "
                 r"errors=ValueError\)\)"),
    ("", r"''"),
    ("  ", r"'  '"),
    (None, r"None"),
], ids=["exception-class", "empty", "blank", "none"])
def test_must_fail_without_a_name_is_refused_before_the_block(name, hint):
    ran = []
    with pytest.raises(TypeError, match=r"^must_fail: name must be a non-empty str naming the control, got " + hint
                       + "$"):
        _run(lambda: ran.append(1), name)
    assert ran == [], "refused before the block ran"


@pytest.mark.parametrize("errors, shown", [
    ("ValueError", r"'ValueError'"),
    (ValueError("x"), r"ValueError\('x'\)"),
    ((ValueError, 3), r"\(<class 'ValueError'>, 3\)"),
    ((), r"\(\)"),
    (int, r"<class 'int'>"),
], ids=["str", "instance", "tuple-with-int", "empty-tuple", "not-an-exception"])
def test_must_fail_errors_that_are_not_exception_classes_are_refused_before_the_block(errors, shown):
    ran = []
    for block in (lambda: ran.append(1), _raises(ValueError("boom"))):   # a block that runs through, one that raises
        with pytest.raises(TypeError, match=r"^must_fail\('control'\): errors must be an exception class or a tuple "
                                            r"of them, e\.g\. errors=\(AssertionError, ValueError\), got " + shown
                           + "$"):
            _run(block, "control", errors=errors)
    assert ran == [], "refused before the block ran"


def test_must_fail_control_catches_what_it_names_and_says_when_nothing_was_raised(capsys):
    _run(_raises(AssertionError("the check\nsecond line\nthird")), "default errors")
    _run(_raises(KeyError("k")), "a tuple", errors=(ValueError, KeyError))
    assert capsys.readouterr().out.splitlines() == [
        "✅ default errors: the check fails as it should: the check | second line",
        "✅ a tuple: the check fails as it should: 'k'"]
    with pytest.raises(AssertionError, match=r"^FAILED: ran through: the block raised nothing, so the check it guards "
                                             r"cannot fail$"):
        _run(lambda: None, "ran through")
    with pytest.raises(ValueError, match="not the one named"):              # an error it does not name goes through
        _run(_raises(ValueError("not the one named")), "wrong kind")
