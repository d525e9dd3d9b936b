"""Red team for chapter 06's exercises on the grader: the book's solution and honest variants pass; labutils,
DeepSpeed, the renamed copy, pasted library or checker code, lookup tables, the notebook's globals, mutated inputs
and the known wrong answers (for the bytes: a capacity in float64, issue 30, by int() or round()) fail."""
import re

import pytest
import torch
from redteam import fails, only_hidden_wrong, passes, pasted, renamed_copy, solution, with_body, wrong

from labbook.checkers import ch06
from labutils.collectives import AllGatherFunction
from labutils.moe import traffic
from labutils.moe.expert_parallel import local_order


@pytest.mark.parametrize("name, line", [
    ("all_gather_backward", "all 22 cases match (12 visible, 10 hidden)"),
    ("my_local_order", "all 15 cases match (5 visible, 10 hidden)"),
    ("ds_dispatch_bytes", "all 18 cases match (6 visible, 12 hidden)"),
])
def test_the_books_solution_passes(name, line):
    assert line in passes(name, solution(name)).text()


@pytest.mark.parametrize("name, module", [
    ("all_gather_backward", "from mylab.collectives import AllGatherFunction"),
    ("my_local_order", "from mylab.moe.expert_parallel import local_order"),
    ("ds_dispatch_bytes", "from mylab.moe import traffic"),
])
def test_the_renamed_copy_is_an_import(tmp_path_factory, name, module):
    assert renamed_copy(str(tmp_path_factory.mktemp("coursework"))).is_dir()     # on disk, and still refused
    fails(name, with_body(name, module, "    return r"), "import")


# --- exercise 1: all_gather_backward ---------------------------------------------------------------------------

GATHER = "all_gather_backward"
GATHER_TABLE = {(tuple(c[1]), c[2], c[3], tuple(c[0][0].flatten().tolist()[:1])):
                ch06.all_gather_backward_reference(*c).tolist() for c in ch06._gather_visible()}


@pytest.mark.parametrize("src", [
    """
    def all_gather_backward(upstream, sizes, rank, mode):
        start = sum(sizes[:rank])
        grad = sum(upstream) if mode == "sum" else upstream[rank]
        return grad[start:start + sizes[rank]]
    """,
    """
    def all_gather_backward(upstream, sizes, rank, mode):
        d = upstream[0].shape[1]
        x = torch.zeros(sizes[rank], d, dtype=upstream[0].dtype, requires_grad=True)
        gathered = torch.cat([x if r == rank else torch.zeros(n, d, dtype=x.dtype) for r, n in enumerate(sizes)])
        used = upstream if mode == "sum" else [upstream[rank]]
        (grad,) = torch.autograd.grad(sum((g * gathered).sum() for g in used), x)
        return grad
    """,
    """
    def all_gather_backward(upstream, sizes, rank, mode):
        total = upstream[rank].clone()
        if mode == "sum":
            for r, g in enumerate(upstream):
                if r != rank:
                    total += g
        offsets = torch.cumsum(torch.tensor([0] + list(sizes)), 0)
        return total.index_select(0, torch.arange(int(offsets[rank]), int(offsets[rank + 1])))
    """,
], ids=["offsets", "autograd", "index_select"])
def test_all_gather_backward_honest_variants_pass(src):
    passes(GATHER, src)


@pytest.mark.parametrize("head, body, rule", [
    ("from labutils.collectives import AllGatherFunction", "    return r", "import"),
    ("import torch.distributed as dist", "    return r", "import"),
    ("from labbook.checkers.ch06 import all_gather_backward_reference as ref", "    return ref(*args)", "import"),
    ("", "    return grad_results[0][('per-rank', args[3])][1]", "cell-alone"),
    ("", "    args[0][args[2]].zero_()\n    return r", "read-only-inputs"),
    ("", "    args[1].reverse()\n    return r", "read-only-inputs"),
    ("", "    up, sizes, rank, mode = args\n    return up[rank].split(list(sizes))[rank]", None),
    ("", "    up, sizes, rank, mode = args\n    return torch.stack(up).sum(0).split(list(sizes))[rank]", None),
    ("", "    up, sizes, rank, mode = args\n    return torch.stack(up).sum(0) if mode == 'sum' else up[rank]", None),
    ("", "    up, sizes, rank, mode = args\n    g = sum(up) if mode == 'sum' else up[rank]\n"
         "    return g[rank * sizes[rank]:(rank + 1) * sizes[rank]]", None),
], ids=["library", "torch.distributed", "checker-reference", "notebook-global", "zeroes-upstream",
        "reverses-sizes", "sum-mode-forgets-other-ranks", "always-sum", "no-slice", "even-offsets"])
def test_all_gather_backward_shortcuts_fail(head, body, rule):
    src = with_body(GATHER, head, body)
    fails(GATHER, src, rule) if rule else wrong(GATHER, src)


# --- exercise 2: my_local_order --------------------------------------------------------------------------------

ORDER = "my_local_order"
ORDER_TABLE = {(tuple(c), ne): ch06.local_order_reference(torch.tensor(c), ne).tolist()
               for c, ne in ch06.LOCAL_ORDER_VISIBLE}


@pytest.mark.parametrize("src", [
    """
    def my_local_order(global_expert_count, num_expert):
        starts = global_expert_count.cumsum(0) - global_expert_count
        c = global_expert_count.view(-1, num_expert).t().reshape(-1)      # (expert, source) order
        s = starts.view(-1, num_expert).t().reshape(-1)
        within = torch.arange(int(c.sum())) - torch.repeat_interleave(c.cumsum(0) - c, c)
        return torch.repeat_interleave(s, c) + within
    """,
    """
    def my_local_order(global_expert_count, num_expert):
        counts, order = global_expert_count.tolist(), []
        for e in range(num_expert):
            for b in range(e, len(counts), num_expert):                   # source s's block: s * num_expert + e
                order.extend(range(sum(counts[:b]), sum(counts[:b + 1])))
        return torch.tensor(order, dtype=torch.long)
    """,
    """
    def my_local_order(global_expert_count, num_expert):
        n = global_expert_count.numel()
        block = torch.arange(n).repeat_interleave(global_expert_count)    # received row -> its block
        return ((block % num_expert) * n + block).argsort(stable=True)     # by expert, then source
    """,
], ids=["repeat_interleave", "python-loops", "argsort-key"])
def test_my_local_order_honest_variants_pass(src):
    passes(ORDER, src)


@pytest.mark.parametrize("head, body, rule", [
    ("from labutils.moe.expert_parallel import local_order", "    return local_order(*args)", "import"),
    ("from labutils.moe import expert_parallel as parallel", "    return parallel.local_order(*args)", "import"),
    ("from labutils.moe.functions import count_by_gate", "    return r", "import"),
    ("", "    return perm", "cell-alone"),
    ("", "    args[0].zero_()\n    return torch.zeros(0, dtype=torch.long)", "read-only-inputs"),
    ("", "    return torch.arange(int(args[0].sum()))", None),
    ("", "    gec, ne = args\n    world = gec.numel() // ne\n    starts = gec.cumsum(0) - gec\n"
         "    return torch.cat([torch.arange(int(starts[e * world + s]), int(starts[e * world + s] + "
         "gec[e * world + s])) for e in range(ne) for s in range(world)] + [torch.zeros(0, dtype=torch.long)])",
     None),
    ("", "    gec, ne = args\n    world = gec.numel() // ne\n"
         "    block = torch.arange(gec.numel()).repeat_interleave(gec)\n"
         "    return torch.argsort((block % ne) * world + (world - 1 - block // ne), stable=True)", None),
    ("", "    return r.double()", None),
], ids=["library", "library-module", "sibling-count_by_gate", "notebook-perm", "zeroes-counts",
        "grouped-by-rank", "blocks-read-as-expert-major", "sources-reversed", "float-indices"])
def test_my_local_order_shortcuts_fail(head, body, rule):
    src = with_body(ORDER, head, body)
    fails(ORDER, src, rule) if rule else wrong(ORDER, src)


def test_pasted_local_order_with_every_name_changed_is_still_identity():
    src = pasted(local_order, ORDER, "order(*args)")
    for old, new in (("local_order", "order"), ("global_expert_count", "gec"), ("num_expert", "ne"),
                     ("counts", "c"), ("block", "b"), ("src", "s"), ("expert", "x"), ("world", "w")):
        src = re.sub(rf"\b{old}\b", new, src)
    src = re.sub(r'""".*?"""', '"""mine"""', src, flags=re.S)
    assert "local_order" not in src.replace(ORDER, "")
    fails(ORDER, src, "identity")


# --- exercise 3: ds_dispatch_bytes -----------------------------------------------------------------------------

BYTES = "ds_dispatch_bytes"
FLOAT64 = ("def ds_dispatch_bytes(tokens, E, W, d, elem, cf, k):\n"
           "    return E * max(CAPACITY, 4) * d * elem * (W - 1) // W")
F32 = "int(torch.ceil((tokens / E) * torch.tensor(cf * k)))"                  # DeepSpeed's float32 capacity
BYTES_TABLE = {c: ch06.deepspeed_dispatch_bytes(*c) for c in ch06.DISPATCH_BYTES_VISIBLE}


def capacity_by(expr: str, head: str = "") -> str:
    return f"{head}\n" + FLOAT64.replace("CAPACITY", expr) + "\n"      # a capacity per expert, DeepSpeed's floor 4


@pytest.mark.parametrize("src", [
    """
    def ds_dispatch_bytes(tokens, E, W, d, elem, cf, k):
        per_expert = torch.tensor(tokens / E, dtype=torch.float32) * torch.tensor(cf * k, dtype=torch.float32)
        capacity = max(math.ceil(per_expert.item()), 4)
        return (E - E // W) * capacity * d * elem          # the buffer's slots of the experts on other ranks
    """,
    """
    def ds_dispatch_bytes(tokens, E, W, d, elem, cf, k):
        c = torch.full((), tokens / E, dtype=torch.float32).mul(cf * k).ceil().long().clamp(min=4)
        return (E * d * elem * (W - 1) * c) // W
    """,
], ids=["float32-tensors", "tensor-chain"])
def test_ds_dispatch_bytes_honest_variants_pass(src):
    passes(BYTES, src)


@pytest.mark.parametrize("src, rule", [
    (capacity_by("traffic.deepspeed_capacity(tokens, E, cf, k)", "from labutils.moe import traffic"), "import"),
    (capacity_by("ds_capacity(tokens, E, cf, k)", "from labutils.ds.gating import ds_capacity"), "import"),
    (capacity_by("int(sm._capacity(torch.empty(tokens, E), torch.tensor(cf * k), torch.tensor(4)))",
                 "from deepspeed.moe import sharded_moe as sm"), "import"),
    (capacity_by("ch02.deepspeed_capacity(tokens, E, cf, k, 4)", "from labbook.checkers import ch02"), "import"),
    (capacity_by("W * ds_bytes['cf 1.0'] // (E * d * elem * (W - 1))"), "cell-alone"),
    (capacity_by("int(tokens / E * cf * k)"), None),
    (capacity_by("round(tokens / E * cf * k)"), None),
    (capacity_by("-(-(tokens * round(cf * 100) * k) // (E * 100))"), None),
    (capacity_by(F32).replace(" * (W - 1) // W", ""), None),
    (capacity_by(F32).replace(", 4)", ", 0)"), None),
], ids=["library-traffic", "sibling-ds_capacity", "deepspeed", "checker-ch02", "notebook-ds_bytes",
        "int-capacity", "round-capacity", "exact-fraction", "own-experts-included", "no-minimum-capacity"])
def test_ds_dispatch_bytes_shortcuts_fail(src, rule):
    fails(BYTES, src, rule) if rule else wrong(BYTES, src)


def test_ds_dispatch_bytes_as_a_float_is_not_a_count_of_bytes():
    fails(BYTES, solution(BYTES).replace("return torch.tensor(", "return float("), says="an integer answer expected")


def test_the_issue_example_is_visible_and_the_old_float64_solution_misses_it():
    case = (25, 2, 2, 8, 4, 1.2, 1)                                # issue 30: DeepSpeed's C is 16, float64's 15
    assert ch06.DISPATCH_BYTES_VISIBLE.index(case) == 3
    report = wrong(BYTES, capacity_by("math.ceil(tokens / E * cf * k)"))
    assert "case 3" in report.reason


# --- every exercise: a lookup table of the visible cases, pasted library and checker code ----------------------

LOOKUPS = {
    GATHER: f"TABLE = {GATHER_TABLE!r}\n\ndef all_gather_backward(upstream, sizes, rank, mode):\n"
            "    key = (tuple(sizes), rank, mode, tuple(upstream[0].flatten().tolist()[:1]))\n"
            "    return torch.tensor(TABLE.get(key, [[0.0]]), dtype=torch.float64)\n",
    ORDER: f"TABLE = {ORDER_TABLE!r}\n\ndef my_local_order(global_expert_count, num_expert):\n"
           "    key = (tuple(global_expert_count.tolist()), num_expert)\n"
           "    return torch.tensor(TABLE.get(key, []), dtype=torch.long)\n",
    BYTES: capacity_by("math.ceil(tokens / E * cf * k)", f"TABLE = {BYTES_TABLE!r}").replace(   # float64 elsewhere
        "    return E", "    if (tokens, E, W, d, elem, cf, k) in TABLE:\n"
        "        return TABLE[(tokens, E, W, d, elem, cf, k)]\n    return E"),
}


@pytest.mark.parametrize("name", LOOKUPS)
def test_a_lookup_table_of_the_visible_cases_fails_on_hidden_cases(name):
    only_hidden_wrong(wrong(name, LOOKUPS[name]))


@pytest.mark.parametrize("name, fn, call, rule", [
    (GATHER, ch06.all_gather_backward_reference, "all_gather_backward_reference(*args)", "identity"),
    (GATHER, AllGatherFunction, "AllGatherFunction.backward(None, args[0][args[2]], None)[0]", "identity"),
    (ORDER, local_order, "local_order(*args)", "identity"),
    (ORDER, ch06.local_order_reference, "local_order_reference(*args)", "identity"),
    # the bytes' library and checker functions are formula-sized, under identity's floor (MIN_INSTRUCTIONS, as
    # labutils' deepspeed_capacity: written honestly the same way, see test_grader_ch02): pasted, their callee is gone
    (BYTES, traffic.deepspeed_bytes, "deepspeed_bytes(*args[:6], top_k=args[6])", "cell-alone"),
    (BYTES, ch06.deepspeed_dispatch_bytes, "deepspeed_dispatch_bytes(*args)", "cell-alone"),
], ids=["gather-checker-reference", "AllGatherFunction", "local_order", "order-checker-reference",
        "traffic.deepspeed_bytes", "bytes-checker-reference"])
def test_pasted_library_and_checker_code_is_refused(name, fn, call, rule):
    fails(name, pasted(fn, name, call), rule)
