"""Red team for chapter 01's exercises (my_moe_forward, my_switch_loss, my_count_by_gate, my_topk_gate,
my_drop_over_capacity) on the grader: per exercise the book's solution and honest variants pass; the library
(labutils.moe), the renamed coursework copy, pasted library or checker code, a lookup table of the visible cases,
exec of the solution's source, the library reached through ``torch.sys`` and the chapter's known wrong answers
(Switch loss without E, an unstable sort, token-major drops, softmax over all E, float counts) fail, each naming the
rule it broke where one applies."""
import re

import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook.checkers import ch01
from labutils.moe.capacity import drop_over_capacity, position_in_expert
from labutils.moe.functions import count_by_gate
from labutils.moe.modern.losses import balance_loss
from labutils.moe.reference import reference_moe

MOE, SWITCH, COUNT, TOPK, DROP = ("my_moe_forward", "my_switch_loss", "my_count_by_gate", "my_topk_gate",
                                  "my_drop_over_capacity")
NAMES = [MOE, SWITCH, COUNT, TOPK, DROP]
VISIBLE = {MOE: 3, SWITCH: 3, COUNT: 4, TOPK: 3, DROP: 4}        # the chapter's printed cases; 8 hidden each


def only_hidden_wrong(report):
    """Every visible case matched; the cases that did not are hidden ones (the shortcut fits the printed cases)."""
    wrong = re.search(r"\(([^)]*)\); hidden seed", report.reason).group(1).replace(" ...", "").split(", ")
    assert all(label.startswith("hidden") for label in wrong), report.text()


@pytest.mark.parametrize("name", NAMES)
def test_the_books_solution_passes(name):
    v = VISIBLE[name]
    assert f"all {v + 8} cases match ({v} visible, 8 hidden)" in passes(name, solution(name)).text()


HONEST = {
    (MOE, "every-expert-dense-einsum"): """
    def my_moe_forward(x, w_gate, b_gate, W1, b1, W2, b2, k):
        logits = x @ w_gate.T + b_gate                                         # (T, E)
        val, idx = logits.topk(k, dim=-1)
        gates = torch.zeros_like(logits).scatter(1, idx, torch.softmax(val, -1))   # zero off the top k
        hid = F.gelu(torch.einsum("td,ehd->teh", x, W1) + b1)                  # every expert on every token
        return torch.einsum("te,ted->td", gates, torch.einsum("teh,edh->ted", hid, W2) + b2)
    """,
    (MOE, "token-loop-stable-sort"): """
    def my_moe_forward(x, w_gate, b_gate, W1, b1, W2, b2, k):
        logits, rows = x @ w_gate.T + b_gate, []
        for t in range(x.shape[0]):
            best = torch.sort(logits[t], descending=True, stable=True).indices[:k]
            g = torch.exp(logits[t, best] - logits[t, best].max())
            y = torch.zeros(x.shape[1])
            for j, e in enumerate(best.tolist()):
                y = y + g[j] / g.sum() * (W2[e] @ torch.nn.functional.gelu(W1[e] @ x[t] + b1[e]) + b2[e])
            rows.append(y)
        return torch.stack(rows)
    """,
    (SWITCH, "expert-loop"): """
    def my_switch_loss(logits):
        T, E = logits.shape
        probs, top = torch.softmax(logits, dim=-1), logits.argmax(dim=-1)
        total = 0.0
        for e in range(E):
            total = total + (top == e).sum() / T * probs[:, e].mean()
        return E * total
    """,
    (SWITCH, "one-hot-float64"): """
    def my_switch_loss(logits):
        E = logits.shape[-1]
        f = F.one_hot(logits.argmax(-1), E).double().mean(0)                   # share of tokens per expert
        P = logits.double().log_softmax(-1).exp().mean(0)                      # mean probability per expert
        return E * torch.dot(f, P)
    """,
    (COUNT, "python-lists"): """
    def my_count_by_gate(gate_idx, num_expert):
        flat = gate_idx.reshape(-1).tolist()
        pos = [i for e in range(num_expert) for i, v in enumerate(flat) if v == e]
        return torch.tensor(pos, dtype=torch.long), torch.tensor([flat.count(e) for e in range(num_expert)])
    """,
    (COUNT, "nonzero-per-expert-int32"): """
    def my_count_by_gate(gate_idx, num_expert):
        flat = gate_idx.flatten()
        pos = torch.cat([torch.nonzero(flat == e).flatten() for e in range(num_expert)])
        counts = (flat.unsqueeze(1) == torch.arange(num_expert)).sum(0).to(torch.int32)   # int32 is an integer
        return pos, counts
    """,
    (TOPK, "stable-sort"): """
    def my_topk_gate(logits, k):
        val, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
        top = val[:, :k]
        w = torch.exp(top - top[:, :1])
        return idx[:, :k], w / w.sum(-1, keepdim=True)
    """,
    (TOPK, "argmax-k-times-scatter"): """
    def my_topk_gate(logits, k):
        work, picks = logits.clone(), []
        for _ in range(k):
            best = work.argmax(-1, keepdim=True)                               # (T, 1)
            picks.append(best)
            work = work.scatter(1, best, float("-inf"))
        idx = torch.cat(picks, dim=1)
        return idx, torch.softmax(logits.gather(1, idx), dim=-1)
    """,
    (TOPK, "argmax-k-times-index-assign"): """
    def my_topk_gate(logits, k):
        work, picks = logits.clone(), []
        for _ in range(k):
            best = work.argmax(-1)                                             # (T,)
            picks.append(best)
            work[torch.arange(work.shape[0]), best] = float("-inf")            # not chosen twice
        idx = torch.stack(picks, dim=1)
        return idx, torch.softmax(logits.gather(1, idx), dim=-1)
    """,
    (DROP, "one-hot-cumsum"): """
    def my_drop_over_capacity(gate_idx, num_expert, capacity):
        flat = gate_idx.t().reshape(-1)                                        # all 1st choices, then 2nd ...
        hot = F.one_hot(flat.clamp_min(0), num_expert) * (flat >= 0).unsqueeze(1)
        arrival = (hot.cumsum(0) * hot).sum(1) - 1                             # my place in my expert's queue
        kept = torch.where((flat >= 0) & (arrival < capacity), flat, -1)
        return kept.reshape(gate_idx.shape[1], -1).t()
    """,
    (DROP, "python-lists"): """
    def my_drop_over_capacity(gate_idx, num_expert, capacity):
        rows, room = gate_idx.tolist(), {e: capacity for e in range(num_expert)}
        for j in range(gate_idx.shape[1]):
            for row in rows:
                if row[j] >= 0 and room[row[j]] > 0:
                    room[row[j]] -= 1
                elif row[j] >= 0:
                    row[j] = -1
        return torch.tensor(rows, dtype=torch.long).reshape(gate_idx.shape)
    """,
}


@pytest.mark.parametrize("name, variant", list(HONEST), ids=[f"{n}-{v}" for n, v in HONEST])
def test_honest_variants_pass(name, variant):
    passes(name, HONEST[name, variant])


def _body(name: str, params: str, body: str, head: str = "") -> str:
    return f"{head}\ndef {name}({params}):\n    {body}\n"


SHORTCUTS = {  # (exercise, id): (source, rule, phrase the report must hold)
    (MOE, "FMoETransformerMLP"): (_body(MOE, "x, *w", "return FMoETransformerMLP(4, 8, 16)(x)",
                                        "from labutils.moe import FMoETransformerMLP"), "import", None),
    (MOE, "fastmoe-general-forward"): (_body(MOE, "x, *w", "return api.fmoe_general_global_forward(x)",
                                             "from labutils.moe.fastmoe import api"), "import", None),
    (MOE, "reference_moe-via-torch.sys"): (_body(MOE, "x, *w", "return torch.sys.modules['labutils.moe.reference']"
                                                 ".reference_moe(x)"), "module-escape", None),
    (MOE, "softmax-over-all-E"): (_body(MOE, "x, w_gate, b_gate, W1, b1, W2, b2, k", """
        p, idx = torch.topk(torch.softmax(x @ w_gate.T + b_gate, -1), k, dim=-1)    # SwitchGate's scores
        gates = torch.zeros(x.shape[0], w_gate.shape[0]).scatter(1, idx, p)
        out = torch.einsum("teh,edh->ted", F.gelu(torch.einsum("td,ehd->teh", x, W1) + b1), W2) + b2
        return torch.einsum("te,ted->td", gates, out)"""), None, None),
    (SWITCH, "balance_loss"): (_body(SWITCH, "lg", "return balance_loss(lg.softmax(-1), lg.argmax(-1, keepdim=True))",
                                     "from labutils.moe.modern.losses import balance_loss"), "import", None),
    (SWITCH, "SwitchGate"): (_body(SWITCH, "lg", "return SwitchGate(lg.shape[1], lg.shape[1]).get_loss()",
                                   "from labutils.moe import SwitchGate"), "import", None),
    (SWITCH, "balance_loss-via-torch.sys"): (_body(SWITCH, "lg", "return torch.sys.modules['labutils.moe.modern"
                                                   ".losses'].balance_loss(lg.softmax(-1), lg.argmax(-1)[:, None])"),
                                             "module-escape", None),
    (SWITCH, "no-factor-E"): (_body(SWITCH, "lg", "return (F.one_hot(lg.argmax(-1), lg.shape[1]).float().mean(0)"
                                    " * lg.softmax(-1).mean(0)).sum()"), None, None),
    (SWITCH, "P-squared"): (_body(SWITCH, "lg", "return lg.shape[1] * (lg.softmax(-1).mean(0) ** 2).sum()"),
                            None, None),
    (COUNT, "count_by_gate"): (_body(COUNT, "g, e", "return count_by_gate(g, e)",
                                     "from labutils.moe import count_by_gate"), "import", None),
    (COUNT, "fastmoe-api"): (_body(COUNT, "g, e", "return api.count_by_gate(g, e, 1)[:2]",
                                   "import labutils.moe.fastmoe.api as api"), "import", None),
    (COUNT, "count_by_gate-via-torch.os"): (_body(COUNT, "g, e", "return torch.os.sys.modules['labutils.moe']"
                                                  ".count_by_gate(g, e)"), "module-escape", None),
    (COUNT, "unstable-sort"): (_body(COUNT, "g, e", """
        flat = g.reshape(-1)
        pos = torch.argsort(torch.where(flat >= 0, flat, e))[: int((flat >= 0).sum())]   # ties in any order
        return pos, torch.bincount(flat[flat >= 0], minlength=e)"""), None, None),
    (COUNT, "drops-counted"): (_body(COUNT, "g, e", "return (torch.argsort(g.reshape(-1).clamp_min(0), stable=True),"
                                     " torch.bincount(g.reshape(-1).clamp_min(0), minlength=e))"), None, None),
    (COUNT, "float-counts"): (_body(COUNT, "g, e", """
        flat = g.reshape(-1)
        pos = torch.argsort(torch.where(flat >= 0, flat, e), stable=True)[: int((flat >= 0).sum())]
        return pos, torch.bincount(flat[flat >= 0], minlength=e).float()"""), None, "an integer answer expected"),
    (TOPK, "NaiveGate"): (_body(TOPK, "lg, k", "return NaiveGate(lg.shape[1], lg.shape[1], 1, k).top_k_logits(lg)[:2]",
                                "from labutils.moe import NaiveGate"), "import", None),
    (TOPK, "NaiveGate-via-torch.sys"): (_body(TOPK, "lg, k", "return torch.sys.modules['labutils.moe.gates']"
                                              ".NaiveGate(lg.shape[1], lg.shape[1], 1, k)(lg)"), "module-escape", None),
    (TOPK, "softmax-over-all-E"): (_body(TOPK, "lg, k", "return torch.topk(torch.softmax(lg, -1), k, -1)[::-1]"),
                                   None, None),
    (TOPK, "smallest-ids"): (_body(TOPK, "lg, k", "return (torch.topk(lg, k, -1, largest=False).indices,"
                                   " torch.softmax(torch.topk(lg, k, -1).values, -1))"), None, None),
    (TOPK, "float-ids"): (_body(TOPK, "lg, k", "v, i = torch.topk(lg, k, -1)\n    return i.float(), v.softmax(-1)"),
                          None, "an integer answer expected"),
    (DROP, "drop_over_capacity"): (_body(DROP, "g, e, c", "return drop_over_capacity(g, e, c)",
                                         "from labutils.moe import drop_over_capacity"), "import", None),
    (DROP, "limit_by_capacity"): (_body(DROP, "g, e, c", "return limit_by_capacity(g, e, world_size=1, capacity=c)[2]",
                                        "from labutils.moe.capacity import limit_by_capacity"), "import", None),
    (DROP, "position_in_expert-via-torch.sys"): (_body(DROP, "g, e, c", "rank = torch.sys.modules['labutils.moe"
                                                       ".capacity'].position_in_expert(g, e)\n    return "
                                                       "torch.where((g >= 0) & (rank < c), g, -1)"),
                                                 "module-escape", None),
    (DROP, "token-major-order"): (_body(DROP, "g, e, c", """
        out, load = g.clone(), [0] * e
        for t in range(g.shape[0]):                     # token by token, both choices together
            for j in range(g.shape[1]):
                if g[t, j] >= 0 and load[g[t, j]] < c:
                    load[g[t, j]] += 1
                elif g[t, j] >= 0:
                    out[t, j] = -1
        return out"""), None, None),
    (DROP, "float-answer"): (_body(DROP, "g, e, c", "return torch.zeros(g.shape) - 1.0"), None,
                             "an integer answer expected"),
}


@pytest.mark.parametrize("name, shortcut", list(SHORTCUTS), ids=[f"{n}-{s}" for n, s in SHORTCUTS])
def test_shortcuts_fail(name, shortcut):
    src, rule, says = SHORTCUTS[name, shortcut]
    fails(name, src, rule, says)


@pytest.fixture(scope="module")
def copy_on_disk(tmp_path_factory):
    """A real renamed coursework copy exists on this machine while its shortcut is graded (it still may not be used)."""
    return renamed_copy(str(tmp_path_factory.mktemp("coursework")))


@pytest.mark.parametrize("name", NAMES)
def test_the_renamed_copy_is_an_import(name, copy_on_disk):
    fails(name, "import mylab.labutils.moe as lab\n" + solution(name), "import")


@pytest.mark.parametrize("name", NAMES)
def test_exec_of_the_solutions_source_is_dynamic_code(name):
    src = f"SRC = {solution(name)!r}\n\ndef {name}(*args):\n    ns = {{'torch': torch}}\n    exec(SRC, ns)\n" \
          f"    return ns[{name!r}](*args)\n"
    fails(name, src, "dynamic-code")


PASTED = {
    (MOE, "checker-reference"): (ch01.moe_forward_reference, "moe_forward_reference(*args)"),
    (MOE, "reference_moe"): (reference_moe, "reference_moe(*args)"),
    (SWITCH, "checker-reference"): (ch01.switch_loss_reference, "switch_loss_reference(*args)"),
    (SWITCH, "balance_loss"): (balance_loss, "balance_loss(args[0].softmax(-1), args[0].argmax(-1)[:, None])"),
    (COUNT, "checker-reference"): (ch01.count_by_gate_reference, "count_by_gate_reference(*args)"),
    (COUNT, "labutils.moe.functions.count_by_gate"): (count_by_gate, "count_by_gate(*args)"),
    (TOPK, "checker-reference"): (ch01.topk_gate_reference, "topk_gate_reference(*args)"),
    (DROP, "checker-reference"): (ch01.drop_reference, "drop_reference(*args)"),
    (DROP, "labutils.moe.capacity.drop_over_capacity"): (drop_over_capacity, "drop_over_capacity(*args)"),
    (DROP, "position_in_expert"): (position_in_expert, "torch.where((args[0] >= 0) & "
                                   "(position_in_expert(args[0], args[1]) < args[2]), args[0], -1)"),
}


@pytest.mark.parametrize("name, what", list(PASTED), ids=[f"{n}-{w}" for n, w in PASTED])
def test_pasted_library_or_checker_code_is_identity(name, what):
    fn, call = PASTED[name, what]
    fails(name, pasted(fn, name, call), "identity")


TABLE_ANSWER = {  # how the table's plain lists become the answer again (v: the visible case's entry)
    MOE: "torch.tensor(v)", SWITCH: "v", COUNT: "torch.tensor(v[0], dtype=torch.long), torch.tensor(v[1])",
    TOPK: "torch.tensor(v[0]), torch.tensor(v[1])", DROP: "torch.tensor(v)",
}


@pytest.mark.parametrize("name", NAMES)
def test_a_lookup_table_of_the_visible_cases_fails_the_hidden_ones(name):
    cases = ch01.CASES[name]()

    def plain(v):
        return tuple(plain(x) for x in v) if isinstance(v, tuple) else v.tolist()

    table = {tuple(c[0].shape): plain(cases.reference(*c)) for c in cases.visible}
    assert len(table) == len(cases.visible)                    # the first input's shape tells the cases apart
    src = f"TABLE = {table!r}\n\ndef {name}(*args):\n    v = TABLE[tuple(args[0].shape)]\n" \
          f"    return {TABLE_ANSWER[name]}\n"
    only_hidden_wrong(fails(name, src))
