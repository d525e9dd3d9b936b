"""Every family of shortcut, against every exercise of the book: each is built around the book's own solution (so
it would give the right answers if it ran), and each must fail with the rule it breaks named in the report.

The families are those readers got through the 0.3.0 in-kernel guard (issue 37): another copy of the library
(renamed, pasted, re-executed), work outside the graded call (threads, process pools, lazy tensor subclasses),
switching the guard off (ctypes), reaching the grader's state (frames, patched comparisons or references, mutated
inputs, notebook globals)."""

import pytest
from redteam import fails, renamed_copy, with_body

from labbook.grader import catalog

ALL = sorted(catalog.ENTRIES)
SINGLE = [n for n in ALL if catalog.ENTRIES[n].adapter != "distributed"]


STATIC = {  # family: (top-level lines, body, rule)
    "renamed-copy": ("import mylab.moe as lab", "    return r", "import"),
    "checkout-path": ("from labutils.moe import capacity", "    return r", "import"),
    "exec-getsource": ("", "    exec('r = r')\n    return r", "dynamic-code"),
    "code-replace": ("", "    fn = honest.__code__.replace(co_filename='x')\n    return r", "private"),
    "thread": ("import threading", "    return r", "import"),
    "thread-via-torch": ("", "    torch.threading.Thread(target=print).start()\n    return r", "module-escape"),
    "process-pool": ("", "    pool = torch.multiprocessing.Pool(2)\n    return r", "torch-door"),
    "subprocess": ("import subprocess", "    return r", "import"),
    "ctypes-profile-off": ("", "    torch.ctypes.pythonapi.PyEval_SetProfile(None, None)\n    return r",
                           "module-escape"),
    "frames-sys": ("", "    f = torch.sys._getframe(1)\n    return r", "module-escape"),
    "frames-generator": ("", "    g = (x for x in [1])\n    up = g.gi_frame\n    return r", "frames"),
    "frames-traceback": ("", "    try:\n        1 / 0\n    except ZeroDivisionError as e:\n"
                             "        t = e.__traceback__\n    return r", "private"),
    "gc-objects": ("import gc", "    return r", "import"),
    "getattr": ("", "    f = getattr(torch, 'ten' + 'sor')\n    return r", "reflection"),
    "patched-comparison": ("torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a: True", "    return r",
                           "patching"),
    "patched-reference": ("import labbook.checkers.ch01 as ref", "    return r", "import"),
    "permissive-eq": ("class Any:\n    def __eq__(self, other):\n        return True", "    return r", "dunder-def"),
    "torch-function": ("class Lazy(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, *a, **k):\n"
                       "        return True", "    return r", "dunder-def"),
    "raw-op": ("", "    f = torch.ops.aten.add\n    return r", "torch-door"),
    "private-refs": ("", "    f = torch._refs\n    return r", "private"),
    "deepspeed": ("from deepspeed.moe import sharded_moe", "    return r", "import"),
}


@pytest.fixture(scope="module", autouse=True)
def _copy_on_disk(tmp_path_factory):
    """A real renamed coursework copy exists on this machine while the family runs (it still may not be used)."""
    renamed_copy(str(tmp_path_factory.mktemp("coursework")))


@pytest.mark.parametrize("family", sorted(STATIC))
@pytest.mark.parametrize("name", ALL)
def test_every_static_family_is_refused_before_anything_runs(name, family):
    head, body, rule = STATIC[family]
    report = fails(name, with_body(name, head, body), rule)
    assert "refused" in report.reason and report.seed is None            # no case was drawn


LAZY_SUBCLASS = """
class Lazy(torch.Tensor):
    pass

def as_lazy(v):
    if isinstance(v, (tuple, list)):
        return type(v)(as_lazy(x) for x in v)
    if isinstance(v, dict):
        return {k: as_lazy(x) for k, x in v.items()}
    t = v if isinstance(v, torch.Tensor) else torch.tensor(v if v is not None else 0)
    return t.as_subclass(Lazy)
"""

MUTATES = """
def scribble(args):
    for v in args:
        if isinstance(v, torch.Tensor) and v.numel() and not v.requires_grad:
            v.view(-1)[0] = v.view(-1)[0] + 1
            return
        if isinstance(v, list) and v:
            v[0] = v[0] + 1
            return
"""

# exercises whose inputs hold a tensor or a list to scribble on (the others take only numbers)
MUTABLE = [n for n in SINGLE if n not in {"linear_params", "my_capacity", "moe_layer_params", "ds_capacity",
                                           "ds_dispatch_bytes", "time_pair", "einsum_overhead"}]


@pytest.mark.parametrize("name", [n for n in SINGLE if n != "time_pair"])
def test_a_lazy_tensor_subclass_is_not_an_answer(name):
    fails(name, with_body(name, LAZY_SUBCLASS, "    return as_lazy(r)"), "plain-answers")


@pytest.mark.parametrize("name", MUTABLE)
def test_mutating_the_inputs_is_refused(name):
    fails(name, with_body(name, MUTATES, "    scribble(args)\n    return r"), "read-only-inputs")


@pytest.mark.parametrize("name", SINGLE)
def test_an_answer_left_in_the_notebook_is_not_there(name):
    fails(name, with_body(name, "", "    return ANSWERS[0]"), "cell-alone")


@pytest.mark.dist
def test_the_distributed_exercise_refuses_subclasses_and_notebook_globals_on_every_rank():
    fails("gather_values", with_body("gather_values", LAZY_SUBCLASS, "    return as_lazy(r)"), "plain-answers")
    fails("gather_values", with_body("gather_values", "", "    return ANSWERS[0]"), "cell-alone")
