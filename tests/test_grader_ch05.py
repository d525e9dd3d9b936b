"""Red team for chapter 05's exercises (balance_entropy, my_steps_to_reach) on the grader: the book's solution and
honest variants pass; the library (lm_study.steps_to_reach, train_modern.balance_stats), the renamed coursework
copy, pasted library or checker code, a lookup table of the visible cases, the notebook's globals, a mutated input
and the chapter's likely wrong answers fail, each naming the rule it broke where one applies."""
import re

import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook import lm_study, train_modern
from labbook.checkers import ch05


def wrong(name, src):
    """``src`` runs and answers every case, and some answers are wrong: no rule broken, nothing raised."""
    report = fails(name, src)
    assert "rule '" not in report.text() and "raised" not in report.text(), report.text()
    return report


def only_hidden_wrong(report):
    """Every visible case matched; the cases that did not are hidden ones (the shortcut fits the printed cases)."""
    wrong = re.search(r"\(([^)]*)\); hidden seed", report.reason).group(1).replace(" ...", "").split(", ")
    assert all(label.startswith("hidden") for label in wrong), report.text()


# --- exercise 1: balance_entropy ------------------------------------------------------------------------------

ENTROPY = "balance_entropy"
ENTROPY_TABLE = {str(c[0].tolist()): ch05._entropy_reference(*c) for c in ch05.ENTROPY_VISIBLE}


def test_balance_entropy_books_solution_passes():
    assert "all 13 cases match (3 visible, 10 hidden)" in passes(ENTROPY, solution(ENTROPY)).text()


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


@pytest.mark.parametrize("src, rule", [
    ("""
    from labbook.train_modern import balance_stats
    def balance_entropy(load):
        return balance_stats(load.sum(0))[1]
    """, "import"),
    ("""
    def balance_entropy(load):
        from labbook import train_modern
        return torch.tensor(train_modern.balance_stats(load.sum(0))).select(0, 1)
    """, "import"),
    ("""
    def balance_entropy(load):
        return summary["balance"][0]
    """, "cell-alone"),
    ("""
    def balance_entropy(load):
        load.mul_(0)
        return 1.0
    """, "read-only-inputs"),
    ("""
    def balance_entropy(load):
        out = []
        for row in load.double():
            p = row / row.sum() if row.sum() > 0 else row
            out.append(torch.special.entr(p).sum() / math.log(load.shape[1]))
        return torch.stack(out).mean()
    """, None),
], ids=["library-import", "library-in-body", "notebook-global", "mutates-load", "mean-of-per-window-entropies"])
def test_balance_entropy_shortcuts_fail(src, rule):
    fails(ENTROPY, src, rule) if rule else wrong(ENTROPY, src)


def test_balance_entropy_renamed_copy_is_an_import(tmp_path_factory):
    renamed_copy(str(tmp_path_factory.mktemp("coursework")))
    fails(ENTROPY, """
    import mylab.moe as lab
    def balance_entropy(load):
        share = load.sum(0).double() / load.sum()
        return torch.special.entr(share).sum() / math.log(load.shape[1])
    """, "import")


@pytest.mark.parametrize("src", [
    f"TABLE = {ENTROPY_TABLE!r}\n\ndef balance_entropy(load):\n    return TABLE.get(str(load.tolist()), 0.5)\n",
    """
    def balance_entropy(load):
        share = load.sum(0).double()
        share = share / share.sum()
        live = int((share > 0).sum())
        return torch.special.entr(share).sum() / math.log(max(live, 2))    # log(live experts), not log(E)
    """,
], ids=["lookup-table", "log-of-live-experts"])
def test_balance_entropy_fits_the_visible_cases_but_not_the_hidden(src):
    only_hidden_wrong(wrong(ENTROPY, src))


@pytest.mark.parametrize("fn, call", [
    (train_modern.balance_stats, "balance_stats(args[0].sum(0))[1]"),
    (ch05._entropy_reference, "_entropy_reference(*args)"),
], ids=["train_modern.balance_stats", "checker-reference"])
def test_balance_entropy_pasted_code_is_identity(fn, call):
    fails(ENTROPY, pasted(fn, ENTROPY, call), "identity")


# --- exercise 2: my_steps_to_reach ----------------------------------------------------------------------------

REACH = "my_steps_to_reach"
REACH_TABLE = {(tuple(s), tuple(v), t): ch05._reach_reference(s, v, t) for s, v, t in ch05.REACH_VISIBLE}
HONEST_REACH = solution(REACH).replace(f"def {REACH}(", "def honest(")


def test_my_steps_to_reach_books_solution_passes():
    assert "all 18 cases match (6 visible, 12 hidden)" in passes(REACH, solution(REACH)).text()


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
        return torch.lerp(s[i - 1], s[i], (v[i - 1] - target) / (v[i - 1] - v[i]))
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


@pytest.mark.parametrize("src, rule", [
    ("from labbook.lm_study import steps_to_reach\n\ndef my_steps_to_reach(steps, losses, target):\n"
     "    return steps_to_reach(steps, losses, target)\n", "import"),
    ("from labbook import lm_study\n\ndef my_steps_to_reach(steps, losses, target):\n"
     "    return lm_study.steps_to_reach(list(steps), list(losses), target)\n", "import"),
    ("import labbook.lm_study.summary as s\n\ndef my_steps_to_reach(steps, losses, target):\n"
     "    return s.steps_to_reach(steps, losses, target)\n", "import"),
    ("""
    def my_steps_to_reach(steps, losses, target):
        for run in record["runs"]:
            if run["val"] == list(losses):
                return run["val_steps"][-1] / summary["speedup"]["values"][0]
        return None
    """, "cell-alone"),
    (HONEST_REACH + "\n\ndef my_steps_to_reach(steps, losses, target):\n    r = honest(steps, losses, target)\n"
     "    losses[0] = target\n    return r\n", "read-only-inputs"),
    ("""
    def my_steps_to_reach(steps, losses, target):
        steps.clear()
        return 250.0
    """, "read-only-inputs"),
    ("""
    def my_steps_to_reach(steps, losses, target):
        return next((float(s) for s, v in zip(steps, losses) if v <= target), None)   # no interpolation
    """, None),
    (HONEST_REACH + "\n\ndef my_steps_to_reach(steps, losses, target):\n    r = honest(steps, losses, target)\n"
     "    return -1.0 if r is None else r\n", None),
], ids=["library-import", "library-module", "library-submodule", "notebook-record", "mutates-losses",
        "clears-steps", "no-interpolation", "minus-one-for-never"])
def test_my_steps_to_reach_shortcuts_fail(src, rule):
    fails(REACH, src, rule) if rule else wrong(REACH, src)


def test_my_steps_to_reach_renamed_copy_is_an_import(tmp_path_factory):
    renamed_copy(str(tmp_path_factory.mktemp("coursework")))
    fails(REACH, "import mylab\n\n" + solution(REACH), "import")


def test_strictly_below_fails_on_the_visible_tie():
    """'<' where the definition says 'at or below': the curve that touches the target and rises again (case 5)."""
    report = wrong(REACH, HONEST_REACH.replace("v <= target", "v < target").replace("def honest(", f"def {REACH}("))
    assert "case 5" in report.reason
    assert re.search(r"case 5 out 0 +\| exact: False", report.text()), report.text()


def test_my_steps_to_reach_lookup_table_fails_on_hidden_cases():
    src = (f"TABLE = {REACH_TABLE!r}\n\ndef my_steps_to_reach(steps, losses, target):\n"
           "    reached, step = TABLE.get((tuple(steps), tuple(losses), target), (0, 0.0))\n"
           "    return step if reached else None\n")
    only_hidden_wrong(wrong(REACH, src))


@pytest.mark.parametrize("fn, call", [
    (lm_study.steps_to_reach, "steps_to_reach(*args)"),
    (ch05._reach_reference, "(lambda r: r[1] if r[0] else None)(_reach_reference(*args))"),
    (lm_study.loss_at, "loss_at(list(reversed(args[1])), list(reversed(args[0])), args[2])"),
], ids=["lm_study.steps_to_reach", "checker-reference", "sibling-loss_at"])
def test_my_steps_to_reach_pasted_code_is_identity(fn, call):
    fails(REACH, pasted(fn, REACH, call), "identity")


def test_pasted_library_code_with_every_name_changed_is_still_identity():
    src = pasted(lm_study.steps_to_reach, REACH, "reach(*args)")
    for old, new in (("steps_to_reach", "reach"), ("prev_s", "a"), ("prev_v", "b"), ("losses", "ys"),
                     ("steps", "xs"), ("target", "goal")):
        src = re.sub(rf"\b{old}\b", new, src)
    src = re.sub(r'""".*?"""', '"""mine"""', src, flags=re.S)                 # its own docstring
    assert "steps_to_reach" not in src.replace(REACH, "")
    fails(REACH, src, "identity")


def test_an_answer_rounded_to_float32_is_outside_the_stated_tolerance():
    """The exercise is graded at rtol = atol = 1e-9; float32 keeps about 7 digits (off by ~1e-5 at step 500)."""
    fails(REACH, HONEST_REACH + "\n\ndef my_steps_to_reach(steps, losses, target):\n"
          "    r = honest(steps, losses, target)\n    return None if r is None else float(torch.tensor(r))\n")


def test_a_notebook_name_read_when_the_cell_loads_is_cell_alone():
    """The same NameError as above, at the cell's top level (run when the grader loads the cell)."""
    fails(REACH, """
    RUNS = record["runs"]
    def my_steps_to_reach(steps, losses, target):
        return RUNS[0]["val_steps"][-1]
    """, "cell-alone")
