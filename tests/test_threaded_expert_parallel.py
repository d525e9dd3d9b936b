"""Expert parallelism on 2 and 3 in-process ranks (tests/threaded_ranks.py): labutils.moe.expert_parallel's
exchange (rows to the rank of their expert and back, forward and backward), its agreement check and messages, and
FMoE's world_size > 1 path: W ranks with E experts each give what one process with all W*E experts gives, outputs
and gradients, checked against a plain loop over the tokens (no labutils code) and against the local layer.
tests/test_moe_parallel.py and test_fastmoe_dist.py run the same in gloo workers (the reference for the wire).

Threads share what W processes would each have once: every layer here gets its id from ``assign_layer_ids`` (the
first-call ids come from one process-wide counter) and every rank its inputs from the main thread."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from threaded_ranks import run_ranks
from torch import nn

from labutils.agreement import gather_rows
from labutils.moe import FMoE, FMoETransformerMLP, NaiveGate
from labutils.moe.expert_parallel import (
    COUNT_SLOTS,
    ExpertParallelMismatch,
    assign_layer_ids,
    check_agreement,
    exchange_and_run,
    from_experts,
    layer_id,
    local_order,
    shard_state,
    to_experts,
)
from labutils.moe.transformer import _Expert

D = 4


def assert_close(got, want, atol=1e-5, rtol=1e-5):
    """torch.testing.assert_close's check without its first-call import of torch.distributed.tensor (seconds)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (got - want).abs().max()


def caught(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # the tests assert the type
        return type(exc).__name__, str(exc)


class Tagger:
    """A stand-in layer whose local expert e on rank r multiplies its rows by ``g + 1`` (g = r * E + e, the
    global expert): each output row tells which expert ran it."""

    def __init__(self, num_expert, group=None, lid=0):
        self.num_expert, self.moe_group, self.layer_id = num_expert, group, lid
        self.calls, self.exchange_hooks = [], []

    def run_experts(self, x, counts):
        rank = dist.get_rank(self.moe_group)
        self.calls.append(counts.tolist())
        parts = x.split(counts.tolist())
        return torch.cat([p * (rank * self.num_expert + e + 1) for e, p in enumerate(parts)])


def _sorted_rows(rank, counts):
    """Rows sorted by global expert: row j of expert g on rank r is ``[100 r + 10 g + j] * D``."""
    rows = [[100.0 * rank + 10 * g + j] * D for g, n in enumerate(counts) for j in range(n)]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, D)


COUNTS = {2: [[1, 2, 0, 3], [2, 0, 1, 1]],                 # COUNTS[W][rank]: rows to each of W * 2 global experts
          3: [[1, 0, 2, 1, 0, 1], [0, 0, 0, 0, 0, 0], [2, 1, 0, 0, 3, 1]]}


def _exchange(counts, check, subgroup):
    rank = dist.get_rank()
    group = None
    if subgroup:
        group = dist.new_group([0, 2])
        if rank == 1:
            return None
        rank = dist.get_rank(group)
    layer = Tagger(2, group)
    sent = []
    layer.exchange_hooks.append(lambda lay, send, recv, row_bytes: sent.append((lay is layer, send, recv, row_bytes)))
    x = _sorted_rows(rank, counts[rank]).requires_grad_()
    y = exchange_and_run(layer, x, torch.tensor(counts[rank]), check=check)
    (y * y).sum().backward()                                          # d/dx of (x (g+1))^2 = 2 x (g+1)^2
    return y[:, 0].tolist(), x.grad[:, 0].tolist(), layer.calls, sent


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("world", [2, 3])
def test_each_row_runs_on_its_experts_rank_and_comes_back_in_place(world, check):
    counts = COUNTS[world]
    got = run_ranks(_exchange, world, counts, check, False)
    for r in range(world):
        y, grad, calls, sent = got[r]
        g_of_row = [g for g, n in enumerate(counts[r]) for _ in range(n)]
        x = _sorted_rows(r, counts[r])[:, 0].tolist()
        assert y == [v * (g + 1) for v, g in zip(x, g_of_row)], r
        assert grad == [2 * v * (g + 1) ** 2 for v, g in zip(x, g_of_row)], r
        # my local expert e received every rank's rows for global expert 2r + e
        assert calls == [[sum(counts[s][2 * r + e] for s in range(world)) for e in range(2)]]
        send = [counts[r][2 * d] + counts[r][2 * d + 1] for d in range(world)]
        recv = [counts[s][2 * r] + counts[s][2 * r + 1] for s in range(world)]
        assert sent == [(True, send, recv, D * 8)]


def test_exchange_by_hand_two_ranks():
    got = run_ranks(_exchange, 2, COUNTS[2], True, False)
    # rank 0 routes [0] to expert 0, [10, 11] to 1, [30, 31, 32] to 3 (on rank 1: x4)
    assert got[0][0] == [0.0, 20.0, 22.0, 120.0, 124.0, 128.0]
    # rank 1 routes [100, 101] to expert 0 (x1), [120] to expert 2 (x3), [130] to expert 3 (x4)
    assert got[1][0] == [100.0, 101.0, 360.0, 520.0]
    assert got[0][2] == [[3, 2]] and got[1][2] == [[1, 4]]           # rows per local expert


def test_exchange_over_a_subgroup():
    got = run_ranks(_exchange, 3, COUNTS[2], True, True)
    assert got[1] is None
    assert got[0][0] == [0.0, 20.0, 22.0, 120.0, 124.0, 128.0] and got[2][0] == [100.0, 101.0, 360.0, 520.0]


def _direct_halves():
    """to_experts then from_experts without perm: the order is recomputed, the rows come back in place."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.tensor(COUNTS[world][rank])
    x = _sorted_rows(rank, counts.tolist())
    gec = torch.tensor([COUNTS[world][s][2 * rank + e] for s in range(world) for e in range(2)])
    x_local, perm = to_experts(x, counts, gec)
    back = from_experts(x_local * 2, counts, gec)
    back_perm = from_experts(x_local * 2, counts, gec, perm=perm)
    return x_local[:, 0].tolist(), perm.tolist(), torch.equal(back, 2 * x), torch.equal(back_perm, 2 * x)


def test_to_experts_orders_rows_by_local_expert_then_source():
    got = run_ranks(_direct_halves, 2)
    # rank 0's experts 0, 1 receive: from rank 0 [0] (e0), [10, 11] (e1); from rank 1 [100, 101] (e0)
    assert got[0][:2] == ([0.0, 100.0, 101.0, 10.0, 11.0], [0, 3, 4, 1, 2])
    # rank 1's experts 2, 3 receive: from rank 0 [30, 31, 32] (e3); from rank 1 [120] (e2), [130] (e3)
    assert got[1][:2] == ([120.0, 30.0, 31.0, 32.0, 130.0], [3, 0, 1, 2, 4])
    assert all(g[2] and g[3] for g in got)


def _run_replaced():
    rank = dist.get_rank()
    layer = Tagger(1)
    x = torch.full((2, D), rank + 1.0)
    counts = torch.tensor([1, 1])
    y = exchange_and_run(layer, x, counts, run=lambda rows, c: rows * 0 - c.sum())
    return y[:, 0].tolist(), layer.calls


def test_run_replaces_the_layers_experts():
    # each rank's one expert receives 2 rows (1 from each rank): -2 everywhere; layer.run_experts never ran
    assert run_ranks(_run_replaced, 2) == [([-2.0, -2.0], [])] * 2


def _bad_counts():
    layer = Tagger(2)
    x = torch.zeros(3, D)
    return [caught(lambda: exchange_and_run(layer, x, torch.tensor([1, 1, 1, 1]), check=False)),
            caught(lambda: exchange_and_run(layer, x, torch.tensor([1, 1, 1]), check=False)),
            caught(lambda: exchange_and_run(layer, x, torch.tensor([1, 1, 1, 1])))]


def test_counts_that_do_not_fit_the_rows_are_refused():
    want = ("ValueError", "local_expert_count must have world_size*num_expert=4 entries summing to the 3 rows of "
                          "x_sorted; got [1, 1, 1, 1]")
    got = run_ranks(_bad_counts, 2)
    for r in got:
        assert r[0] == want and r[2] == want
        assert r[1] == ("ValueError", "local_expert_count must have world_size*num_expert=4 entries summing to the 3 "
                                      "rows of x_sorted; got [1, 1, 1]")




# ---- the agreement check ----------------------------------------------------------------------------------------
def _disagree(case):
    rank = dist.get_rank()
    layer = Tagger(2 if case == "num_expert" and rank == 1 else 1, lid=5 if case == "layer id" and rank == 1 else 0)
    x = torch.zeros(2, D + 2 if case == "d_model" and rank == 1 else D,
                    dtype=torch.float64 if case == "dtype" and rank == 0 else torch.float32)
    counts = torch.tensor([1, 1, 0] if case == "counts length" and rank == 0 else [1, 1])
    if case == "call number" and rank == 1:
        layer_call_twice(layer)
    if case == "check tag" and rank == 1:
        return caught(lambda: gather_rows([0] * 9, x, None, check_length=False).shape)
    if case == "grad enabled" and rank == 1:
        with torch.no_grad():
            return caught(lambda: check_agreement(layer, x, counts))
    return caught(lambda: check_agreement(layer, x, counts))


def layer_call_twice(layer):
    from labutils.moe import expert_parallel
    expert_parallel._next_call(layer)                                # as if it had run this layer once already


HEAD = "expert-parallel ranks disagree before the all-to-all (rank {} speaking):\n  "
SKIP = "\n(a rank skipped or repeated an MoE layer: every rank must call every layer, even with 0 tokens)"


@pytest.mark.parametrize("case, line, hint", [
    ("num_expert", "num_expert: rank 0=1, rank 1=2", ""),
    ("d_model", f"d_model: rank 0={D}, rank 1={D + 2}", ""),
    ("layer id", "layer id: rank 0=0, rank 1=5", SKIP),
    ("call number", "call number of this layer: rank 0=0, rank 1=1", SKIP),
    ("dtype", "dtype: rank 0=torch.float64, rank 1=torch.float32", ""),
    ("grad enabled", "grad enabled: rank 0=1, rank 1=0", ""),
    ("counts length", "counts length: rank 0=3, rank 1=2", ""),
])
def test_ranks_that_disagree_are_named_field_by_field(case, line, hint):
    got = run_ranks(_disagree, 2, case)
    for rank, (kind, text) in enumerate(got):
        assert (kind, text) == ("ExpertParallelMismatch", HEAD.format(rank) + line + hint), (case, rank)


def test_a_rank_in_another_collective_is_named():
    got = run_ranks(_disagree, 2, "check tag")
    assert got[1] == ("ok", torch.Size([2, 9]))
    kind, text = got[0]
    assert kind == "ExpertParallelMismatch" and text.startswith(HEAD.format(0) + "check tag: rank 0=7171941, rank "
                                                                               "1=0\n"), text
    assert text.endswith("\n(a rank is in a different collective: it skipped the MoE layer or called something "
                         "else)"), text
    assert issubclass(ExpertParallelMismatch, RuntimeError)


def _several_fields():
    rank = dist.get_rank()
    layer = Tagger(1 + rank, lid=rank)
    return caught(lambda: check_agreement(layer, torch.zeros(1, D + rank), torch.tensor([1] * (2 + 2 * rank))))


def test_several_fields_at_once_one_line_each():
    kind, text = run_ranks(_several_fields, 2)[1]
    assert (kind, text) == ("ExpertParallelMismatch", HEAD.format(1) + "num_expert: rank 0=1, rank 1=2\n  d_model: "
                                                      f"rank 0={D}, rank 1={D + 1}\n  layer id: rank 0=0, rank 1=1\n  "
                                                      "counts length: rank 0=2, rank 1=4" + SKIP)


def _agreeing_calls():
    layer = Tagger(1)
    x, counts = torch.zeros(1, D), torch.tensor([1, 0])
    return [caught(lambda: check_agreement(layer, x, counts)) for _ in range(3)]


def test_agreeing_ranks_pass_call_after_call():
    assert run_ranks(_agreeing_calls, 2) == [[("ok", None)] * 3] * 2


# ---- layer ids, local order, shard_state: no ranks -------------------------------------------------------------
def test_assign_layer_ids_and_first_call_ids():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = FMoE(2, D, top_k=1, expert=lambda d: nn.Linear(d, d))
            self.plain = nn.Linear(D, D)
            self.b = nn.Sequential(FMoE(2, D, top_k=1, expert=lambda d: nn.Linear(d, d)))

    h = Holder()
    assert assign_layer_ids(h) == 2
    assert (h.a.layer_id, h.b[0].layer_id, hasattr(h.plain, "layer_id")) == (0, 1, False)
    assert layer_id(h.b[0]) == 1
    lone, other = Tagger(1, lid=None), Tagger(1, lid=None)
    first = layer_id(lone)
    assert first >= 1_000_000 and layer_id(lone) == first and layer_id(other) > first
    lone.layer_id = "7"
    assert layer_id(lone) == 7


def test_local_order_makes_each_local_expert_contiguous():
    global_expert_count = torch.tensor([2, 1, 0, 3, 1, 1])             # 3 source ranks x 2 local experts
    perm = local_order(global_expert_count, num_expert=2)
    # received rows: (src 0, e0) x2 = rows 0, 1; (0, e1) row 2; (1, e1) rows 3-5; (2, e0) row 6; (2, e1) row 7
    assert perm.tolist() == [0, 1, 6, 2, 3, 4, 5, 7]
    assert local_order(torch.tensor([0, 0]), 1).tolist() == []
    assert local_order(torch.tensor([2, 1], dtype=torch.int32), 1).dtype == torch.int64


def test_shard_state_slices_fused_and_renumbers_lists():
    state = {"gate.gate.weight": torch.ones(4, 3), "experts.htoh4.weight": torch.arange(4.).view(4, 1),
             "experts.2.weight": torch.full((1,), 2.0), "experts.3.weight": torch.full((1,), 3.0),
             "experts.0.weight": torch.zeros(1), "blocks.0.experts.1.bias": torch.ones(1),
             "blocks.0.experts.2.bias": torch.full((1,), 5.0), "experts": torch.arange(6.)}
    got = shard_state(state, rank=1, num_expert=2)
    assert got["experts.htoh4.weight"].view(-1).tolist() == [2.0, 3.0]
    assert got["experts.0.weight"].item() == 2.0 and got["experts.1.weight"].item() == 3.0
    assert "experts.2.weight" not in got and got["gate.gate.weight"] is state["gate.gate.weight"]
    assert got["blocks.0.experts.0.bias"].item() == 5.0 and "blocks.0.experts.1.bias" not in got
    assert got["experts"].tolist() == [2.0, 3.0]                     # a bare fused tensor named "experts"
    assert sorted(shard_state(state, rank=0, num_expert=2)) == [
        "blocks.0.experts.1.bias", "experts", "experts.0.weight", "experts.htoh4.weight", "gate.gate.weight"]


# ---- FMoE with world_size > 1 -------------------------------------------------------------------------------------
def _weights(tot, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"wg": torch.randn(tot, D, generator=g, dtype=torch.float64),
            "bg": torch.randn(tot, generator=g, dtype=torch.float64),
            "we": torch.randn(tot, D, D, generator=g, dtype=torch.float64) / 2,
            "be": torch.randn(tot, D, generator=g, dtype=torch.float64)}


def _plain_moe(x, w, k):
    """One process, every expert, token by token: softmax over the top-k gate logits times each expert's x W^T + b."""
    rows = []
    for t in range(x.shape[0]):
        vals, idx = torch.topk(x[t] @ w["wg"].T + w["bg"], k)
        score = torch.softmax(vals, -1)
        rows.append(sum(score[j] * (x[t] @ w["we"][idx[j]].T + w["be"][idx[j]]) for j in range(k)))
    return torch.stack(rows) if rows else x[:0] * 1.0


def _fmoe_rank(w, xs, ne, k, subgroup):
    rank = dist.get_rank()
    group, world = None, dist.get_world_size()
    if subgroup:
        group = dist.new_group([0, 2])
        if rank == 1:
            return None
        rank, world = dist.get_rank(group), 2
    layer = FMoE(ne, D, world_size=world, moe_group=group, top_k=k, expert=lambda d: nn.Linear(d, d)).double()
    assign_layer_ids(layer)
    with torch.no_grad():
        layer.gate.gate.weight.copy_(w["wg"])
        layer.gate.gate.bias.copy_(w["bg"])
        for i, e in enumerate(layer.experts):
            e.weight.copy_(w["we"][rank * ne + i])
            e.bias.copy_(w["be"][rank * ne + i])
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    (y * (rank + 1)).sum().backward()
    grads = {"we": torch.stack([e.weight.grad for e in layer.experts]),
             "be": torch.stack([e.bias.grad for e in layer.experts]),
             "wg": layer.gate.gate.weight.grad, "bg": layer.gate.gate.bias.grad}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("world, ne, k, tokens", [(2, 2, 2, [3, 2]), (3, 1, 2, [3, 0, 4]), (2, 1, 1, [2, 3])])
def test_fmoe_across_ranks_equals_a_plain_loop_outputs_and_gradients(world, ne, k, tokens):
    w = _weights(world * ne)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in tokens]
    got = run_ranks(_fmoe_rank, world, w, xs, ne, k, False)
    # reference: the sum of every rank's loss (rank r weighs its outputs by r + 1), every expert in one place
    ref = {n: t.clone().requires_grad_() for n, t in w.items()}
    leaves = [x.clone().requires_grad_() for x in xs]
    ys = [_plain_moe(x, ref, k) for x in leaves]
    sum((y * (r + 1)).sum() for r, y in enumerate(ys)).backward()
    close = dict(atol=1e-10, rtol=1e-10)
    for r in range(world):
        y, x_grad, grads = got[r]
        assert_close(y, ys[r].detach(), **close)
        assert_close(x_grad, leaves[r].grad, **close)
        # my experts get the gradient of every rank's tokens routed to them
        assert_close(grads["we"], ref["we"].grad[r * ne:(r + 1) * ne], **close)
        assert_close(grads["be"], ref["be"].grad[r * ne:(r + 1) * ne], **close)
    # the gate is replicated: each rank's gate gradient is that of its own tokens; they add up to the whole
    for name in ("wg", "bg"):
        assert_close(sum(got[r][2][name] for r in range(world)), ref[name].grad, **close)


def test_fmoe_over_a_moe_group():
    w = _weights(2)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in (3, 2)]
    got = run_ranks(_fmoe_rank, 3, w, xs, 1, 2, True)
    assert got[1] is None
    for me, rank in enumerate((0, 2)):
        assert_close(got[rank][0], _plain_moe(xs[me], w, 2), atol=1e-10, rtol=1e-10)


def _fmoe_world_size_check():
    return caught(lambda: FMoE(1, D, world_size=3, expert=lambda d: nn.Linear(d, d)))




def _fused_parity(full_state, xs, kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    mask = mask_dict = None
    if kind == "mask":
        mask = torch.tensor([0, 1, 0, 2, 0, 0][:xs[rank].shape[0]])
        mask_dict = {1: torch.ones(D), 2: torch.full((2, D), 3.0)}
    part = FMoETransformerMLP(2, D, 6, top_k=2, world_size=world, mask=mask, mask_dict=mask_dict)
    assign_layer_ids(part)
    part.load_state_dict(shard_state(full_state, rank, 2))
    x = xs[rank].clone().requires_grad_()
    y = part(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in part.named_parameters()}


@pytest.mark.parametrize("kind", ["plain", "mask"])
@pytest.mark.parametrize("world", [2, 3])
def test_fused_experts_across_ranks_equal_the_local_layer(world, kind):
    torch.manual_seed(0)
    mask = mask_dict = None
    tokens = [4, 5, 6][:world]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, D, generator=g) for n in tokens]
    full = FMoETransformerMLP(2 * world, D, 6, top_k=2)
    got = run_ranks(_fused_parity, world, full.state_dict(), xs, kind)
    full_grads = {n: torch.zeros_like(p) for n, p in full.named_parameters()}
    for r in range(world):
        if kind == "mask":
            mask = torch.tensor([0, 1, 0, 2, 0, 0][:tokens[r]])
            mask_dict = {1: torch.ones(D), 2: torch.full((2, D), 3.0)}
        local = FMoETransformerMLP(2 * world, D, 6, top_k=2, mask=mask, mask_dict=mask_dict)
        local.load_state_dict(full.state_dict())
        x = xs[r].clone().requires_grad_()
        y = local(x)
        y.pow(2).sum().backward()
        assert_close(got[r][0], y.detach(), atol=1e-5, rtol=1e-5)
        assert_close(got[r][1], x.grad, atol=1e-5, rtol=1e-5)
        for n, p in local.named_parameters():
            full_grads[n] += p.grad
        gate = {n: gr for n, gr in got[r][2].items() if "experts" not in n}
        assert all(torch.allclose(gate[n], p.grad, atol=1e-5) for n, p in local.named_parameters() if n in gate)
    for r in range(world):
        want = shard_state(full_grads, r, 2)
        for n, gr in got[r][2].items():
            if "experts" in n:
                assert_close(gr, want[n], atol=1e-5, rtol=1e-5)


def _slices(full_state, x, ep):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    layer = FMoETransformerMLP(2, D, 6, top_k=2, world_size=world if ep else 1, slice_group=group)
    assign_layer_ids(layer)
    layer.load_state_dict(shard_state(full_state, rank, 2) if ep else full_state)
    xx = x.clone().requires_grad_()
    y = layer(xx)
    y.pow(2).sum().backward()
    return y.detach(), xx.grad, (layer.slice_size, layer.slice_rank, layer.slice_group is group)


@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_slice_group_ranks_share_a_batch_and_each_runs_its_slice(world, ep):
    torch.manual_seed(0)
    full = FMoETransformerMLP(2 * (world if ep else 1), D, 6, top_k=2)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(4))
    got = run_ranks(_slices, world, full.state_dict(), x, ep)
    xx = x.clone().requires_grad_()
    y = full(xx)
    y.pow(2).sum().backward()
    for r in range(world):
        assert_close(got[r][0], y.detach(), atol=1e-5, rtol=1e-5)
        # each rank's loss is the whole batch's: the slice's gradient, gathered, is the whole input's
        assert_close(got[r][1], xx.grad, atol=1e-5, rtol=1e-5)
        assert got[r][2] == (world, r, True)


class _TwoIn(_Expert):
    """Experts that take a dict of two inputs (fastmoe's MIMO test)."""

    def forward(self, inp, fwd_expert_count):
        return {k: super(_TwoIn, self).forward(v, fwd_expert_count) for k, v in inp.items()}


class _GateX(NaiveGate):
    def forward(self, inp, return_all_scores=False):
        return super().forward(inp["x"], return_all_scores)


def _mimo(ne, ws):
    m = FMoE(num_expert=ne, d_model=D, world_size=ws, gate=_GateX, top_k=2)
    m.experts = _TwoIn(ne, D, 6, F.gelu)
    return m


def _nested(full_state, inputs):
    rank, world = dist.get_rank(), dist.get_world_size()
    part = _mimo(2, world)
    assign_layer_ids(part)
    part.load_state_dict(shard_state(full_state, rank, 2))
    return part(inputs[rank])


def test_nested_inputs_across_ranks_equal_the_local_layer():
    torch.manual_seed(0)
    full = _mimo(4, 1)
    g = torch.Generator().manual_seed(10)
    inputs = [{"x": torch.randn(3 + r, D, generator=g), "y": torch.randn(3 + r, D, generator=g)} for r in range(2)]
    got = run_ranks(_nested, 2, full.state_dict(), inputs)
    for r in range(2):
        want = full(inputs[r])
        assert sorted(got[r]) == ["x", "y"]
        for key in ("x", "y"):
            assert_close(got[r][key], want[key], atol=1e-5, rtol=1e-5)


# ---- more of the exchange's contract ------------------------------------------------------------------------------
def test_local_order_keeps_each_sources_rows_in_order_in_big_blocks():
    counts = [40, 30, 20, 50]                                          # 2 sources x 2 local experts, 140 rows
    tags = [(src, e, j) for src in range(2) for e in range(2) for j in range(counts[2 * src + e])]
    perm = local_order(torch.tensor(counts), num_expert=2)
    assert [tags[i] for i in perm.tolist()] == sorted(tags, key=lambda t: (t[1], t[0]))   # stable: j ascending


def test_layer_id_of_a_layer_without_the_attribute():
    class Bare:
        num_expert = 1

    bare = Bare()
    first = layer_id(bare)
    assert first >= 1_000_000 and layer_id(bare) == first


def test_shard_state_renumbers_bare_list_entries():
    state = {"experts.0": torch.zeros(1), "experts.3": torch.full((1,), 3.0), "moe.experts.2": torch.full((1,), 2.0)}
    assert {k: v.item() for k, v in shard_state(state, rank=1, num_expert=2).items()} == {"experts.1": 3.0,
                                                                                          "moe.experts.0": 2.0}


COLLECTIVES = ("all_gather", "all_to_all_single", "all_gather_object", "all_reduce", "broadcast", "barrier",
               "all_gather_into_tensor", "all_to_all", "reduce_scatter", "gather", "scatter")


def _count(monkeypatch):
    """Every torch.distributed collective rank 0 calls, as (name, elements it sends), in order."""
    calls = []
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            if dist.get_rank() == 0:
                sent = args[1] if _name in ("all_gather", "all_to_all_single") else None
                calls.append((_name, sent.numel() if torch.is_tensor(sent) else None))
            return _real(*args, **kwargs)
        monkeypatch.setattr(dist, name, wrapper)
    return calls


def _exchange_calls(check, ne=1, backward=False):
    rank = dist.get_rank()
    layer = Tagger(ne)
    x = torch.full((2, D), rank + 1.0, requires_grad=backward)
    counts = torch.zeros(2 * ne, dtype=torch.long)
    counts[[0, ne]] = 1                                                # one row to each rank's first expert
    kwargs = {} if check is None else {"check": check}
    y = exchange_and_run(layer, x, counts, **kwargs)
    if backward:
        y.sum().backward()
    return y[:, 0].tolist()


CHECKED = ("all_to_all_single", 2 * (9 + COUNT_SLOTS))                # fingerprint + counts to each of 2 ranks
ROWS = ("all_to_all_single", 2 * D)                                    # one row of D to each rank


@pytest.mark.parametrize("check, want", [
    (None, [CHECKED, ROWS, ROWS]),                                     # checked by default: the check rides along
    (True, [CHECKED, ROWS, ROWS]),
    (False, [("all_to_all_single", 2), ROWS, ROWS]),                   # the bare counts (W*E), rows, back
])
def test_the_exchange_costs_three_all_to_alls_checked_or_not(monkeypatch, check, want):
    calls = _count(monkeypatch)
    # rank r's row for expert g comes back times g + 1
    assert run_ranks(_exchange_calls, 2, check) == [[1.0, 2.0], [2.0, 4.0]]
    assert calls == want


def test_the_backward_costs_two_all_to_alls(monkeypatch):
    calls = _count(monkeypatch)
    run_ranks(_exchange_calls, 2, True, 1, True)
    assert calls == [CHECKED, ROWS, ROWS, ROWS, ROWS]


def test_more_experts_than_count_slots_send_the_counts_after_the_check(monkeypatch):
    calls = _count(monkeypatch)
    ne = COUNT_SLOTS + 1                                               # expert 0 of rank r multiplies by r*ne + 1
    assert run_ranks(_exchange_calls, 2, True, ne) == [[1.0, ne + 1.0], [2.0, 2.0 * (ne + 1)]]
    assert calls == [CHECKED, ("all_to_all_single", 2 * ne), ROWS, ROWS]


def _separate_check_then_counts():
    """The exchange as it was: check_agreement's all_gather, then the counts (what the counter must tell apart)."""
    from labutils.moe.capacity import exchange_counts

    layer = Tagger(1)
    x, counts = torch.zeros(2, D), torch.tensor([1, 1])
    check_agreement(layer, x, counts)
    return exchange_counts(counts, 2).tolist()


def test_the_counter_sees_a_separate_agreement_gather(monkeypatch):
    """Negative control of the counts above: the old two-collective check is seen as two collectives."""
    calls = _count(monkeypatch)
    assert run_ranks(_separate_check_then_counts, 2) == [[1, 1]] * 2
    assert calls == [("all_gather", 9), ("all_to_all_single", 2)]


def _disagree_in_the_exchange(case):
    rank = dist.get_rank()
    ne = 2 if case == "num_expert" and rank == 1 else 1
    layer = Tagger(ne, lid=5 if case == "layer id" and rank == 1 else 0)
    if case == "big":                                                  # too many experts for the slots on rank 1
        ne = COUNT_SLOTS + 1 if rank == 1 else 1
        layer = Tagger(ne)
    counts = torch.zeros(2 * ne, dtype=torch.long)
    counts[0] = 2
    if case == "counts length" and rank == 0:
        counts = torch.tensor([2, 0, 0])
    return caught(lambda: exchange_and_run(layer, torch.zeros(2, D), counts))


@pytest.mark.parametrize("case, line, hint", [
    ("num_expert", "num_expert: rank 0=1, rank 1=2\n  counts length: rank 0=2, rank 1=4", ""),
    ("big", f"num_expert: rank 0=1, rank 1={COUNT_SLOTS + 1}\n  counts length: rank 0=2, rank 1={2 * COUNT_SLOTS + 2}",
     ""),
    ("layer id", "layer id: rank 0=0, rank 1=5", SKIP),
    ("counts length", "counts length: rank 0=3, rank 1=2", ""),
])
def test_the_exchange_raises_the_checks_messages_on_every_rank(case, line, hint):
    """The check that rides on the counts says what check_agreement says, on every rank, before any row moves
    (ranks whose counts would not fit each other's all_to_all included)."""
    for rank, got in enumerate(run_ranks(_disagree_in_the_exchange, 2, case)):
        assert got == ("ExpertParallelMismatch", HEAD.format(rank) + line + hint), (case, rank)


def _layer_without_a_group():
    class NoGroup:
        num_expert, layer_id = 1, 0

        def run_experts(self, x, counts):
            return x * 2

    return exchange_and_run(NoGroup(), torch.ones(2, D), torch.tensor([1, 1]))[:, 0].tolist()


def test_a_layer_without_moe_group_uses_every_rank():
    assert run_ranks(_layer_without_a_group, 2) == [[2.0, 2.0]] * 2


def _disagree_in_a_group():
    sub = dist.new_group([0, 2])
    rank = dist.get_rank()
    if rank == 1:
        return None
    layer = Tagger(1 + (rank == 2), group=sub)
    return caught(lambda: check_agreement(layer, torch.zeros(1, D), torch.tensor([1, 1]), sub))


def test_the_speaking_rank_is_its_rank_in_the_group():
    got = run_ranks(_disagree_in_a_group, 3)
    assert got[2] == ("ExpertParallelMismatch", HEAD.format(1) + "num_expert: rank 0=1, rank 1=2")
    assert got[0] == ("ExpertParallelMismatch", HEAD.format(0) + "num_expert: rank 0=1, rank 1=2")


# ---- slice groups that are not the whole world ------------------------------------------------------------------
def _pairs(full_state, xs, ep, alias, masked):
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    mask = mask_dict = None
    if masked:
        mask, mask_dict = torch.tensor([0, 1, 0, 2, 0]), {1: torch.ones(D), 2: torch.full((2, D), 3.0)}
    kw = {"mp_group" if alias else "slice_group": pair}
    layer = FMoETransformerMLP(2, D, 6, top_k=2, world_size=world if ep else 1, mask=mask, mask_dict=mask_dict, **kw)
    assign_layer_ids(layer)
    layer.load_state_dict(shard_state(full_state, rank, 2) if ep else full_state)
    x = xs[rank // 2].clone().requires_grad_()                        # the pair's shared batch
    y = layer(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, (layer.slice_size, layer.slice_rank)


@pytest.mark.parametrize("ep, alias, masked", [(True, False, False), (False, True, False), (False, False, True),
                                               (True, False, True)])
def test_slice_groups_of_two_in_four_ranks(ep, alias, masked):
    torch.manual_seed(0)
    mask = mask_dict = None
    if masked:
        mask, mask_dict = torch.tensor([0, 1, 0, 2, 0]), {1: torch.ones(D), 2: torch.full((2, D), 3.0)}
    full = FMoETransformerMLP(2 * (4 if ep else 1), D, 6, top_k=2, mask=mask, mask_dict=mask_dict)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(5, D, generator=g) for _ in range(2)]           # one batch per pair
    got = run_ranks(_pairs, 4, full.state_dict(), xs, ep, alias, masked)
    for rank in range(4):
        x = xs[rank // 2].clone().requires_grad_()
        y = full(x)
        y.pow(2).sum().backward()
        assert_close(got[rank][0], y.detach())
        assert_close(got[rank][1], x.grad)                             # each pair's loss is its whole batch's
        assert got[rank][2] == (2, rank % 2)                            # size and rank within the pair


