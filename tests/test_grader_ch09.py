"""Red team for chapter 09's exercises (my_bias_update, my_expert_choice): the book's solutions and two honest
variants each pass; the library, pasted library or checker code, lookup tables and near misses fail, each naming
the rule it broke."""
import pytest
from redteam import fails, passes, pasted, solution

from labbook.checkers import ch09
from labutils.moe.modern import aux_free, expert_choice


def test_the_books_solutions_pass():
    assert "all 12 cases match (3 visible, 9 hidden)" in passes("my_bias_update", solution("my_bias_update")).text()
    assert "all 13 cases match (3 visible, 10 hidden)" in passes("my_expert_choice",
                                                                 solution("my_expert_choice")).text()


@pytest.mark.parametrize("name, src", [
    ("my_bias_update", """
    def my_bias_update(bias, counts, rate):
        c = [float(v) for v in counts]
        mean = sum(c) / len(c)
        step = torch.tensor([rate * ((mean > v) - (mean < v)) for v in c], dtype=torch.float64)
        return (bias.double() + step - step.mean()).to(bias.dtype)
    """),
    ("my_bias_update", """
    def my_bias_update(bias, counts, rate):
        under = (counts.double() < counts.double().mean()).to(bias.dtype)
        over = (counts.double() > counts.double().mean()).to(bias.dtype)
        delta = rate * (under - over)
        return bias + delta - delta.sum() / len(delta)
    """),
    ("my_expert_choice", """
    def my_expert_choice(scores, capacity):
        T, E = scores.shape
        idx = [sorted(range(T), key=lambda t: (-float(scores[t, e]), t))[:capacity] for e in range(E)]
        idx = torch.tensor(idx, dtype=torch.int64).reshape(E, capacity)
        return idx, torch.gather(scores.t(), 1, idx)
    """),
    ("my_expert_choice", """
    def my_expert_choice(scores, capacity):
        cols = [torch.sort(scores[:, e], descending=True, stable=True).indices[:capacity]
                for e in range(scores.shape[1])]
        idx = torch.stack(cols)                                     # (E, C)
        return idx, scores.t().gather(1, idx)
    """),
], ids=["bias-python-loop", "bias-masks", "ec-sorted-python", "ec-per-expert-sort"])
def test_honest_variants_pass(name, src):
    passes(name, src)


@pytest.mark.parametrize("name, src, rule", [
    ("my_bias_update", "from labutils.moe.modern.aux_free import bias_update\n"
                       "def my_bias_update(b, c, r):\n    return bias_update(b, c, r)", "import"),
    ("my_bias_update", "from mylab.moe.modern import aux_free\n"
                       "def my_bias_update(b, c, r):\n    return aux_free.bias_update(b, c, r)", "import"),
    ("my_expert_choice", "from labutils.moe.modern.expert_choice import expert_choice_route\n"
                         "def my_expert_choice(s, c):\n    return expert_choice_route(s, c)", "import"),
    ("my_expert_choice", "def my_expert_choice(s, c):\n    return torch.sys.modules['labutils'].moe", "module-escape"),
    ("my_bias_update", "def my_bias_update(b, c, r):\n    return eval('b')", "dynamic-code"),
], ids=["aux_free", "renamed-copy", "expert_choice_route", "torch.sys", "eval"])
def test_shortcuts_fail_naming_the_rule(name, src, rule):
    fails(name, src, rule)


@pytest.mark.parametrize("name, fn, call", [
    ("my_bias_update", aux_free.bias_update, "bias_update(*args)"),
    ("my_bias_update", ch09._bias_reference, "_bias_reference(*args)"),
    ("my_expert_choice", expert_choice.expert_choice_route, "expert_choice_route(*args)"),
    ("my_expert_choice", ch09._expert_choice_reference, "_expert_choice_reference(*args)"),
], ids=["bias_update", "bias-reference", "expert_choice_route", "ec-reference"])
def test_pasted_library_code_is_refused(name, fn, call):
    fails(name, pasted(fn, name, call), says="rule '")


@pytest.mark.parametrize("name, src", [
    ("my_bias_update", """
    def my_bias_update(bias, counts, rate):                  # not mean-centred
        return bias + rate * torch.sign(counts.float().mean() - counts.float())
    """),
    ("my_bias_update", """
    def my_bias_update(bias, counts, rate):                  # the sign the wrong way round
        delta = rate * torch.sign(counts.float() - counts.float().mean())
        return bias + delta - delta.mean()
    """),
    ("my_expert_choice", """
    def my_expert_choice(scores, capacity):                  # topk: ties not to the earlier token
        val, idx = scores.t().topk(capacity, dim=1)
        return idx, val
    """),
    ("my_expert_choice", """
    def my_expert_choice(scores, capacity):                  # each expert's WORST tokens
        order = torch.sort(scores.t(), dim=1, stable=True).indices[:, :capacity]
        return order, scores.t().gather(1, order)
    """),
], ids=["bias-not-centred", "bias-sign-flipped", "ec-topk-ties", "ec-ascending"])
def test_near_misses_fail(name, src):
    fails(name, src)


def test_a_lookup_table_of_the_visible_cases_fails_the_hidden_ones():
    table = {str(c[1].tolist()): ch09._bias_reference(*c).tolist() for c in ch09.BIAS_VISIBLE}
    src = (f"TABLE = {table!r}\n\ndef my_bias_update(bias, counts, rate):\n"
           "    return torch.tensor(TABLE[str(counts.tolist())])\n")
    assert "case 0" in fails("my_bias_update", src).text()
