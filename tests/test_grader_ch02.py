"""Red team for chapter 02's exercises (my_capacity, my_top1_l_aux, my_dispatch): the book's solutions and honest
variants pass; DeepSpeed, labutils, a renamed copy, the notebook's globals, pasted library code, lookup tables of
the visible cases and the chapter's known wrong answers (a capacity rounded in float64 or exactly, the slot order
reversed, ...) fail, each naming the rule it broke where one applies."""

import pytest
from redteam import fails, only_hidden_wrong, passes, pasted, renamed_copy, solution

from labbook.checkers import ch02
from labutils.ds.gating import Routing, top1_routing, topk_routing
from labutils.moe.capacity import deepspeed_capacity, exact_capacity
from labutils.moe.modern.losses import balance_loss

sharded_moe = ch02._sharded_moe()


@pytest.fixture(scope="module", autouse=True)
def _copy_on_disk(tmp_path_factory):
    """A real renamed coursework copy exists on this machine while these run (it still may not be used)."""
    renamed_copy(str(tmp_path_factory.mktemp("coursework")))



@pytest.mark.parametrize("name, line", [
    ("my_capacity", "all 17 cases match (5 visible, 12 hidden)"),
    ("my_top1_l_aux", "all 11 cases match (3 visible, 8 hidden)"),
    ("my_dispatch", "all 10 cases match (4 visible, 6 hidden)"),
])
def test_the_books_solution_passes(name, line):
    assert line in passes(name, solution(name)).text()


HONEST = {
    "capacity-explicit-float32": ("my_capacity", """
    def my_capacity(S, E, cf, k, min_capacity):
        per_expert = torch.tensor(S / E, dtype=torch.float32)
        return max(min_capacity, int(torch.ceil(per_expert * torch.tensor(cf * k, dtype=torch.float32))))
    """),
    "capacity-clamp": ("my_capacity", """
    def my_capacity(S, E, cf, k, min_capacity):
        slots = torch.ceil(torch.tensor(cf * k) * (S / E))          # float32, as DeepSpeed
        return slots.long().clamp(min=min_capacity)
    """),
    "l_aux-mean-times-E-squared": ("my_top1_l_aux", """
    def my_top1_l_aux(logits):
        probs = torch.softmax(logits.float(), dim=1)
        first = F.one_hot(probs.argmax(1), logits.shape[1]).float()
        return (probs.mean(0) * first.mean(0)).mean() * logits.shape[1] ** 2
    """),
    "l_aux-bincount": ("my_top1_l_aux", """
    def my_top1_l_aux(logits):
        S, E = logits.shape
        probs = logits.float().softmax(-1)
        share = torch.bincount(probs.argmax(-1), minlength=E).float() / S
        return E * torch.dot(probs.mean(0), share)
    """),
    "dispatch-loops": ("my_dispatch", """
    def my_dispatch(x, indices, locations, E, C):
        buf = torch.zeros(E, C, x.shape[1], dtype=x.dtype)
        for j in range(indices.shape[0]):
            for s in range(indices.shape[1]):
                if indices[j, s] >= 0:
                    buf[indices[j, s], locations[j, s]] = x[s]
        return buf
    """),
    "dispatch-one-hot-einsum": ("my_dispatch", """
    def my_dispatch(x, indices, locations, E, C):
        kept = (indices >= 0).float()                                          # (k, S)
        expert = F.one_hot(indices.clamp(min=0), E).float() * kept[..., None]  # (k, S, E)
        slot = F.one_hot(locations, C).float()                                 # (k, S, C)
        return torch.einsum("kse,ksc,sd->ecd", expert, slot, x)
    """),
}


@pytest.mark.parametrize("case", HONEST)
def test_honest_variants_pass(case):
    passes(*HONEST[case])


CHEATS = {  # id: (exercise, source, rule or None for a wrong answer)
    "ds-_capacity": ("my_capacity", "from deepspeed.moe.sharded_moe import _capacity\n"
                     "def my_capacity(S, E, cf, k, m):\n"
                     "    return _capacity(torch.empty(S, E), torch.tensor(cf * k), torch.tensor(m))", "import"),
    "ds-TopKGate": ("my_capacity", "from deepspeed.moe.sharded_moe import TopKGate\n"
                    "def my_capacity(S, E, cf, k, m):\n"
                    "    return TopKGate(4, E, k=k, capacity_factor=cf, min_capacity=m)(torch.randn(S, 4))[1]",
                    "import"),
    "labutils-capacity": ("my_capacity", "from labutils.moe.capacity import deepspeed_capacity\n"
                          "def my_capacity(*a):\n    return deepspeed_capacity(*a)", "import"),
    "labutils-ds-gating": ("my_capacity", "from labutils.ds.gating import ds_capacity\n"
                           "def my_capacity(*a):\n    return ds_capacity(*a)", "import"),
    "checker-reference": ("my_capacity", "from labbook.checkers.ch02 import deepspeed_capacity\n"
                          "def my_capacity(*a):\n    return deepspeed_capacity(*a)", "import"),
    "renamed-copy": ("my_capacity", "from mylab.moe.capacity import deepspeed_capacity\n"
                     "def my_capacity(*a):\n    return deepspeed_capacity(*a)", "import"),
    "notebook-global": ("my_capacity", "def my_capacity(*a):\n    return ds_capacity(*a)", "cell-alone"),
    "torch-ops": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n"
                  "    return max(m, int(torch.ops.aten.ceil(torch.tensor(cf * k) * (S / E))))", "torch-door"),
    "patched-ceil": ("my_capacity", "torch.ceil = lambda t: t.floor() + 1\n"
                     "def my_capacity(S, E, cf, k, m):\n"
                     "    return max(m, int(torch.ceil(torch.tensor(S / E * cf * k))))",
                     "patching"),
    "float64": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n    return max(m, math.ceil(S / E * cf * k))", None),
    "float64-factor-first": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n"
                             "    return torch.tensor(max(m, math.ceil(cf * k * S / E)))", None),
    "exact-fraction": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n"
                       "    return max(m, -(-(S * round(cf * 100) * k) // (E * 100)))", None),
    "min-capacity-ignored": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n"
                             "    return torch.ceil((S / E) * torch.tensor(cf * k)).long()", None),
    "float-answer": ("my_capacity", "def my_capacity(S, E, cf, k, m):\n"
                     "    return torch.ceil((S / E) * torch.tensor(cf * k)).clamp(min=m)", None),
    "ds-top1gating": ("my_top1_l_aux", "from deepspeed.moe.sharded_moe import top1gating\n"
                      "def my_top1_l_aux(lg):\n    return top1gating(lg, 1.0, 0, use_rts=False)[0]", "import"),
    "ds-top2gating": ("my_top1_l_aux", "from deepspeed.moe import sharded_moe\n"
                      "def my_top1_l_aux(lg):\n    return sharded_moe.top2gating(lg, 1.0, 0)[0]", "import"),
    "labutils-top1_routing": ("my_top1_l_aux", "from labutils.ds.gating import top1_routing\n"
                              "def my_top1_l_aux(lg):\n    return top1_routing(lg, 1.0, 0).l_aux", "import"),
    "renamed-copy-balance_loss": ("my_top1_l_aux", "from mylab.moe.modern.losses import balance_loss\n"
                                  "def my_top1_l_aux(lg):\n"
                                  "    return balance_loss(lg.softmax(1), lg.argmax(1, keepdim=True))", "import"),
    "l_aux-torch-ops": ("my_top1_l_aux", "def my_top1_l_aux(lg):\n"
                        "    p = torch.ops.aten.softmax(lg, 1)\n    E = lg.shape[1]\n"
                        "    return (p.mean(0) * F.one_hot(p.argmax(1), E).float().mean(0)).sum() * E",
                        "torch-door"),
    "patched-softmax": ("my_top1_l_aux", "F.softmax = lambda t, dim: t\n"
                        "def my_top1_l_aux(lg):\n    return lg.sum() * 0 + 1.0", "patching"),
    "l_aux-missing-E": ("my_top1_l_aux", "def my_top1_l_aux(lg):\n    p = lg.float().softmax(1)\n"
                        "    return (p.mean(0) * F.one_hot(p.argmax(1), lg.shape[1]).float().mean(0)).sum()", None),
    "l_aux-both-choices": ("my_top1_l_aux", "def my_top1_l_aux(lg):\n    p = lg.float().softmax(1)\n"
                           "    c = torch.zeros_like(p).scatter_(1, p.topk(2, 1).indices, 1.0)\n"
                           "    return (p.mean(0) * c.mean(0)).sum() * lg.shape[1]", None),
    "l_aux-second-choices": ("my_top1_l_aux", "def my_top1_l_aux(lg):\n    p = lg.float().softmax(1)\n"
                             "    c = F.one_hot(p.topk(2, 1).indices[:, 1], lg.shape[1]).float()\n"
                             "    return (p.mean(0) * c.mean(0)).sum() * lg.shape[1]", None),
    "ds-MoE-layer": ("my_dispatch", "from deepspeed.moe.layer import MoE\n"
                     "def my_dispatch(x, indices, locations, E, C):\n"
                     "    return MoE(x.shape[1], torch.nn.Linear(x.shape[1], x.shape[1]), num_experts=E)(x)[0]",
                     "import"),
    "ds-_sparse_encode": ("my_dispatch", "from deepspeed.moe.sharded_moe import _sparse_encode\n"
                          "def my_dispatch(x, indices, locations, E, C):\n"
                          "    return _sparse_encode(x, (indices, locations), E, C)", "import"),
    "labutils-Routing": ("my_dispatch", "from labutils.ds.gating import Routing\n"
                         "def my_dispatch(x, i, l, E, C):\n"
                         "    r = Routing(i, l, torch.ones(i.shape), C, torch.zeros(E), torch.tensor(0.0), E)\n"
                         "    return torch.einsum('sec,sd->ecd', r.dispatch_mask().float(), x)", "import"),
    "renamed-copy-Routing": ("my_dispatch", "from mylab.ds.gating import Routing\n"
                             "def my_dispatch(x, i, l, E, C):\n    return Routing", "import"),
    "notebook-global-received": ("my_dispatch", "def my_dispatch(x, i, l, E, C):\n    return received[0][0]",
                                 "cell-alone"),
    "dispatch-torch-ops": ("my_dispatch", "def my_dispatch(x, i, l, E, C):\n"
                           "    return torch.ops.aten.zeros([E, C, x.shape[1]])", "torch-door"),
    "patched-zeros": ("my_dispatch", "torch.zeros = lambda *a, **k: None\n"
                      "def my_dispatch(x, i, l, E, C):\n    return x", "patching"),
}
DISPATCH = solution("my_dispatch").replace("    ### BEGIN SOLUTION\n", "").replace("    ### END SOLUTION\n", "")
WRONG_DISPATCH = {
    "slots-reversed": DISPATCH.replace("locations[kept]]", "C - 1 - locations[kept]]"),
    "drops-not-masked": DISPATCH.replace("kept = indices >= 0", "kept = indices >= -1"),
    "a-Parameter": DISPATCH.replace("return buf", "return torch.nn.Parameter(buf, requires_grad=False)"),
    "indices-changed-in-place": DISPATCH.replace("return buf", "indices.clamp_(min=0)\n    return buf"),
}
RULES = {"slots-reversed": None, "drops-not-masked": None, "a-Parameter": "plain-answers",
         "indices-changed-in-place": "read-only-inputs"}


def test_an_honest_capacity_written_like_the_library_passes():
    """Written from the chapter's formula (the float32 factor, ceil, at least min_capacity), in the exercise's own
    argument order, this is by chance the bytecode of labutils.moe.capacity.deepspeed_capacity (29 instructions):
    an honest solution the grader must not refuse as pasted library code."""
    passes("my_capacity", """
    def my_capacity(S, E, cf, k, min_capacity):
        factor = torch.tensor(cf * k)                               # float32, as DeepSpeed's gate
        capacity = torch.ceil((S / E) * factor).to(torch.int64)
        return max(int(capacity), int(min_capacity))
    """)


@pytest.mark.parametrize("case", CHEATS)
def test_shortcuts_fail(case):
    name, src, rule = CHEATS[case]
    fails(name, src, rule)


@pytest.mark.parametrize("case", WRONG_DISPATCH)
def test_wrong_dispatch_buffers_fail(case):
    assert WRONG_DISPATCH[case] != DISPATCH
    fails("my_dispatch", WRONG_DISPATCH[case], RULES[case], n_hidden=2)


# DeepSpeed's `_capacity` (33 instructions) and labutils' `deepspeed_capacity` (29) are under identity's floor
# (labbook.grader.identity.MIN_INSTRUCTIONS): three lines of the formula are what an honest student writes too
# (test_an_honest_capacity_written_like_the_library_passes), so pasting them is not told apart from writing them.
@pytest.mark.parametrize("name, fn, call, rule", [
    ("my_top1_l_aux", top1_routing, "top1_routing(args[0], 1.0, 0).l_aux", "identity"),
    ("my_top1_l_aux", topk_routing, "topk_routing(args[0], 1, 1.0, 0).l_aux", "identity"),
    ("my_top1_l_aux", balance_loss, "balance_loss(args[0].softmax(1), args[0].argmax(1, keepdim=True))", "identity"),
    ("my_top1_l_aux", sharded_moe.top1gating, "top1gating(args[0], 1.0, 0, use_rts=False)[0]", "private"),
    ("my_dispatch", sharded_moe._sparse_encode, "_sparse_encode(args[0], None, args[3], args[4])", "identity"),
    ("my_dispatch", Routing.combine_weights, "combine_weights(None)", "identity"),
], ids=["top1_routing", "topk_routing", "balance_loss",
        "ds-top1gating", "ds-_sparse_encode", "Routing.combine_weights"])
def test_pasted_library_code_is_refused(name, fn, call, rule):
    fails(name, pasted(fn, name, call), rule)


def test_pasted_exact_capacity_is_too_short_for_identity_but_wrong():
    """exact_capacity is under identity's size floor; pasted with its import, the import is refused, and
    rewritten with integers its answers are wrong on the visible case S=100, E=4, cf=1.2 (31, not 30)."""
    fails("my_capacity", "from fractions import Fraction\n" + pasted(exact_capacity, "my_capacity",
                                                                     "exact_capacity(*args)"), "import")
    report = fails("my_capacity", CHEATS["exact-fraction"][1])
    assert any(line.startswith("case 1 ") and "exact: False" in line for line in report.lines), report.text()


VISIBLE_CAPACITY = {c[:4]: deepspeed_capacity(*c[:4], c[4]) for c in ch02.CAPACITY_VISIBLE}


@pytest.mark.parametrize("elsewhere", ["max(m, math.ceil(S / E * cf * k))",
                                       "max(m, -(-(S * round(cf * 100) * k) // (E * 100)))"],
                         ids=["float64", "exact-fraction"])
def test_a_lookup_table_then_float64_or_exact_fails_the_hidden_float32_edges(elsewhere):
    """The visible answers memorised, float64 or exact arithmetic elsewhere: every visible case matches, and the
    hidden float32 edge cases (one in three for each kind) do not."""
    src = (f"TABLE = {VISIBLE_CAPACITY!r}\n\ndef my_capacity(S, E, cf, k, m):\n"
           f"    return max(m, TABLE[(S, E, cf, k)]) if (S, E, cf, k) in TABLE else {elsewhere}\n")
    assert only_hidden_wrong(fails("my_capacity", src)) <= 8


def test_a_lookup_table_of_the_visible_l_aux_fails_the_hidden_cases():
    table = {(tuple(lg.shape), lg[0, 0].item()): ch02.deepspeed_top1_l_aux(lg).item() for lg in ch02._l_aux_visible()}
    src = (f"TABLE = {table!r}\n\ndef my_top1_l_aux(logits):\n"
           "    return TABLE.get((tuple(logits.shape), logits[0, 0].item()), 1.0)\n")
    only_hidden_wrong(fails("my_top1_l_aux", src))


def test_a_lookup_table_of_the_visible_buffers_fails_the_hidden_cases():
    table = {}
    for settings in ch02.DISPATCH_VISIBLE:
        case, layer = ch02.real_dispatch(*settings)
        table[case[0][0, 0].item()] = ch02.experts_input(layer, case[0]).tolist()
    src = (f"TABLE = {table!r}\n\ndef my_dispatch(x, indices, locations, E, C):\n"
           "    return torch.tensor(TABLE.get(x[0, 0].item(), torch.zeros(E, C, x.shape[1]).tolist()))\n")
    only_hidden_wrong(fails("my_dispatch", src, n_hidden=2))
