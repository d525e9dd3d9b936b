"""Red team for chapter 05's exercises (balance_entropy, my_steps_to_reach) on the grader: the book's solution and
honest variants pass; the library (lm_study.summary.steps_to_reach, train_modern.balance_stats), the renamed coursework
copy, pasted library or checker code, a lookup table of the visible cases, the notebook's globals, a mutated input
and the chapter's likely wrong answers fail, each naming the rule it broke where one applies."""
import re

import pytest
from redteam import fails, only_hidden_wrong, passes, pasted, renamed_copy, solution, with_body, wrong

from labbook import train_modern
from labbook.checkers import ch05
from labbook.lm_study import summary

ENTROPY, REACH = "balance_entropy", "my_steps_to_reach"





@pytest.mark.parametrize("name, line", [(ENTROPY, "all 13 cases match (3 visible, 10 hidden)"),
                                        (REACH, "all 18 cases match (6 visible, 12 hidden)")])
def test_the_books_solution_passes(name, line):
    assert line in passes(name, solution(name)).text()


@pytest.mark.parametrize("name", [ENTROPY, REACH])
def test_the_renamed_copy_is_an_import(tmp_path_factory, name):
    assert renamed_copy(str(tmp_path_factory.mktemp("coursework"))).is_dir()     # on disk, and still refused
    fails(name, with_body(name, "import mylab.moe as lab", "    return r"), "import")


# --- exercise 1: balance_entropy ------------------------------------------------------------------------------

@pytest.mark.parametrize("src", [
    """
    def balance_entropy(load):
        share = load.sum(dim=0).to(torch.float64)
        share /= share.sum()
        return torch.special.entr(share).sum() / math.log(share.numel())     # entr(0) = 0
    """,
    """
    def balance_entropy(load):
        totals = [0] * load.shape[1]
        for row in load.tolist():
            for e, n in enumerate(row):
                totals[e] += n
        grand = sum(totals)
        h = sum(-(n / grand) * math.log(n / grand) for n in totals if n > 0)
        return h / math.log(len(totals))
    """,
    """
    def balance_entropy(load):
        p = load.float().sum(0)
        p = p / p.sum()
        return -torch.xlogy(p, p).sum() / torch.log(torch.tensor(float(load.shape[-1])))   # float32 is close enough
    """,
], ids=["entr-float64", "python-loop", "xlogy-float32"])
def test_balance_entropy_honest_variants_pass(src):
    passes(ENTROPY, src)


@pytest.mark.parametrize("head, body, rule", [
    ("from labbook.train_modern import balance_stats", "    return balance_stats(args[0].sum(0))[1]", "import"),
    ("", "    from labbook import train_modern\n"
         "    return torch.tensor(train_modern.balance_stats(args[0].sum(0))).select(0, 1)", "import"),
    ("", "    return summary['balance'][0]", "cell-alone"),
    ("", "    args[0].mul_(0)\n    return 1.0", "read-only-inputs"),
    ("", "    out = []\n    for row in args[0].double():\n        p = row / row.sum() if row.sum() > 0 else row\n"
         "        out.append(torch.special.entr(p).sum() / math.log(args[0].shape[1]))\n"
         "    return torch.stack(out).mean()", None),
], ids=["library-import", "library-in-body", "notebook-global", "mutates-load", "mean-of-per-window-entropies"])
def test_balance_entropy_shortcuts_fail(head, body, rule):
    src = with_body(ENTROPY, head, body)
    fails(ENTROPY, src, rule) if rule else wrong(ENTROPY, src)


def test_log_of_the_live_experts_fits_the_visible_cases_but_not_the_hidden():
    only_hidden_wrong(wrong(ENTROPY, """
    def balance_entropy(load):
        share = load.sum(0).double()
        share = share / share.sum()
        live = int((share > 0).sum())
        return torch.special.entr(share).sum() / math.log(max(live, 2))    # log(live experts), not log(E)
    """))


# --- exercise 2: my_steps_to_reach ----------------------------------------------------------------------------

@pytest.mark.parametrize("src", [
    """
    def my_steps_to_reach(steps, losses, target):
        i = 0
        while i < len(losses) and losses[i] > target:
            i += 1
        if i == len(losses):
            return None
        if i == 0:
            return float(steps[0])
        slope = (steps[i] - steps[i - 1]) / (losses[i] - losses[i - 1])
        return steps[i] + (target - losses[i]) * slope
    """,
    """
    def my_steps_to_reach(steps, losses, target):
        v = torch.tensor(losses, dtype=torch.float64)
        s = torch.tensor(steps, dtype=torch.float64)
        hits = torch.nonzero(v <= target).flatten()
        if hits.numel() == 0:
            return None
        i = int(hits[0])
        if i == 0:
            return s[0]
        return torch.lerp(s[i - 1], s[i], (v[i - 1] - target) / (v[i - 1] - v[i]))   # a float64 tensor
    """,
    """
    def my_steps_to_reach(steps, losses, target):
        points = list(zip(steps, losses))
        if points[0][1] <= target:
            return float(points[0][0])
        for (s0, v0), (s1, v1) in zip(points, points[1:]):
            if v1 <= target:
                return s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
        return None
    """,
], ids=["while-loop-slope", "torch-lerp", "pairs"])
def test_my_steps_to_reach_honest_variants_pass(src):
    passes(REACH, src)


@pytest.mark.parametrize("head, body, rule", [
    ("from labbook.lm_study.summary import steps_to_reach", "    return steps_to_reach(*args)", "import"),
    ("from labbook import lm_study", "    return lm_study.summary.steps_to_reach(*args)", "import"),
    ("import labbook.lm_study.summary as s", "    return s.steps_to_reach(*args)", "import"),
    ("", "    for run in record['runs']:\n        if run['val'] == list(args[1]):\n"
         "            return run['val_steps'][-1] / summary['speedup']['values'][0]", "cell-alone"),
    ("", "    args[1][0] = args[2]\n    return r", "read-only-inputs"),
    ("", "    args[0].clear()\n    return 250.0", "read-only-inputs"),
    ("", "    return next((float(s) for s, v in zip(args[0], args[1]) if v <= args[2]), None)", None),
    ("", "    return -1.0 if r is None else r", None),
    ("", "    return None if r is None else (1, r)", None),
], ids=["library-import", "library-module", "library-submodule", "notebook-record", "mutates-losses",
        "clears-steps", "no-interpolation", "minus-one-for-never", "a-pair"])
def test_my_steps_to_reach_shortcuts_fail(head, body, rule):
    src = with_body(REACH, head, body)
    fails(REACH, src, rule) if rule else wrong(REACH, src)


def test_strictly_below_fails_on_the_visible_tie():
    """'<' where the definition says 'at or below': the curve that touches the target and rises again (case 5)."""
    report = wrong(REACH, solution(REACH).replace("v <= target", "v < target"))
    assert "case 5" in report.reason
    assert re.search(r"case 5 out 0 +\| exact: False", report.text()), report.text()


def test_an_answer_rounded_to_float32_is_outside_the_stated_tolerance():
    """The exercise is graded at rtol = atol = 1e-9; float32 keeps about 7 digits (off by ~1e-5 at step 500)."""
    fails(REACH, with_body(REACH, "", "    return None if r is None else float(torch.tensor(r))"))


def test_a_notebook_name_read_when_the_cell_loads_is_cell_alone():
    """The NameError of 'notebook-record' above, at the cell's top level (run when the grader loads the cell)."""
    fails(REACH, with_body(REACH, "RUNS = record['runs']", "    return RUNS[0]['val_steps'][-1]"), "cell-alone")


# --- both exercises: a lookup table of the visible cases, pasted library and checker code ----------------------

ENTROPY_TABLE = {str(c[0].tolist()): ch05._entropy_reference(*c) for c in ch05.ENTROPY_VISIBLE}
REACH_TABLE = {(tuple(s), tuple(v), t): ch05._reach_reference(s, v, t) for s, v, t in ch05.REACH_VISIBLE}
LOOKUPS = {
    ENTROPY: f"TABLE = {ENTROPY_TABLE!r}\n\ndef balance_entropy(load):\n"
             "    return TABLE.get(str(load.tolist()), 0.5)\n",
    REACH: f"TABLE = {REACH_TABLE!r}\n\ndef my_steps_to_reach(steps, losses, target):\n"
           "    reached, step = TABLE.get((tuple(steps), tuple(losses), target), (0, 0.0))\n"
           "    return step if reached else None\n",
}


@pytest.mark.parametrize("name", LOOKUPS)
def test_a_lookup_table_of_the_visible_cases_fails_on_hidden_cases(name):
    only_hidden_wrong(wrong(name, LOOKUPS[name]))


@pytest.mark.parametrize("name, fn, call", [
    (ENTROPY, train_modern.balance_stats, "balance_stats(args[0].sum(0))[1]"),
    (ENTROPY, ch05._entropy_reference, "_entropy_reference(*args)"),
    (REACH, summary.steps_to_reach, "steps_to_reach(*args)"),
    (REACH, ch05._reach_reference, "(lambda r: r[1] if r[0] else None)(_reach_reference(*args))"),
    (REACH, summary.loss_at, "loss_at(list(reversed(args[1])), list(reversed(args[0])), args[2])"),
], ids=["train_modern.balance_stats", "entropy-checker-reference", "lm_study.summary.steps_to_reach",
        "reach-checker-reference", "sibling-loss_at"])
def test_pasted_library_and_checker_code_is_identity(name, fn, call):
    fails(name, pasted(fn, name, call), "identity")


def test_pasted_library_code_with_every_name_changed_is_still_identity():
    src = pasted(summary.steps_to_reach, REACH, "reach(*args)")
    for old, new in (("steps_to_reach", "reach"), ("prev_s", "a"), ("prev_v", "b"), ("losses", "ys"),
                     ("steps", "xs"), ("target", "goal")):
        src = re.sub(rf"\b{old}\b", new, src)
    src = re.sub(r'""".*?"""', '"""mine"""', src, flags=re.S)                 # its own docstring
    assert "steps_to_reach" not in src.replace(REACH, "")
    fails(REACH, src, "identity")
