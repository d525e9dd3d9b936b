"""Red team for chapter 04's exercises (ds_capacity, top2_l_aux): the book's solutions and honest variants pass;
DeepSpeed, labutils, a renamed copy, the notebook's globals, pasted library code, the chapter's own
``l_aux_by_hand`` pasted (refused by identity), lookup tables of the visible cases and the known wrong answers (the
capacity rounded in float64, as the chapter's old solution did (issue 24), or exactly; top-2's ``l_aux`` with
top-1's factor, from both or the second choices) fail, each naming the rule it broke where one applies."""
import ast
import json
import re

import pytest
from redteam import ROOT, fails, only_hidden_wrong, passes, pasted, renamed_copy, solution

from labbook.checkers import ch02, ch04
from labutils.ds.gating import top1_routing, top2_routing

sharded_moe = ch02._sharded_moe()
CHAPTER = "04_transformer_deepspeed.ipynb"


@pytest.fixture(scope="module", autouse=True)
def _copy_on_disk(tmp_path_factory):
    """A real renamed coursework copy exists on this machine while these run (it still may not be used)."""
    renamed_copy(str(tmp_path_factory.mktemp("coursework")))



def chapter_function(name: str) -> tuple:
    """``(cell index, source)`` of the function ``name`` defined in a non-solution code cell of chapter 04."""
    for i, cell in enumerate(json.loads((ROOT / "notebooks" / CHAPTER).read_text())["cells"]):
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or "solution" in cell.get("metadata", {}).get("tags", []):
            continue
        for node in ast.parse(src).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return i, ast.get_source_segment(src, node)
    raise LookupError(name)


@pytest.mark.parametrize("name, line", [
    ("ds_capacity", "all 17 cases match (5 visible, 12 hidden)"),
    ("top2_l_aux", "all 11 cases match (3 visible, 8 hidden)"),
])
def test_the_books_solution_passes(name, line):
    assert line in passes(name, solution(name)).text()


HONEST = {
    "capacity-python-max": ("ds_capacity", """
    def ds_capacity(tokens, num_experts, k, capacity_factor, min_capacity=4):
        factor = torch.tensor(capacity_factor * k)                  # float32, as DeepSpeed's gate
        capacity = torch.ceil((tokens / num_experts) * factor).to(torch.int64)
        return max(int(capacity), int(min_capacity))
    """),
    "capacity-explicit-float32": ("ds_capacity", """
    def ds_capacity(tokens, num_experts, k, capacity_factor, min_capacity=4):
        per_expert = torch.tensor(tokens / num_experts, dtype=torch.float32)
        slots = torch.ceil(per_expert * torch.tensor(capacity_factor * k, dtype=torch.float32))
        return slots.long().clamp(min=min_capacity)
    """),
    "l_aux-sum-times-E": ("top2_l_aux", """
    def top2_l_aux(logits):                   # top-1's sum * E is top-2's mean * E * E: the same number
        probs = torch.softmax(logits.float(), dim=1)
        first = F.one_hot(probs.argmax(1), logits.shape[1]).float()
        return (probs.mean(0) * first.mean(0)).sum() * logits.shape[1]
    """),
    "l_aux-bincount": ("top2_l_aux", """
    def top2_l_aux(logits):
        S, E = logits.shape
        probs = logits.float().softmax(-1)
        share = torch.bincount(probs.argmax(-1), minlength=E).float() / S
        return E * E * (probs.mean(0) * share).mean()
    """),
}


@pytest.mark.parametrize("case", HONEST)
def test_honest_variants_pass(case):
    passes(*HONEST[case])


L_AUX = "    p = lg.float().softmax(-1)\n    E = lg.shape[1]\n"
CHEATS = {  # id: (exercise, source, rule or None for a wrong answer)
    "ds-_capacity": ("ds_capacity", "from deepspeed.moe.sharded_moe import _capacity\n"
                     "def ds_capacity(t, e, k, cf, m=4):\n"
                     "    return _capacity(torch.empty(t, e), torch.tensor(cf * k), torch.tensor(m))", "import"),
    "ds-TopKGate": ("ds_capacity", "from deepspeed.moe.sharded_moe import TopKGate\n"
                    "def ds_capacity(t, e, k, cf, m=4):\n"
                    "    return TopKGate(4, e, k=k, capacity_factor=cf, min_capacity=m)(torch.randn(t, 4))[1]",
                    "import"),
    "labutils-capacity": ("ds_capacity", "from labutils.moe.capacity import deepspeed_capacity\n"
                          "def ds_capacity(t, e, k, cf, m=4):\n    return deepspeed_capacity(t, e, cf, k, m)",
                          "import"),
    "labutils-ds-gating": ("ds_capacity", "import labutils.ds.gating as gating\n"
                           "def ds_capacity(t, e, k, cf, m=4):\n    return gating.ds_capacity(t, e, cf, k, m)",
                           "import"),
    "checker-reference": ("ds_capacity", "from labbook.checkers.ch04 import deepspeed_capacity\n"
                          "def ds_capacity(*a):\n    return deepspeed_capacity(*a)", "import"),
    "renamed-copy": ("ds_capacity", "from mylab.moe.capacity import deepspeed_capacity\n"
                     "def ds_capacity(t, e, k, cf, m=4):\n    return deepspeed_capacity(t, e, cf, k, m)", "import"),
    "notebook-global-gating": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                               "    return gating.ds_capacity(t, e, cf, k, m)", "cell-alone"),
    "torch-ops": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                  "    return max(m, int(torch.ops.aten.ceil(torch.tensor(cf * k) * (t / e))))", "torch-door"),
    "patched-ceil": ("ds_capacity", "torch.ceil = lambda v: v.floor() + 1\n"
                     "def ds_capacity(t, e, k, cf, m=4):\n"
                     "    return max(m, int(torch.ceil(torch.tensor(t / e * cf * k))))",
                     "patching"),
    "float64-the-old-solution": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                                 "    return torch.tensor(max(m, math.ceil(t / e * cf * k)))", None),
    "exact-fraction": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                       "    return max(m, -(-(t * round(cf * 100) * k) // (e * 100)))", None),
    "min-capacity-ignored": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                             "    return torch.ceil((t / e) * torch.tensor(cf * k)).long()", None),
    "k-forgotten": ("ds_capacity", "def ds_capacity(t, e, k, cf, m=4):\n"
                    "    return max(m, int(torch.ceil((t / e) * torch.tensor(cf))))", None),
    "ds-top2gating": ("top2_l_aux", "from deepspeed.moe.sharded_moe import top2gating\n"
                      "def top2_l_aux(lg):\n    return top2gating(lg, 1.0, 0, top2_2nd_expert_sampling=False)[0]",
                      "import"),
    "ds-top1gating": ("top2_l_aux", "from deepspeed.moe import sharded_moe\n"
                      "def top2_l_aux(lg):\n    return sharded_moe.top1gating(lg, 1.0, 0, use_rts=False)[0]",
                      "import"),
    "labutils-top2_routing": ("top2_l_aux", "from labutils.ds.gating import top2_routing\n"
                              "def top2_l_aux(lg):\n    return top2_routing(lg, 1.0, 0).l_aux", "import"),
    "renamed-copy-balance_loss": ("top2_l_aux", "from mylab.moe.modern.losses import balance_loss\n"
                                  "def top2_l_aux(lg):\n"
                                  "    return balance_loss(lg.softmax(1), lg.argmax(1, keepdim=True))", "import"),
    "notebook-global-l_aux_by_hand": ("top2_l_aux", "def top2_l_aux(lg):\n"
                                      "    return l_aux_by_hand(lg, torch.eye(lg.shape[1]))", "cell-alone"),
    "l_aux-torch-ops": ("top2_l_aux", "def top2_l_aux(lg):\n    p = torch.ops.aten.softmax(lg, 1)\n"
                        "    E = lg.shape[1]\n"
                        "    return E * E * (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).mean()",
                        "torch-door"),
    "patched-one_hot": ("top2_l_aux", "nn.functional.one_hot = lambda i, n: i\n"
                        "def top2_l_aux(lg):\n    return lg.sum() * 0 + 1.0", "patching"),
    "top-1's-factor": ("top2_l_aux", f"def top2_l_aux(lg):\n{L_AUX}"
                       "    return E * (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).mean()", None),
    "both-choices": ("top2_l_aux", f"def top2_l_aux(lg):\n{L_AUX}"
                     "    c = torch.zeros_like(p).scatter_(1, p.topk(2, -1).indices, 1.0)\n"
                     "    return E * E * (p.mean(0) * c.mean(0)).mean()", None),
    "second-choices": ("top2_l_aux", f"def top2_l_aux(lg):\n{L_AUX}"
                       "    c = F.one_hot(p.topk(2, -1).indices[:, 1], E).float()\n"
                       "    return E * E * (p.mean(0) * c.mean(0)).mean()", None),
    "divided-by-k": ("top2_l_aux", f"def top2_l_aux(lg):\n{L_AUX}"
                     "    return E * E * (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).mean() / 2", None),
}


@pytest.mark.parametrize("case", CHEATS)
def test_shortcuts_fail(case):
    name, src, rule = CHEATS[case]
    fails(name, src, rule)


# the capacity formulas (DeepSpeed's `_capacity`, labutils' `deepspeed_capacity`) are under identity's floor: see
# test_grader_ch02.py
@pytest.mark.parametrize("name, fn, call, rule", [
    ("top2_l_aux", top2_routing, "top2_routing(args[0], 1.0, 0).l_aux", "identity"),
    ("top2_l_aux", top1_routing, "top1_routing(args[0], 1.0, 0).l_aux", "identity"),
    ("top2_l_aux", sharded_moe.top2gating, "top2gating(args[0], 1.0, 0, top2_2nd_expert_sampling=False)[0]",
     "private"),
], ids=["top2_routing", "top1_routing", "ds-top2gating"])
def test_pasted_library_code_is_refused(name, fn, call, rule):
    fails(name, pasted(fn, name, call), rule)


def test_the_chapters_l_aux_by_hand_pasted_is_refused_by_identity():
    """Section 4's helper (a non-solution cell) pasted verbatim, and again renamed with its locals renamed, its
    docstring and comments gone: the same code, refused by identity, naming the chapter's cell."""
    cell, src = chapter_function("l_aux_by_hand")
    where = f"notebooks/{CHAPTER} cell {cell}: l_aux_by_hand"
    call = "\n\ndef top2_l_aux(logits):\n    return {}(logits, torch.eye(logits.shape[1]))\n"
    report = fails("top2_l_aux", src + call.format("l_aux_by_hand"), "identity", says=where)
    assert "`l_aux_by_hand` is the same code" in report.text()
    body = [line.split("#")[0].rstrip() for line in src.splitlines() if not line.lstrip().startswith('"""')]
    renamed = re.sub(r"\b(x|weight|counts|probs|n_tok|n_e|first|c)\b", lambda m: f"my_{m[1]}", "\n".join(body))
    renamed = renamed.replace("def l_aux_by_hand", "def helper")
    assert "my_probs" in renamed and '"""' not in renamed
    fails("top2_l_aux", renamed + call.format("helper"), "identity", says=where)


def test_the_old_float64_solution_fails_the_hidden_edges_alone():
    """Chapter 04's old solution with the visible answers memorised (so the issue's S=100, E=4, cf=1.2 case is
    right): the hidden float32 edge cases still fail it."""
    table = {c[:4]: ch04.deepspeed_capacity(*c) for c in ch04.CAPACITY_VISIBLE}
    assert table[(100, 4, 1, 1.2)] == 31
    src = (f"TABLE = {table!r}\n\ndef ds_capacity(t, e, k, cf, m=4):\n"
           "    if (t, e, k, cf) in TABLE:\n        return TABLE[(t, e, k, cf)]\n"
           "    return torch.tensor(max(m, math.ceil(t / e * cf * k)))\n")
    assert only_hidden_wrong(fails("ds_capacity", src)) <= 8


def test_a_lookup_table_of_the_visible_l_aux_fails_the_hidden_cases():
    table = {(tuple(lg.shape), lg[0, 0].item()): ch04.deepspeed_top2_l_aux(lg).item() for lg in ch04._l_aux_visible()}
    src = (f"TABLE = {table!r}\n\ndef top2_l_aux(logits):\n"
           "    return TABLE.get((tuple(logits.shape), logits[0, 0].item()), 1.0)\n")
    only_hidden_wrong(fails("top2_l_aux", src))
