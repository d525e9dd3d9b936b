"""Red team for chapter 09's exercises (my_bias_update, my_expert_choice): the book's solutions and honest variants
pass; the library and its siblings (a router's update_expert_bias, ModernMoE's reference routes, a copied code
object), the renamed copy, pasted library or checker code, lookup tables and the chapter's known wrong answers
fail, as do answers that break the grader's general rules (mutated inputs, a tensor subclass, a helper the cell
lacks, an endless loop, patching torch, a file opened), each naming the rule it broke where one applies."""
import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook.checkers import ch09
from labutils.moe.modern import aux_free, expert_choice

BIAS, EC = "my_bias_update", "my_expert_choice"


def test_the_books_solutions_pass():
    assert "all 12 cases match (3 visible, 9 hidden)" in passes(BIAS, solution(BIAS)).text()
    assert "all 13 cases match (3 visible, 10 hidden)" in passes(EC, solution(EC)).text()


@pytest.mark.parametrize("name, src", [
    (BIAS, """
    def my_bias_update(bias, counts, rate):
        c = [float(v) for v in counts]
        mean = sum(c) / len(c)
        step = torch.tensor([rate * ((mean > v) - (mean < v)) for v in c], dtype=torch.float64)
        return (bias.double() + step - step.mean()).to(bias.dtype)
    """),
    (BIAS, """
    def my_bias_update(bias, counts, rate):
        under = (counts.double() < counts.double().mean()).to(bias.dtype)
        over = (counts.double() > counts.double().mean()).to(bias.dtype)
        delta = rate * (under - over)
        return bias + delta - delta.sum() / len(delta)
    """),
    (BIAS, """
    def my_bias_update(bias, counts, rate):
        new = bias.clone()                                  # a copy: the input stays as it was
        delta = rate * torch.sign(counts.sum() / counts.numel() - counts)
        new += delta - delta.mean()
        return new
    """),
    (EC, """
    def my_expert_choice(scores, capacity):
        T, E = scores.shape
        idx = [sorted(range(T), key=lambda t: (-float(scores[t, e]), t))[:capacity] for e in range(E)]
        idx = torch.tensor(idx, dtype=torch.int64).reshape(E, capacity)
        return idx, torch.gather(scores.t(), 1, idx)
    """),
    (EC, """
    def my_expert_choice(scores, capacity):
        cols = [torch.sort(scores[:, e], descending=True, stable=True).indices[:capacity]
                for e in range(scores.shape[1])]
        idx = torch.stack(cols)                                     # (E, C)
        return idx, scores.t().gather(1, idx)
    """),
    (EC, """
    def my_expert_choice(scores, capacity):
        order = torch.argsort(-scores.t(), dim=1, stable=True)[:, :capacity]   # ascending on -score: ties stay
        return order, torch.take_along_dim(scores.t(), order, dim=1)
    """),
], ids=["bias-python-loop", "bias-masks", "bias-in-place-on-a-copy", "ec-sorted-python", "ec-per-expert-sort",
        "ec-argsort-negated"])
def test_honest_variants_pass(name, src):
    passes(name, src)


@pytest.fixture(scope="module")
def copy_on_disk(tmp_path_factory):
    return renamed_copy(str(tmp_path_factory.mktemp("coursework")))


@pytest.mark.parametrize("name, module", [(BIAS, "from mylab.moe.modern import aux_free"),
                                          (EC, "from mylab.labutils.moe.modern.expert_choice import "
                                               "expert_choice_route")])
def test_the_renamed_copy_is_an_import(copy_on_disk, name, module):
    assert copy_on_disk.is_dir()                              # on disk, and still refused
    fails(name, f"{module}\n\ndef {name}(a, b, c=None):\n    return a\n", "import")


@pytest.mark.parametrize("name, src, rule", [
    (BIAS, "from labutils.moe.modern.aux_free import bias_update\n"
           "def my_bias_update(b, c, r):\n    return bias_update(b, c, r)", "import"),
    (BIAS, "from labutils.moe.modern.aux_free import update_expert_bias\n"
           "from labutils.moe.modern.routers import TopKRouter\n"
           "def my_bias_update(b, c, r):\n    return TopKRouter(4, len(b), 1, bias_rate=r)", "import"),
    (BIAS, "import types\nfrom labutils.moe.modern import aux_free\n"
           "def my_bias_update(b, c, r):\n    return types.FunctionType(aux_free.bias_update.__code__, {})(b, c, r)",
     "import"),
    (BIAS, "def my_bias_update(b, c, r):\n    return my_bias_update.__code__", "private"),
    (EC, "from labutils.moe.modern.expert_choice import expert_choice_route\n"
         "def my_expert_choice(s, c):\n    return expert_choice_route(s, c)", "import"),
    (EC, "from labutils.moe.modern.reference import reference_routes\nfrom labutils.moe.modern.layer import ModernMoE\n"
         "def my_expert_choice(s, c):\n    return reference_routes(ModernMoE(4, 4, 2, 1), s)", "import"),
    (EC, "def my_expert_choice(s, c):\n    return torch.sys.modules['labutils'].moe", "module-escape"),
    (BIAS, "def my_bias_update(b, c, r):\n    return eval('b')", "dynamic-code"),
    (BIAS, "def my_bias_update(b, c, r):\n    return getattr(torch, 'sign')(b)", "reflection"),
    (EC, "def my_expert_choice(s, c):\n    return s.gi_frame", "frames"),
    (EC, "torch.topk = lambda *a, **k: None\ndef my_expert_choice(s, c):\n    return s", "patching"),
    (BIAS, """
    class Anything(torch.Tensor):                            # equal to every answer
        def __eq__(self, other):
            return True

    def my_bias_update(bias, counts, rate):
        return bias.as_subclass(Anything)
    """, "dunder-def"),
], ids=["bias_update", "update_expert_bias", "code-object-copied", "__code__", "expert_choice_route",
        "reference_routes", "torch.sys", "eval", "getattr", "frames", "patching", "dunder-eq"])
def test_shortcuts_fail_naming_the_rule(name, src, rule):
    fails(name, src, rule)


@pytest.mark.parametrize("name, src, rule, kw", [
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # right numbers, written into the input
        delta = rate * torch.sign(counts.float().mean() - counts.float())
        return bias.add_(delta - delta.mean())
    """, "read-only-inputs", {}),
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # a Parameter, not a plain tensor
        delta = rate * torch.sign(counts.float().mean() - counts.float())
        return torch.nn.Parameter(bias + delta - delta.mean())
    """, "plain-answers", {}),
    (EC, """
    def my_expert_choice(scores, capacity):                  # a helper defined in another cell
        return top_c(scores.t(), capacity)
    """, "cell-alone", {}),
    (EC, """
    def my_expert_choice(scores, capacity):
        while True:
            pass
    """, "time-limit", {"case_timeout_s": 1.0}),
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # a file opened through a module torch holds
        return torch.tensor(len(torch.storage.io.open("/etc/hostname").read()))
    """, "module-escape", {}),
], ids=["mutates-bias", "parameter", "helper-elsewhere", "endless-loop", "file-opened"])
def test_runtime_rules_are_named(name, src, rule, kw):
    fails(name, src, rule, **kw)


@pytest.mark.parametrize("name, fn, call, rules", [
    (BIAS, aux_free.bias_update, "bias_update(*args)", ("identity", "private")),
    (BIAS, ch09._bias_reference, "_bias_reference(*args)", ("identity",)),
    (EC, expert_choice.expert_choice_route, "expert_choice_route(*args)", ("identity", "private")),
    (EC, ch09._expert_choice_reference, "_expert_choice_reference(*args)", ("identity",)),
], ids=["bias_update", "bias-reference", "expert_choice_route", "ec-reference"])
def test_pasted_library_and_checker_code_is_refused(name, fn, call, rules):
    """The checkers' references by identity; the library's functions by identity, or by the policy first where
    their source reads a dunder (an error message's ``type(x).__name__``)."""
    text = fails(name, pasted(fn, name, call)).text()
    assert any(f"rule '{r}'" in text for r in rules), text


@pytest.mark.parametrize("name, src", [
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # the paper's step, not mean-centred
        return bias + rate * torch.sign(counts.float().mean() - counts.float())
    """),
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # the sign the wrong way round
        delta = rate * torch.sign(counts.float() - counts.float().mean())
        return bias + delta - delta.mean()
    """),
    (BIAS, """
    def my_bias_update(bias, counts, rate):                  # proportional to the imbalance, not its sign
        delta = rate * (counts.float().mean() - counts.float())
        return bias + delta - delta.mean()
    """),
    (EC, """
    def my_expert_choice(scores, capacity):                  # topk: ties not to the earlier token
        val, idx = scores.t().topk(capacity, dim=1)
        return idx, val
    """),
    (EC, """
    def my_expert_choice(scores, capacity):                  # each expert's WORST tokens
        order = torch.sort(scores.t(), dim=1, stable=True).indices[:, :capacity]
        return order, scores.t().gather(1, order)
    """),
    (EC, """
    def my_expert_choice(scores, capacity):                  # ties to the later token
        flipped = torch.sort(scores.flip(0).t(), dim=1, descending=True, stable=True).indices[:, :capacity]
        order = scores.shape[0] - 1 - flipped
        return order, scores.t().gather(1, order)
    """),
    (EC, """
    def my_expert_choice(scores, capacity):                  # token choice: each token's best experts
        top = scores.topk(min(capacity, scores.shape[1]), dim=1).indices
        return top.t()[:, :capacity], scores.gather(1, top).t()
    """),
], ids=["bias-not-centred", "bias-sign-flipped", "bias-proportional", "ec-topk-ties", "ec-ascending",
        "ec-later-token", "ec-token-choice"])
def test_known_wrong_answers_fail(name, src):
    fails(name, src)


def test_a_lookup_table_of_the_visible_bias_updates_fails_the_hidden_ones():
    table = {str(c[1].tolist()): ch09._bias_reference(*c).tolist() for c in ch09.BIAS_VISIBLE}
    src = (f"TABLE = {table!r}\n\ndef my_bias_update(bias, counts, rate):\n"
           "    return torch.tensor(TABLE[str(counts.tolist())])\n")
    assert "0 of 9 hidden cases match" in fails(BIAS, src).text()


def test_a_lookup_table_of_the_visible_routings_fails_the_hidden_ones():
    table = {str(c[0].tolist()): [t.tolist() for t in ch09._expert_choice_reference(*c)] for c in ch09.EC_VISIBLE}
    src = (f"TABLE = {table!r}\n\ndef my_expert_choice(scores, capacity):\n"
           "    idx, gates = TABLE[str(scores.tolist())]\n"
           "    return torch.tensor(idx), torch.tensor(gates)\n")
    assert "0 of 10 hidden cases match" in fails(EC, src).text()
