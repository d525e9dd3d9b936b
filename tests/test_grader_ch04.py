"""Red team for chapter 04's exercises (ds_capacity, top2_l_aux: the balancing loss of one optimiser step run as
micro-batches): the book's solutions and honest variants pass; DeepSpeed, labutils, a renamed copy, the notebook's
globals, pasted library code, the chapter's own ``l_aux_by_hand`` pasted (refused by identity), lookup tables of the
visible cases and the known wrong answers fail, each naming the rule it broke where one applies. The wrong answers:
the capacity rounded in float64, as the chapter's old solution did (issue 24), or exactly; the step's ``l_aux`` over
all its tokens at once, one sequence per gate call, the micro-batches cut along the positions, the calls added up
instead of averaged, the two means averaged over the calls before their product, and section 4's formula with
top-1's factor, from both or the second choices, or divided by k."""
import ast
import json
import re

import pytest
import torch
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
    ("top2_l_aux", "all 14 cases match (4 visible, 10 hidden)"),
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
    "step-loop-sum-times-E": ("top2_l_aux", """
    def top2_l_aux(x, router_weight, micro_batches):
        total = 0.0
        for xb in torch.split(x, x.shape[0] // micro_batches):     # micro-batches of consecutive samples
            logits = F.linear(xb.reshape(-1, xb.shape[-1]), router_weight)
            probs = torch.softmax(logits, dim=1)
            first = F.one_hot(probs.argmax(1), logits.shape[1]).float()
            total = total + (probs.mean(0) * first.mean(0)).sum() * logits.shape[1]   # top-1's form: the same number
        return total / micro_batches
    """),
    "step-flat-tokens-bincount-float64": ("top2_l_aux", """
    def top2_l_aux(x, router_weight, micro_batches):
        tokens = x.reshape(-1, x.shape[-1]).double()               # sample-major: a micro-batch is a run of tokens
        values = []
        for chunk in tokens.chunk(micro_batches):
            probs = (chunk @ router_weight.double().T).softmax(-1)
            S, E = probs.shape
            share = torch.bincount(probs.argmax(-1), minlength=E).double() / S
            values.append(E * E * (probs.mean(0) * share).mean())
        return sum(values) / len(values)
    """),
}


@pytest.mark.parametrize("case", HONEST)
def test_honest_variants_pass(case):
    passes(*HONEST[case])


def step(per_call: str, combine: str = "torch.stack(calls).mean()", split: str = "x.chunk(g)") -> str:
    """A step's l_aux from ``per_call`` (an expression of ``p`` (tokens, E) and ``E``) over the micro-batches."""
    return ("def top2_l_aux(x, w, g):\n    calls = []\n"
            f"    for xb in {split}:\n"
            "        p = (xb.reshape(-1, xb.shape[-1]) @ w.t()).softmax(-1)\n        E = p.shape[1]\n"
            f"        calls.append({per_call})\n    return {combine}\n")


RIGHT = "E * E * (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).mean()"
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
    "ds-MoE": ("top2_l_aux", "from deepspeed.moe.layer import MoE\n"
               "def top2_l_aux(x, w, g):\n"
               "    layer = MoE(x.shape[-1], nn.Linear(x.shape[-1], x.shape[-1]), w.shape[0], k=2)\n"
               "    return torch.stack([layer(xb)[1] for xb in x.chunk(g)]).mean()", "import"),
    "ds-top2gating": ("top2_l_aux", "from deepspeed.moe.sharded_moe import top2gating\n"
                      "def top2_l_aux(x, w, g):\n    return torch.stack([top2gating(xb.reshape(-1, xb.shape[-1]) "
                      "@ w.t(), 1.0, 0, top2_2nd_expert_sampling=False)[0] for xb in x.chunk(g)]).mean()", "import"),
    "labutils-top2_routing": ("top2_l_aux", "from labutils.ds.gating import top2_routing\n"
                              "def top2_l_aux(x, w, g):\n    return torch.stack([top2_routing(xb.reshape(-1, "
                              "xb.shape[-1]) @ w.t(), 1.0, 0).l_aux for xb in x.chunk(g)]).mean()", "import"),
    "renamed-copy-balance_loss": ("top2_l_aux", "from mylab.moe.modern.losses import balance_loss\n"
                                  + step("balance_loss(p, p.argmax(1, keepdim=True))"), "import"),
    "notebook-global-l_aux_by_hand": ("top2_l_aux", step("l_aux_by_hand(p.log())"), "cell-alone"),
    "l_aux-torch-ops": ("top2_l_aux", step(RIGHT).replace(".softmax(-1)", "").replace(
        "        E = ", "        p = torch.ops.aten.softmax(p, 1)\n        E = "), "torch-door"),
    "patched-one_hot": ("top2_l_aux", "nn.functional.one_hot = lambda i, n: i\n" + step(RIGHT), "patching"),
    "whole-step-at-once": ("top2_l_aux", step(RIGHT, split="[x]"), None),
    "one-sequence-per-call": ("top2_l_aux", step(RIGHT, split="x.chunk(x.shape[0])"), None),
    "micro-batches-along-positions": ("top2_l_aux", step(RIGHT, split="x.chunk(g, dim=1)"), None),
    "calls-added-not-averaged": ("top2_l_aux", step(RIGHT, combine="torch.stack(calls).sum()"), None),
    "means-averaged-before-the-product": ("top2_l_aux", """
    def top2_l_aux(x, w, g):
        ms, cs = [], []
        for xb in x.chunk(g):
            p = (xb.reshape(-1, xb.shape[-1]) @ w.t()).softmax(-1)
            ms.append(p.mean(0))
            cs.append(F.one_hot(p.argmax(1), p.shape[1]).float().mean(0))
        E = w.shape[0]
        return E * E * (torch.stack(ms).mean(0) * torch.stack(cs).mean(0)).mean()
    """, None),
    "top-1's-factor": ("top2_l_aux", step("E * (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).mean()"),
                       None),
    "both-choices": ("top2_l_aux", step("E * E * (p.mean(0) * torch.zeros_like(p).scatter_(1, p.topk(2, -1).indices, "
                                        "1.0).mean(0)).mean()"), None),
    "second-choices": ("top2_l_aux", step("E * E * (p.mean(0) * F.one_hot(p.topk(2, -1).indices[:, 1], E).float()"
                                          ".mean(0)).mean()"), None),
    "divided-by-k": ("top2_l_aux", step(RIGHT + " / 2"), None),
}


@pytest.mark.parametrize("case", CHEATS)
def test_shortcuts_fail(case):
    name, src, rule = CHEATS[case]
    fails(name, src, rule)


# the capacity formulas (DeepSpeed's `_capacity`, labutils' `deepspeed_capacity`) are under identity's floor: see
# test_grader_ch02.py
EACH_CALL = "torch.stack([{} for xb in args[0].chunk(args[2])]).mean()"
LOGITS = "xb.reshape(-1, xb.shape[-1]) @ args[1].t()"


@pytest.mark.parametrize("name, fn, call, rule", [
    ("top2_l_aux", top2_routing, EACH_CALL.format(f"top2_routing({LOGITS}, 1.0, 0).l_aux"), "identity"),
    ("top2_l_aux", top1_routing, EACH_CALL.format(f"top1_routing({LOGITS}, 1.0, 0).l_aux"), "identity"),
    ("top2_l_aux", sharded_moe.top2gating,
     EACH_CALL.format(f"top2gating({LOGITS}, 1.0, 0, top2_2nd_expert_sampling=False)[0]"), "private"),
], ids=["top2_routing", "top1_routing", "ds-top2gating"])
def test_pasted_library_code_is_refused(name, fn, call, rule):
    fails(name, pasted(fn, name, call), rule)


def test_the_chapters_l_aux_by_hand_pasted_is_refused_by_identity():
    """Section 4's helper (a non-solution cell) pasted verbatim, and again renamed with its locals renamed, its
    docstring and comments gone: the same code, refused by identity, naming the chapter's cell."""
    cell, src = chapter_function("l_aux_by_hand")
    where = f"notebooks/{CHAPTER} cell {cell}: l_aux_by_hand"
    call = ("\n\ndef top2_l_aux(x, w, g):\n"
            "    return torch.stack([{}(xb.reshape(-1, xb.shape[-1]) @ w.t()) for xb in x.chunk(g)]).mean()\n")
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


def _lab_step_l_aux(x, w, g) -> float:
    """The step's l_aux from the lab's re-derivation of DeepSpeed's gate (bit-exact with it, chapter 02), in this
    process: the checker's own reference starts DeepSpeed's process group, which later tests must not find."""
    return torch.stack([top2_routing(xb.reshape(-1, xb.shape[-1]) @ w.t(), 1.0, 0).l_aux for xb in x.chunk(g)]).mean()


def test_a_lookup_table_of_the_visible_l_aux_fails_the_hidden_cases():
    table = {(tuple(x.shape), x[0, 0, 0].item(), g): _lab_step_l_aux(x, w, g).item()
             for x, w, g in ch04._step_visible()}
    src = (f"TABLE = {table!r}\n\ndef top2_l_aux(x, w, g):\n"
           "    return TABLE.get((tuple(x.shape), x[0, 0, 0].item(), g), 1.0)\n")
    only_hidden_wrong(fails("top2_l_aux", src))


def test_the_hidden_cases_tell_the_wrong_steps_apart():
    """On every hidden case but the fifth ones, the whole step at once and one sequence per call are both wrong: the
    micro-batches are a divisor of the batch other than 1 and the batch."""
    gen = torch.Generator().manual_seed(0)
    for i in range(20):
        x, w, g = ch04.step_case(gen, i)
        assert x.shape[0] % g == 0 and x.shape[-1] <= 16
        assert (1 < g < x.shape[0]) == (i % 5 != 4)


def test_the_step_inputs_make_every_logit_exact():
    """The logits of a case are the same however they are summed (so no first choice depends on the order)."""
    x, w = ch04.step_inputs(torch.Generator().manual_seed(1), 12, 10, 16, 16, lean=3.0)
    exact = torch.einsum("btd,ed->bte", x.double(), w.double())
    assert torch.equal((x @ w.t()).double(), exact) and torch.equal(torch.nn.functional.linear(x, w).double(), exact)
    assert x.abs().max() <= 4 and w.abs().max() <= 2


ENGINE = """
import json, torch
from labutils.ds import import_deepspeed, init_deepspeed, quiet
from labbook.checkers import ch04
deepspeed = import_deepspeed()
init_deepspeed()
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
x, w = ch04.step_inputs(torch.Generator().manual_seed(3), 8, 5, 16, 4)
g = 4
with quiet():
    moe = ch04._moe_layer(16, 4)
net = torch.nn.ModuleDict({"moe": moe})
groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "all"})
with quiet():
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(groups, lr=0.0), config={
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // g, "gradient_accumulation_steps": g,
        "steps_per_print": 10 ** 9})
gate = moe.deepspeed_moe.gate
with torch.no_grad():
    gate.wg.weight.copy_(w)
for xb in x.chunk(g):                                    # the step: g micro-batches, the loss = l_aux alone
    engine.backward(moe(xb)[1])
got = gate.wg.weight.grad.clone()
gate.wg.weight.grad = None
reference = ch04.deepspeed_step_l_aux(x, w, g)           # (under no_grad) ...
with torch.enable_grad():                                # ... and its gradient, the same calls with autograd
    want = torch.autograd.grad(torch.stack([moe(xb)[1] for xb in x.chunk(g)]).mean(), gate.wg.weight)[0]
print(json.dumps({"diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                  "as_sum": (got - g * want).abs().max().item(), "reference": reference.item()}))
"""


def test_the_reference_is_what_an_engine_with_gradient_accumulation_follows():
    """The checker's combination (each micro-batch's l_aux / g, added up) is what DeepSpeed's engine does: with
    ``gradient_accumulation_steps = g`` and the loss l_aux alone, the router's accumulated gradient is the gradient of
    the micro-batches' mean l_aux, not of their sum. In a subprocess: the engine needs a process group."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-c", ENGINE], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["diff"] <= 1e-6 * out["scale"] + 1e-9 < out["as_sum"], out
    assert 1.0 < out["reference"] < 4.0, out
