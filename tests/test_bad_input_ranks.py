"""Bad input, round four (issue 41), across ranks: the wire counter, the agreement helper, the data-parallel
wrappers and chapter 06's gradient check refuse what they would have miscounted, mixed, crashed on (SIGABRT in
gloo) or answered obscurely, with a message naming the argument or the ranks, the value and what is accepted.

The checks that need ranks share one 2-rank launch (``_every_rank``, a module fixture), one case after another: a
refused call raises on every rank before anything moved, so the next case starts from agreeing ranks; each case's
positive control runs in the same launch. Two tests start their own: ``grad_check`` in a 4-rank launch, and an
uncaught mismatch. Tests that start workers carry ``@pytest.mark.dist``."""
from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from labutils import WorkerError, launch
from labutils.agreement import DTYPES, CollectiveMismatch, disagreements, dtype_code, dtype_name, gather_rows
from labutils.data_parallel import DistributedGroupedDataParallel, GroupedDataParallel
from labutils.wire import count_wire

MB = 1 << 20


def _caught(fn):
    """``("ok", value)`` or ``(exception type name, message)``."""
    try:
        return "ok", fn()
    except Exception as exc:  # the test asserts the type
        return type(exc).__name__, str(exc)


class Heads(nn.Module):
    """A body and one head per name in ``heads``, each ``nn.Linear(4, 2)``; uses the heads in ``use``."""

    def __init__(self, heads=("head",), use=None):
        super().__init__()
        self.body = nn.Linear(4, 4)
        for h in heads:
            setattr(self, h, nn.Linear(4, 2))
        self.use = list(use if use is not None else heads)

    def forward(self, x):
        z = self.body(x)
        return sum(getattr(self, h)(z).sum() for h in self.use)


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _backward(m, rank):
    torch.manual_seed(100 + rank)
    m.zero_grad(set_to_none=True)
    m(torch.randn(3, 4)).backward()


def _every_rank():
    """Every case of this file that needs ranks, in one 2-rank launch: case -> (outcome, message or value)."""
    import torch.distributed as dist

    from labbook import ep_bugs
    from labutils.data_parallel import mark_expert_params

    rank = dist.get_rank()
    out = {}

    # -- count_wire: without `with`, read inside the block, and the positive control (1 MB all_reduce) -------
    unused = count_wire()
    dist.all_reduce(torch.zeros(MB // 4))
    out["wire without with"] = _caught(lambda: unused.sent)
    with count_wire() as w:
        dist.all_reduce(torch.zeros(MB // 4))
        out["wire inside block"] = _caught(lambda: w.received)
        out["wire store inside block"] = _caught(lambda: w.store)
        out["wire entered again"] = _caught(lambda: _enter_again(w))
    out["wire control"] = ("ok", (w.sent, w.received))
    out["wire extras control"] = ("ok", (w.store, w.closed, w.settled))

    # -- gather_rows: rows of different lengths, then the same lengths ---------------------------------------
    out["rows of different lengths"] = _caught(lambda: gather_rows([7, 8, 9][:2 + rank], torch.zeros(1), None))
    out["rows control"] = _caught(lambda: gather_rows([rank, 5], torch.zeros(1), None).tolist())

    # -- ranks reducing different heads of the same size ------------------------------------------------------
    torch.manual_seed(rank)                                         # the ranks start different
    m = Heads(("head_a",) if rank == 0 else ("head_b",))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out["heads at wrap"] = _caught(lambda: GroupedDataParallel(m))
    out["heads nothing broadcast"] = ("ok", all(torch.equal(p, before[n]) for n, p in m.named_parameters()))
    gdp = GroupedDataParallel(m, sync_params=False)
    _backward(m, rank)
    local = _grads(m)
    out["heads at reduce"] = _caught(gdp.allreduce_gradients)
    out["heads nothing reduced"] = ("ok", all(torch.equal(g, local[n]) for n, g in _grads(m).items()))
    out["heads fastmoe wrapper"] = _caught(lambda: DistributedGroupedDataParallel(m))

    # -- only rank 0 tags a parameter as an expert -------------------------------------------------------------
    m = Heads()
    if rank == 0:
        mark_expert_params(m.head)
    out["expert tag on rank 0 only"] = _caught(lambda: GroupedDataParallel(m))

    # -- a gradient on one rank only -----------------------------------------------------------------------------
    m = Heads(("a", "b"), use=("a", "b") if rank == 0 else ("a",))
    gdp, dgdp = GroupedDataParallel(m), DistributedGroupedDataParallel(m)
    _backward(m, rank)
    local = _grads(m)
    out["grad on one rank"] = _caught(gdp.allreduce_gradients)
    out["grad on one rank, fastmoe wrapper"] = _caught(dgdp.allreduce_gradients)
    out["grad nothing reduced"] = ("ok", all(torch.equal(g, local[n]) for n, g in _grads(m).items()))

    # -- fastmoe's wrapper: a tag no group reduces ('DP', a typo of 'dp') -------------------------------------------
    m = Heads()
    m.body.weight.dp_comm = "DP"
    out["DP tag at wrap"] = _caught(lambda: DistributedGroupedDataParallel(m))
    out["DP tag without sync"] = _caught(lambda: DistributedGroupedDataParallel(m, need_sync=False))

    # -- positive controls: agreeing ranks that start different; "b" unused on every rank (no gradient anywhere) --
    torch.manual_seed(rank)
    m = Heads(("a", "b"), use=("a",))
    gdp = GroupedDataParallel(m)
    _backward(m, rank)
    want = _grads(m)
    for g in want.values():
        dist.all_reduce(g)
        g /= 2
    counts = gdp.allreduce_gradients()
    gathered = [None, None]
    dist.all_gather_object(gathered, {n: p.detach() for n, p in m.named_parameters()})
    out["grouped control"] = ("ok", {
        "same params": all(torch.equal(gathered[0][n], gathered[1][n]) for n in gathered[0]),
        "mean grads": sorted(n for n, g in _grads(m).items() if torch.allclose(g, want[n])), "counts": counts})
    torch.manual_seed(rank)                                         # fastmoe's wrapper: "mp" with no mp_group
    m2 = Heads(("a", "b"), use=("a",))                              # is left alone, the rest averaged
    m2.a.weight.dp_comm = "mp"
    dgdp = DistributedGroupedDataParallel(m2)
    _backward(m2, rank)
    want = _grads(m2)
    for n, g in want.items():
        if n != "a.weight":
            dist.all_reduce(g)
            g /= 2
    dgdp.allreduce_gradients()
    out["fastmoe control"] = ("ok", {n: torch.allclose(g, want[n]) for n, g in _grads(m2).items()})

    # -- chapter 06's gradient check: a world that is not the launch's, then the default ---------------------------
    out["grad_check world"] = _caught(lambda: ep_bugs.grad_check("correct", world=4))
    out["grad_check control"] = _caught(lambda: ep_bugs.grad_check("correct")["grads"]["failed"])
    return out


def _enter_again(w):
    with w:   # the counter's own block is still open
        pass


@pytest.fixture(scope="module")
def ranks():
    """Both ranks' outcomes of ``_every_rank``; every refusal must be the same on both (raised everywhere)."""
    return launch(_every_rank, 2, timeout=120)


def _same_on_every_rank(ranks, case):
    outcomes = [r[case] for r in ranks]
    assert outcomes[0] == outcomes[1], f"{case}: the ranks answered differently: {outcomes}"
    return outcomes[0]


# -- count_wire ---------------------------------------------------------------------------------------------------

def test_count_wire_read_without_with_raises_instead_of_reporting_zero():
    w = count_wire()
    for attr in ("sent", "received", "store", "closed", "settled"):   # the last three gave None
        with pytest.raises(RuntimeError, match=r"never entered, so it counted nothing \(not 0 bytes\): use "
                                               r"`with count_wire\(\) as w: \.\.\.`"):
            getattr(w, attr)
    assert repr(w) == "WireCount(not counted: use `with count_wire() as w:`)"


@pytest.mark.dist
def test_count_wire_in_a_rank_without_with_or_inside_the_block(ranks):
    for r in ranks:
        kind, text = r["wire without with"]
        assert kind == "RuntimeError" and "never entered" in text and "`with count_wire() as w:" in text, text
        kind, text = r["wire inside block"]
        assert kind == "RuntimeError" and "read inside the `with count_wire() as w:` block" in text, text
        kind, text = r["wire store inside block"]
        assert kind == "RuntimeError" and "(and w.store, w.closed, w.settled) are read inside the `with " \
            "count_wire() as w:` block" in text, text
        kind, text = r["wire entered again"]
        assert kind == "RuntimeError" and text.startswith("count_wire: this counter is already counting"), text
        assert "entering it again would restart its count and lose the outer one" in text, text
        sent, received = r["wire control"][1]
        assert sent >= MB and received >= MB, (sent, received)   # 2 ranks, ring all-reduce: the tensor each way
        store, closed, settled = r["wire extras control"][1]    # the refused re-entry left the outer count intact
        assert store == 0 and closed == 0 and settled is True, r["wire extras control"]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(max_wait=float("inf")), ValueError, r"max_wait must be a finite number of seconds, got inf \(the count "
                                              r"would wait forever for a socket that never goes quiet\)"),
    (dict(settle=float("nan")), ValueError, r"settle must be a finite number of seconds, got nan"),
    (dict(settle="0.1"), TypeError, r"settle must be a number of seconds, got '0\.1'"),
    (dict(max_wait=True), TypeError, r"max_wait must be a number of seconds, got True"),
    (dict(settle=1.0, max_wait=0.5), ValueError, r"need 0 <= settle <= max_wait, got settle=1\.0, max_wait=0\.5"),
    (dict(settle=-0.1), ValueError, r"need 0 <= settle <= max_wait, got settle=-0\.1, max_wait=5\.0"),
], ids=["inf-wait", "nan-settle", "str-settle", "bool-wait", "settle-past-wait", "negative-settle"])
def test_count_wire_bad_settle_or_max_wait_is_refused(kwargs, error, words):
    """Refused when the counter is made, outside a rank too (max_wait=inf could wait forever; '0.1' was a
    TypeError from a comparison)."""
    with pytest.raises(error, match=r"^count_wire: " + words + "$"):
        count_wire(**kwargs)
    assert count_wire(settle=0, max_wait=0).settle == 0.0   # the control: no settling at all is allowed


def test_count_wire_around_a_launch_says_to_count_in_the_worker():
    """A process holding a TCP socket (as a Jupyter kernel does) but no process group: refused before the block."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    ran = []
    refusal = (r"this process is not a rank \(torch.distributed is not initialised here\)\. Around "
               r"labutils\.launch\(\.\.\.\) it would report 0 bytes.*Count inside the worker function instead")
    try:
        with pytest.raises(RuntimeError, match=refusal), count_wire():
            ran.append(True)
            launch(_one_mb_all_reduce, 2, timeout=60)
    finally:
        client.close()
        server.close()
    assert ran == []                                                   # nothing launched, nothing miscounted


def _one_mb_all_reduce():
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(MB // 4))


# -- agreement helpers ---------------------------------------------------------------------------------------------

def test_dtype_code_refuses_a_string_naming_the_dtype_to_pass():
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype such as torch\.float32, got the str "
                                        r"'float32' \(pass torch\.float32\)"):
        dtype_code("float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got the int 3$"):
        dtype_code(3)  # type: ignore[arg-type]
    assert dtype_name(dtype_code(torch.float32)) is torch.float32 and DTYPES[dtype_code(torch.int8)] is torch.int8


def test_disagreements_with_too_few_names_says_one_name_per_column():
    rows = torch.tensor([[1, 2, 3], [1, 5, 3]])                        # (world, fields)
    with pytest.raises(ValueError, match=r"names has 2 entries but rows has shape \(2, 3\): give one name per "
                                         r"column \(3\)"):
        disagreements(rows, ["a", "b"])
    with pytest.raises(ValueError, match=r"names has 3 entries but rows has shape \(3,\)"):
        disagreements(rows[0], ["a", "b", "c"])
    assert disagreements(rows, ["a", "b", "c"]) == {"b": "b: rank 0=2, rank 1=5"}


def test_gather_rows_outside_a_launch_says_there_is_no_process_group():
    with pytest.raises(RuntimeError, match=r"gather_rows needs a process group, but torch.distributed is not "
                                           r"initialised: run it inside labutils\.launch\(\.\.\.\) workers, or call "
                                           r"torch\.distributed\.init_process_group first"):
        gather_rows([1, 2], torch.zeros(1), None)


@pytest.mark.dist
def test_gather_rows_of_different_lengths_raise_on_every_rank_instead_of_sigabrt(ranks):
    kind, text = _same_on_every_rank(ranks, "rows of different lengths")
    assert kind == CollectiveMismatch.__name__, text
    assert text == ("gather_rows: ranks passed rows of different lengths: rank 0 2, rank 1 3 (every rank must pass "
                    "a row of the same length) (raised on every rank before any data moved)")
    assert [r["rows control"] for r in ranks] == [("ok", [[0, 5], [1, 5]])] * 2


# -- data-parallel wrappers ----------------------------------------------------------------------------------------

def test_data_parallel_wrappers_outside_a_launch_say_there_is_no_process_group():
    with pytest.raises(RuntimeError, match=r"^DistributedGroupedDataParallel needs a process group, but "
                                           r"torch\.distributed is not initialised: run it inside labutils\.launch"):
        DistributedGroupedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"^GroupedDataParallel needs a process group.*labutils\.launch"):
        GroupedDataParallel(nn.Linear(2, 2), sync_params=False)
    with pytest.raises(ValueError, match="expert_scale must be 'mean' or 'sum', not 'avg'"):   # arguments first
        GroupedDataParallel(nn.Linear(2, 2), expert_scale="avg")


@pytest.mark.dist
def test_ranks_training_different_heads_are_refused_before_anything_moves(ranks):
    held = ("parameters ['head_a.weight', 'head_a.bias'] are held by rank 0 only; parameters ['head_b.weight', "
            "'head_b.bias'] are held by rank 1 only (raised on every rank before any data moved)")
    for case, what in (("heads at wrap", "broadcast_grouped_params"), ("heads at reduce", "allreduce_grouped_grads"),
                       ("heads fastmoe wrapper", "DistributedGroupedDataParallel (its start-up broadcast)")):
        kind, text = _same_on_every_rank(ranks, case)
        assert kind == "CollectiveMismatch" and text == f"{what}: {held}", (case, text)
    for r in ranks:                                                    # refused before the broadcast / all-reduce
        assert r["heads nothing broadcast"] == ("ok", True) and r["heads nothing reduced"] == ("ok", True)


@pytest.mark.dist
def test_an_expert_tag_on_one_rank_only_is_refused(ranks):
    kind, text = _same_on_every_rank(ranks, "expert tag on rank 0 only")
    assert kind == "CollectiveMismatch", text
    assert ("'head.weight' gradient group: rank 0 expert, rank 1 dp; 'head.bias' gradient group: rank 0 expert, "
            "rank 1 dp") in text and text.startswith("broadcast_grouped_params: "), text


@pytest.mark.dist
def test_a_gradient_on_one_rank_only_is_refused_instead_of_sigabrt(ranks):
    for case, what in (("grad on one rank", "allreduce_grouped_grads"),
                       ("grad on one rank, fastmoe wrapper", "DistributedGroupedDataParallel.allreduce_gradients")):
        kind, text = _same_on_every_rank(ranks, case)
        assert kind == "CollectiveMismatch", (case, text)
        assert text.startswith(f"{what}: 'b.weight' gradient: rank 0 grad, rank 1 no grad; 'b.bias' gradient: "
                               "rank 0 grad, rank 1 no grad (the ranks that reduce a parameter must all have a "
                               "gradient"), text
    assert all(r["grad nothing reduced"] == ("ok", True) for r in ranks)


@pytest.mark.dist
def test_fastmoe_wrapper_refuses_a_tag_no_group_reduces(ranks):
    accepted = "accepted: ['dp', 'expert', 'gate', 'moe', 'mp', 'none', 'world'] (or reduce it over a group of your own"
    kind, text = _same_on_every_rank(ranks, "DP tag at wrap")
    assert kind == "CollectiveMismatch" and issubclass(CollectiveMismatch, ValueError), text
    assert text.startswith("DistributedGroupedDataParallel (its start-up broadcast): rank 0 parameter 'body.weight': "
                           "dp_comm='DP' on a parameter of shape (4, 4) is not a tag any group reduces; ") and \
        accepted in text and "rank 1 parameter 'body.weight'" in text, text
    kind, text = _same_on_every_rank(ranks, "DP tag without sync")
    assert kind == "ValueError" and text.startswith("DistributedGroupedDataParallel: parameter 'body.weight': "
                                                    "dp_comm='DP'") and accepted in text, text


@pytest.mark.dist
def test_data_parallel_controls_agreeing_ranks_train_as_before(ranks):
    dense = ["a.bias", "a.weight", "body.bias", "body.weight"]
    for r in ranks:
        got = r["grouped control"][1]
        assert got == {"same params": True, "mean grads": dense, "counts": {"dp": 4, "world": 0, "expert": 0}}, got
        assert r["fastmoe control"] == ("ok", dict.fromkeys(["body.weight", "body.bias", "a.weight", "a.bias"], True))


# -- chapter 06's gradient check --------------------------------------------------------------------------------------

@pytest.mark.dist
def test_grad_check_refuses_a_world_that_is_not_the_launchs(ranks):
    kind, text = _same_on_every_rank(ranks, "grad_check world")
    assert kind == "ValueError" and text == ("world=4, but this launch has 2 ranks: pass world=2 or leave world out "
                                             "(it defaults to the launch's size)"), text
    assert [r["grad_check control"] for r in ranks] == [("ok", [])] * 2


def _grad_check_default_world():
    from labbook import ep_bugs

    return ep_bugs.grad_check("correct")["grads"]["failed"]


@pytest.mark.dist
def test_grad_check_in_a_4_rank_launch_defaults_to_the_launchs_world():
    """Its ``world`` defaulted to 2: ranks 2 and 3 then died with an IndexError."""
    assert launch(_grad_check_default_world, 4, timeout=120) == [[]] * 4


@pytest.mark.dist
def test_an_uncaught_mismatch_ends_the_launch_with_its_message_not_a_signal():
    """Uncaught, the refusal ends the launch as a WorkerError quoting it (before: rank 0 killed by SIGABRT)."""
    with pytest.raises(WorkerError, match=r"rank \d raised CollectiveMismatch: gather_rows: ranks passed rows of "
                                          r"different lengths: rank 0 2, rank 1 3"):
        launch(_uncaught_lengths, 2, timeout=60)


def _uncaught_lengths():
    import torch.distributed as dist

    gather_rows([7, 8, 9][:2 + dist.get_rank()], torch.zeros(1), None)
