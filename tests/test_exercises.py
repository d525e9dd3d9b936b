"""The exercise-checker core (labbook.exercises): the guard sees every way into the library, hidden cases beat a
lookup table, integers are compared exactly. Chapter checkers are red-teamed in test_exercise_cheats_chNN.py."""
import functools
import sys
import types

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.exercises import check_exercise
from labbook.guard import Guard, OffLimits, forbid, guarded_call, trusted
from labutils.moe import FMoETransformerMLP, count_by_gate
from labutils.moe.functions import MOEGatherCombine


def honest(gate_idx, num_expert):
    flat = gate_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, num_expert)
    pos = torch.argsort(key, stable=True)[: int((flat >= 0).sum())]
    return pos, torch.bincount(flat[flat >= 0], minlength=num_expert)


def brute(gate_idx, num_expert):
    flat = gate_idx.reshape(-1).tolist()
    pos = [i for e in range(num_expert) for i, v in enumerate(flat) if v == e]
    return torch.tensor(pos, dtype=torch.long), torch.tensor([flat.count(e) for e in range(num_expert)])


VISIBLE = [(torch.tensor([[0, 2], [1, -1], [2, 0]]), 3), (torch.zeros(0, 2, dtype=torch.long), 4)]


def hidden(gen, i):
    t = int(torch.randint(1, 30, (1,), generator=gen))
    return torch.randint(-1, 6, (t, 2), generator=gen), 6


def check(fn, **kw):
    check_exercise("count_by_gate", fn, brute, *VISIBLE, hidden=hidden, **kw)


_copied = types.FunctionType(count_by_gate.__code__, count_by_gate.__globals__, None, count_by_gate.__defaults__)
_TABLE = {str(c[0].tolist()): brute(*c) for c in VISIBLE}


def test_honest_passes_and_prints_visible_cases_and_a_hidden_count(capsys):
    must_pass(check, honest)
    out = capsys.readouterr().out
    assert "8 of 8 hidden cases match" in out and "all 10 cases match (2 visible, 8 hidden)" in out


@pytest.mark.parametrize("cheat", [
    lambda g, e: count_by_gate(g, e)[:2],                                       # the library
    functools.partial(lambda f, g, e: f(g, e)[:2], count_by_gate),             # through a partial
    lambda g, e: _copied(g, e)[:2],                                             # a copied code object
    lambda g, e: _TABLE[str(g.tolist())],                                       # a lookup table
], ids=["library", "partial", "copied-code", "lookup-table"])
def test_cheats_fail(cheat):
    must_fail(check, cheat)


def test_catching_the_refusal_does_not_help_and_switching_the_guard_off_is_seen(capsys):
    def catches(g, e):
        try:
            return count_by_gate(g, e)[:2]
        except OffLimits:
            return honest(g, e)

    def switches_off(g, e):
        sys.setprofile(None)
        return count_by_gate(g, e)[:2]

    must_fail(check, catches)
    must_fail(check, switches_off)
    assert "switching the checker's guard off" in capsys.readouterr().out
    assert sys.getprofile() is None  # the guard restores the previous hook


def test_the_library_handed_in_as_the_answer_fails():
    def as_answer(g, e):
        return count_by_gate(g, e)
    must_fail(lambda fn: check_exercise("cbg", fn, lambda g, e: count_by_gate(g, e), *VISIBLE), count_by_gate)
    must_fail(lambda fn: check_exercise("cbg", fn, lambda g, e: count_by_gate(g, e), *VISIBLE), as_answer)


def test_named_torch_ops_are_refused_only_where_the_student_calls_them():
    x = torch.arange(6.0)
    ref = lambda t: t[:3]  # noqa: E731
    must_fail(lambda fn: check_exercise("half", fn, ref, x, ops={"chunk"}), lambda t: torch.chunk(t, 2)[0])
    must_fail(lambda fn: check_exercise("half", fn, ref, x, ops={"chunk"}), lambda t: t.chunk(2)[0])
    check_exercise("half", lambda t: t[: len(t) // 2], ref, x, ops={"chunk"})


def test_a_trusted_checker_wrapper_may_take_gradients_around_the_student():
    @trusted
    def with_grad(fn, x):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        return y.detach(), g

    ref = lambda x: (x * x, 2 * x)  # noqa: E731
    x = torch.randn(5)
    check_exercise("square", lambda x: with_grad(lambda t: t * t, x), ref, x)
    must_fail(lambda fn: check_exercise("square", lambda x: with_grad(fn, x), ref, x), lambda t: t.detach() ** 2)


def test_integers_are_compared_exactly_not_within_a_tolerance(capsys):
    with pytest.raises(AssertionError):
        check_exercise("capacity", lambda n: torch.tensor(n * 1000 + 1), lambda n: torch.tensor(n * 1000), 1000)
    assert "integers, compared exactly (1 wrong)" in capsys.readouterr().out
    with pytest.raises(AssertionError):
        check_exercise("capacity", lambda n: 30.5, lambda n: 31, 1)
    check_exercise("capacity", lambda n: 31.0, lambda n: 31, 1)  # an exact integer in a float is the same number


def test_forbid_blocks_named_modules_and_autograd_functions_and_restores():
    layer = FMoETransformerMLP(num_expert=4, d_model=8, d_hidden=16)
    x = torch.randn(3, 8)
    before = layer(x)
    with pytest.raises(OffLimits, match="FMoETransformerMLP"), forbid(FMoETransformerMLP):
        layer(x)
    with pytest.raises(OffLimits, match="MOEGatherCombine"), forbid(MOEGatherCombine):
        layer(x)
    assert torch.equal(layer(x), before)
    with pytest.raises(TypeError, match="functions and classes"), forbid(3):
        pass


def test_guarded_call_reports_and_library_internals_are_not_violations():
    _, violations = guarded_call(lambda: FMoETransformerMLP(num_expert=2, d_model=4, d_hidden=8))
    assert len(violations) == 1 and "FMoETransformerMLP" in violations[0]  # one crossing, not every inner call
    result, violations = guarded_call(lambda: torch.ones(2).sum())
    assert violations == [] and float(result) == 2.0
    with Guard() as g:
        pass
    assert g.violations == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="visible cases, hidden="):
        check_exercise("x", lambda: 1, lambda: 1)


def test_a_library_imported_inside_the_exercise_is_covered_too():
    """DeepSpeed not yet imported when the checker starts: importing and calling it inside the student's function
    still fails (the guard covers where the library would load from). A fresh process, so nothing imported it."""
    import subprocess

    code = (
        "import sys\n"
        "from labbook.exercises import check_exercise\n"
        "assert 'deepspeed' not in sys.modules\n"
        "def cheat(S, E):\n"
        "    from deepspeed.moe.sharded_moe import _capacity\n"
        "    import torch\n"
        "    return int(_capacity(torch.zeros(S, E), torch.tensor(1.0), torch.tensor(0)))\n"
        "try:\n"
        "    check_exercise('cap', cheat, lambda S, E: -(-S // E), (10, 4))\n"
        "except AssertionError:\n"
        "    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "refused" in out.stdout and "OFF LIMITS: calls deepspeed" in out.stdout, out.stdout + out.stderr


def test_reading_the_checkers_frames_finds_no_answer():
    def walks_the_stack(g, e):
        frame = sys._getframe(1)
        while frame is not None:
            for value in frame.f_locals.values():
                if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.Tensor):
                    return value
            frame = frame.f_back
        raise KeyError("no answer in any frame")

    def walks_a_traceback(g, e):
        try:
            raise ValueError
        except ValueError as exc:
            tb = exc.__traceback__
            frame = tb.tb_frame.f_back if tb is not None else None
            while frame is not None:
                if "want" in frame.f_locals:
                    return frame.f_locals["want"]
                frame = frame.f_back
        raise KeyError("no answer in any frame")

    must_fail(check, walks_the_stack)
    must_fail(check, walks_a_traceback)
