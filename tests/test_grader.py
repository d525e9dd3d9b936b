"""The grader itself (labbook.grader): its static policy rule by rule, the sandbox's audit hook as a second line
(source that the policy would refuse, loaded directly, is still stopped at run time), its own failure modes (a
hang, a crash, a flood of output, a wrong type, bad arguments), where a solution's source comes from, and the
instructor's command grading a folder of notebooks into a CSV (nbgrader's ``submitted/`` layout included).
Chapter by chapter red teams: test_grader_chNN.py; every shortcut family against every exercise:
test_grader_families.py."""
import csv
import json
import subprocess
import sys
import textwrap

import pytest
from redteam import ROOT, fails, passes, solution

from labbook.grader import catalog, grade, policy, source
from labbook.grader.cli import grade_folder

# --- the static policy, rule by rule (no process started) --------------------------------------------------------

RULES = [
    ("import os\ndef f(x):\n    return x", "import"),
    ("from torch import *\ndef f(x):\n    return x", "import"),
    ("from .labutils import moe\ndef f(x):\n    return x", "import"),
    ("def f(x):\n    return eval('x')", "dynamic-code"),
    ("def f(x):\n    return __import__('os')", "dynamic-code"),
    ("def f(x):\n    return vars(x)", "reflection"),
    ("def f(x):\n    return open('/etc/passwd').read()", "reflection"),
    ("def f(x):\n    return x.__class__", "private"),
    ("def f(x):\n    return torch._C", "private"),
    ("def f(x):\n    g = (i for i in x)\n    return g.gi_frame.f_back", "frames"),
    ("def f(x):\n    return torch.os.getcwd()", "module-escape"),
    ("def f(x):\n    return torch.utils.checkpoint", "torch-door"),
    ("def f(x):\n    return torch.load('x.pt')", "torch-door"),
    ("torch.equal = lambda *a: True\ndef f(x):\n    return x", "patching"),
    ("def f(x):\n    F.gelu.extra = 1\n    return x", "patching"),
    ("class T:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return x", "dunder-def"),
    ("def g(x):\n    return x", "missing"),
    ("%time f(1)\ndef f(x):\n    return x", "syntax"),
]


@pytest.mark.parametrize("src, rule", RULES, ids=[f"{r}-{i}" for i, (_, r) in enumerate(RULES)])
def test_each_rule_refuses_with_the_line_and_the_rule_named(src, rule):
    _, found, _ = policy.check_source(src, "f", catalog.STANDARD)
    assert found and found[0].rule == rule, found
    assert f"line {found[0].line}: " in str(found[0]) and f"rule '{rule}'" in str(found[0])


def test_allowed_code_passes_and_top_level_expressions_are_noted_not_run():
    src = ("import math\nimport torch.nn.functional as F\nfrom torch import nn\nclass Box:\n    def __init__(self):\n"
           "        self.v = 1\nprint('demo')\ndef f(x):\n    m = torch.zeros(2)\n    m[torch.arange(2)], a = 1.0, 2\n"
           "    return F.gelu(x) + math.pi + x.sum() + m.sum() + a\n")
    tree, found, notes = policy.check_source(src, "f", catalog.STANDARD)
    assert found == [] and len(notes) == 1 and "line 7" in notes[0] and "not run" in notes[0]
    assert not any(getattr(s, "lineno", 0) == 7 for s in tree.body)


def test_an_exercise_names_its_answer_functions():
    _, found, _ = policy.check_source("def shard_batch(x, r, w, d):\n    return x.tensor_split(w, d)[r]",
                                      "shard_batch", catalog.SPLITS)
    assert [r.rule for r in found] == ["exercise"] and "uneven-split rule" in str(found[0])


# --- the sandbox's audit hook: the second line, with the policy bypassed ------------------------------------------

HOOK_SCRIPT = r"""
import ast, json, torch
from labbook.grader import catalog
from labbook.grader.process import Child
cases = json.loads(__import__("sys").stdin.read())
entry = catalog.entry("my_switch_loss")
out = {}
for label, body in cases.items():
    child = Child(entry, ast.parse("def my_switch_loss(logits):\n" + body))   # no policy: straight to the sandbox
    ready = child.wait_reply(60)
    try:
        reply = child.ask((torch.zeros(2, 2),), 20) if ready.get("kind") == "ready" else ready
        out[label] = reply.get("kind") + ": " + str(reply.get("message", ""))
    except EOFError:
        out[label] = child.died()
    child.stop()
print(json.dumps(out))
"""

ESCAPES = {
    "os.system": "    torch.os.system('true')\n    return 1.0",
    "os.open a file": "    torch.os.open('/etc/hostname', 0)\n    return 1.0",
    "read the book's source": f"    torch.os.open({str(ROOT / 'labutils' / '__init__.py')!r}, 0)\n    return 1.0",
    "start a thread": "    torch.threading.Thread(target=print).start()\n    return 1.0",
    "fork": "    torch.os.fork()\n    return 1.0",
    "ctypes": "    torch.ctypes.CDLL(None)\n    return 1.0",
    "profile off": "    torch.sys.setprofile(None)\n    return 1.0",
    "gc walk": "    torch.sys.modules['gc'].get_objects()\n    return 1.0",
    "import the library": "    torch.importlib.import_module('labutils')\n    return 1.0",
    "import deepspeed": "    torch.importlib.import_module('deepspeed')\n    return 1.0",
    "import a stdlib module": "    torch.importlib.import_module('mailbox')\n    return 1.0",
    "run new code": "    torch.builtins.exec('x = 1')\n    return 1.0",
    "build a code object": "    c = (lambda: 0).__code__.replace(co_name='y')\n    return 1.0",
    "builtins import": "    import subprocess\n    return 1.0",
    "crash": "    torch.os.abort()\n    return 1.0",
}


@pytest.fixture(scope="module")
def escapes():
    run = subprocess.run([sys.executable, "-c", HOOK_SCRIPT], input=json.dumps(ESCAPES), capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("label", sorted(set(ESCAPES) - {"crash"}))
def test_the_hook_refuses_what_the_policy_would_have(escapes, label):
    said = escapes[label]
    assert said.startswith("raised: ") and "grader policy" in said, said


def test_a_crash_is_named_with_its_signal(escapes):
    assert escapes["crash"] == "the process running your function died with signal SIGABRT"


# --- the grader's own failure modes, through the service (a fresh process) ----------------------------------------

def test_a_hang_ends_at_the_time_limit_and_names_it():
    report = fails("my_switch_loss", "def my_switch_loss(logits):\n    while True:\n        pass\n", "time-limit",
                   case_timeout_s=1.5)
    assert "case 1: not run" in report.text()


def test_a_flood_of_output_does_not_block_and_is_summarised():
    src = solution("my_switch_loss").replace("### BEGIN SOLUTION\n", "### BEGIN SOLUTION\n    print('x' * 200_000)\n")
    report = passes("my_switch_loss", src)
    assert "your code printed" in report.text() and "(first lines)" in report.text()


@pytest.mark.parametrize("ret, says", [("'1.0'", "not a tensor or number: a str"),
                                       ("[1.0, 2.0]", "not a tensor or number: a list"),
                                       ("{'loss': 1.0}", "not a tensor or number: a dict"),
                                       ("torch.ones(1)", "wrong shape: got (1,), expected ()"),
                                       ("object()", "rule 'plain-answers'")])
def test_a_wrong_type_is_named(ret, says):
    fails("my_switch_loss", f"def my_switch_loss(logits):\n    return {ret}\n", says=says)


def test_a_cell_that_raises_when_loaded_is_reported_with_its_line():
    report = fails("my_switch_loss", "x = 1 / 0\ndef my_switch_loss(logits):\n    return 1.0\n",
                   says="running your cell raised ZeroDivisionError at line 1")
    assert report.seed is None


def test_an_integer_exercise_wants_integers():
    fails("my_count_by_gate", "def my_count_by_gate(g, n):\n    f = g.reshape(-1)\n"
          "    return torch.argsort(torch.where(f >= 0, f, n), stable=True)[: int((f >= 0).sum())].float(), "
          "torch.bincount(f[f >= 0], minlength=n)\n", says="an integer answer expected")


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="not an exercise of the book; the exercises are"):
        grade("my_moe_fwd", source="def my_moe_fwd(): pass")
    with pytest.raises(TypeError, match="source: the text of your solution"):
        grade("my_switch_loss", source=lambda logits: 1.0)
    from labbook.grader.grading import grade as grade_here
    with pytest.raises(ValueError, match="case_timeout_s=-1"):
        grade_here("my_switch_loss", solution("my_switch_loss"), case_timeout_s=-1)
    with pytest.raises(ValueError, match="grade\\('my_switch_loss'\\) outside a notebook: pass source="):
        grade("my_switch_loss")


def test_grade_prints_the_report_and_raises_on_a_wrong_answer(capsys):
    assert grade("my_switch_loss", source=solution("my_switch_loss"), seed=3) is None      # printed, not returned
    assert "✅ my_switch_loss: all 11 cases match" in capsys.readouterr().out
    with pytest.raises(AssertionError, match=r"my_switch_loss: 1\d of 11 cases wrong"):
        grade("my_switch_loss", source="def my_switch_loss(logits):\n    return torch.tensor(1.0)\n")
    assert "hidden cases match" in capsys.readouterr().out


def test_the_same_seed_draws_the_same_hidden_cases():
    wrong = "def my_switch_loss(logits):\n    return torch.tensor(float(logits.shape[0] % 3 == 0))\n"
    first, again = (fails("my_switch_loss", wrong, seed=11).text() for _ in range(2))
    assert first == again


# --- where the source comes from, and the instructor's command ---------------------------------------------------

def _notebook(path, cells):
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


def test_the_last_cell_defining_the_function_is_the_submission(tmp_path):
    nb = tmp_path / "01_fastmoe_core.ipynb"
    _notebook(nb, ["def my_topk_gate(l, k):\n    return 1\n", "x = my_topk_gate(1, 2)\n", solution("my_topk_gate")])
    assert source.from_notebook(nb, "my_topk_gate") == solution("my_topk_gate")
    assert source.from_notebook(nb, "my_switch_loss") is None


def test_grading_a_folder_in_nbgraders_layout_writes_one_row_per_student_and_exercise(tmp_path):
    subs = tmp_path / "submitted"
    honest = [solution(n) for n in ("balance_entropy", "my_steps_to_reach")]
    _notebook(subs / "alice" / "ps5" / "05_moe_vs_dense.ipynb", honest)
    _notebook(subs / "bob" / "ps5" / "05_moe_vs_dense.ipynb",
              ["import labbook.lm_study as s\ndef my_steps_to_reach(st, lo, t):\n"
               "    return s.steps_to_reach(st, lo, t)",
               solution("balance_entropy")])
    _notebook(subs / "carol" / "ps5" / "05_moe_vs_dense.ipynb", [solution("balance_entropy")])
    rows = grade_folder(subs, tmp_path / "grades.csv")
    got = {(r["student"], r["exercise"]): (r["result"], r["reason"]) for r in rows}
    assert got[("alice", "balance_entropy")] == ("pass", "") and got[("alice", "my_steps_to_reach")] == ("pass", "")
    assert got[("bob", "my_steps_to_reach")][0] == "fail" and "rule 'import'" in got[("bob", "my_steps_to_reach")][1]
    assert got[("carol", "my_steps_to_reach")] == ("fail", "no cell defines `def my_steps_to_reach(`")
    with open(tmp_path / "grades.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6 and list(table[0]) == ["student", "notebook", "chapter", "exercise", "result", "reason"]


def test_the_command_line_grades_one_file_and_a_folder(tmp_path):
    sol = tmp_path / "s.py"
    sol.write_text(solution("linear_params"))
    one = subprocess.run([sys.executable, "-m", "labbook.grader", "one", "linear_params", str(sol)],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and "✅ linear_params" in one.stdout, one.stdout + one.stderr
    sol.write_text("def linear_params(a, b, bias=True):\n    return a * b\n")
    assert subprocess.run([sys.executable, "-m", "labbook.grader", "one", "linear_params", str(sol)],
                          capture_output=True, timeout=120).returncode == 1
    _notebook(tmp_path / "subs" / "03_transformer_fastmoe.ipynb", [solution("moe_layer_params")])
    run = subprocess.run([sys.executable, "-m", "labbook.grader", "grade", str(tmp_path / "subs"), "--out",
                          str(tmp_path / "g.csv")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "1 of 1 exercises pass; 1 students" in run.stdout, run.stdout + run.stderr
    bad = subprocess.run([sys.executable, "-m", "labbook.grader", "grade", str(tmp_path / "nothing")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_every_exercise_of_the_book_is_in_the_catalogue_and_has_cases():
    import importlib
    defined = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if "solution" in cell.get("metadata", {}).get("tags", []):
                name = textwrap.dedent("".join(cell["source"])).split("def ", 1)[1].split("(")[0]
                defined[name] = path.name[:2]
    assert defined == {n: e.chapter for n, e in catalog.ENTRIES.items()}
    for e in catalog.ENTRIES.values():
        assert e.function in importlib.import_module(f"labbook.checkers.ch{e.chapter}").CASES


def test_the_nbgrader_preprocessor_grades_out_of_the_kernel_and_marks_failures_as_errors():
    """After nbgrader's Execute, a student kernel that printed a tick in the checker cell does not decide: the
    preprocessor replaces the autograded cells' outputs with the grader's verdict on the solution text (an error
    output, nbgrader's "no credit", when it fails)."""
    import nbformat

    from labbook.grader.nbgrader import LabGrader

    def cells(solution_src):
        sol = nbformat.v4.new_code_cell(solution_src, metadata={"nbgrader": {"solution": True, "grade": False}})
        chk = nbformat.v4.new_code_cell('grade("linear_params")',
                                        metadata={"nbgrader": {"grade": True, "solution": False, "points": 1}})
        chk.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✅ faked by the student's kernel\n")]
        return nbformat.v4.new_notebook(cells=[sol, chk])

    good, _ = LabGrader().preprocess(cells(solution("linear_params")), {})
    assert [o.output_type for o in good.cells[1].outputs] == ["stream"]
    assert "✅ linear_params: all 11 cases match" in good.cells[1].outputs[0].text
    bad, _ = LabGrader().preprocess(cells("def linear_params(a, b, bias=True):\n    return a * b\n"), {})
    kinds = [o.output_type for o in bad.cells[1].outputs]
    assert kinds == ["stream", "error"] and "faked" not in bad.cells[1].outputs[0].text
    assert bad.cells[0].outputs == []                         # the solution cell is left as it is


def test_in_a_kernel_the_submission_is_the_cells_text_with_or_without_stored_history():
    """nbval runs cells without storing them in the history: the text then comes from IPython's own copy of the
    cell (the file name the function's code carries); a redefinition in a later cell is what is graded."""
    script = textwrap.dedent('''
        from IPython.core.interactiveshell import InteractiveShell
        from labbook.grader import source
        ip = InteractiveShell.instance()
        ip.run_cell("def my_topk_gate(l, k):\\n    return 1  # first\\n", store_history=False)
        ip.run_cell("x = 2", store_history=False)
        first = source.from_kernel("my_topk_gate")
        ip.run_cell("def my_topk_gate(l, k):\\n    return 2  # second\\n", store_history=True)
        print(repr(first), repr(source.from_kernel("my_topk_gate")))
        try:
            source.from_kernel("my_switch_loss")
        except LookupError as exc:
            print("LookupError", exc)
    ''')
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "'def my_topk_gate(l, k):\\n    return 1  # first\\n'" in out and "# second" in out.split(" ", 1)[1], out
    assert "LookupError no cell defining `def my_switch_loss(...)` has run in this kernel" in out
