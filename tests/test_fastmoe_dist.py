"""labutils.moe as a drop-in for fastmoe on CPU (issue 14), on 2 and 4 gloo workers.

Each worker compares the distributed result with a brute-force or single-process reference computed on the
same rank (fastmoe's tests/test_ddp.py + test_numerical.py are the specification; the code is ours).
"""
from __future__ import annotations

import pytest

from labutils.launcher import launch

D, H, E = 8, 16, 2


def _max_diff(a, b) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------------------------------- slice_group
def _slice_worker(mp_size: int, ep: bool, rows: int, one_rank_groups: bool = False, alias: bool = False):
    """Ranks ``[j*mp_size, (j+1)*mp_size)`` share a batch (slice group); experts over all ranks when ``ep``."""
    import torch
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP
    from labutils.moe.expert_parallel import shard_state

    rank, world = dist.get_rank(), dist.get_world_size()
    size = 1 if one_rank_groups else mp_size
    groups = [dist.new_group(list(range(j * size, (j + 1) * size))) for j in range(world // size)]
    group = groups[rank // size]
    ew = world if ep else 1
    torch.manual_seed(0)
    full = FMoETransformerMLP(E * ew, D, H, top_k=2)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.manual_seed(100 + rank // size)                                  # the slice group's shared batch
    x = torch.randn(rows, D)
    x_ref, x_moe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = full(x_ref)
    y_ref.mean().backward()

    kw = {"mp_group" if alias else "slice_group": group}
    moe = FMoETransformerMLP(E, D, H, top_k=2, world_size=ew, **kw)
    moe.load_state_dict(shard_state(full.state_dict(), rank, E) if ep else full.state_dict())
    y = moe(x_moe)
    y.mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    if ep:                                                               # fastmoe's expectation: sum over all
        for g in ref_grads.values():                                     # ranks, / mp_size, my experts' rows
            dist.all_reduce(g)
            g /= size
        ref_grads = shard_state(ref_grads, rank, E)
    diffs = {"output": _max_diff(y, y_ref), "input grad": _max_diff(x_moe.grad, x_ref.grad)}
    for n, p in moe.named_parameters():
        g = p.grad.clone()
        if not ep or "experts" not in n:                                 # a slice's share: sum over the group
            dist.all_reduce(g, group=group)
            if ep:                                                       # the gate: every group's, as ref_grads
                dist.all_reduce(g, group=None)                           # (each group counted size times)
                g /= size
        diffs[n] = _max_diff(g, ref_grads[n])
    return diffs, moe.slice_size


def _slice_cases(cases):
    return [_slice_worker(*case) for case in cases]                      # one launch for several cases


SLICE_CASES = {
    2: [(2, False, 7),               # replicated experts, an odd batch split 4 + 3
        (2, False, 6, False, True),  # mp_group: fastmoe's older name
        (2, True, 6),                # slices, then the expert-parallel exchange
        (2, False, 5, True)],        # a one-rank group: no slicing at all
    4: [(2, True, 4)],               # fastmoe's test_ddp layout: mp pairs, experts over 4 ranks
}


@pytest.mark.parametrize("world", [2, 4])
def test_slice_group_equals_the_unsliced_layer(world):
    cases = SLICE_CASES[world]
    for rank, results in enumerate(launch(_slice_cases, world, cases, timeout=120)):
        for case, (diffs, slice_size) in zip(cases, results):
            one_rank = len(case) > 3 and case[3]
            assert slice_size == (1 if one_rank else case[0]), case
            bad = {k: v for k, v in diffs.items() if v > 1e-5}
            assert not bad, f"rank {rank}, case {case}: {bad}"


# ---------------------------------------------------------------------------------------- functional API
def _functional_worker(cap: int):
    import torch
    import torch.distributed as dist

    from labutils.moe.fastmoe.api import (
        _fmoe_general_global_forward,
        count_by_gate,
        ensure_comm,
        limit_by_capacity,
        prepare_forward,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    ensure_comm(torch.zeros(1), None)
    tot = E * world
    torch.manual_seed(0)
    W = torch.randn(tot, D, D)                                           # every global expert, on every rank
    torch.manual_seed(10 + rank)
    T, k = 5 + 3 * rank, 2                                               # ranks hold different batch sizes
    gate = torch.randint(-1, tot, (T, k))
    inp = torch.randn(T, D, requires_grad=True)
    all_gates = [torch.empty(0)] * world
    dist.all_gather_object(all_gates, gate)
    out = {}

    _, lec, gec = count_by_gate(gate, E, world)
    all_lec = [torch.bincount(g[g >= 0], minlength=tot) for g in all_gates]
    out["lec"] = torch.equal(lec, all_lec[rank])
    out["gec"] = torch.equal(gec, torch.cat([all_lec[w][rank * E:(rank + 1) * E] for w in range(world)]))
    _, _, _, fec, fbs = prepare_forward(gate, E, world)
    out["fec"] = fec.tolist() == [sum(int((g == rank * E + e).sum()) for g in all_gates) for e in range(E)]

    w_local = W[rank * E:(rank + 1) * E].clone().requires_grad_()

    def expert_fn(x, counts):
        return torch.cat([p @ w_local[e].T for e, p in enumerate(x.split(counts.tolist()))])

    y = _fmoe_general_global_forward(inp, gate, expert_fn, E, world)     # (T*k, D)
    w_ref = W.clone().requires_grad_()
    inp_ref = inp.detach().clone().requires_grad_()
    y_ref = torch.stack([w_ref[e] @ inp_ref[i // k] if e >= 0 else inp_ref.new_zeros(D)
                         for i, e in enumerate(gate.reshape(-1).tolist())])
    (y ** 2).sum().backward()
    (y_ref ** 2).sum().backward()
    dist.all_reduce(w_ref.grad)                                          # every rank's tokens reach my experts
    close = dict(rtol=1e-5, atol=1e-5)                                   # values reach ~100: relative tolerance
    out["output"] = torch.allclose(y, y_ref, **close)
    out["input grad"] = torch.allclose(inp.grad, inp_ref.grad, **close)
    out["expert grad"] = torch.allclose(w_local.grad, w_ref.grad[rank * E:(rank + 1) * E], **close)

    new_lec, new_gec, new_idx = limit_by_capacity(gate, E, world, cap)
    granted = torch.zeros(world, tot, dtype=torch.long)                  # loop: expert grants in rank order
    for g in range(tot):
        left = cap
        for w in range(world):
            granted[w, g] = min(int((all_gates[w] == g).sum()), left)
            left -= int(granted[w, g])
    want, used = gate.clone(), [0] * tot                                 # my granted ones: 1st choices first
    for j in range(k):
        for t in range(T):
            e = int(want[t, j])
            if e >= 0:
                if used[e] < granted[rank, e]:
                    used[e] += 1
                else:
                    want[t, j] = -1
    out["limit idx"] = torch.equal(new_idx, want)
    out["limit lec"] = torch.equal(new_lec, granted[rank])
    out["limit gec"] = torch.equal(new_gec, granted[:, rank * E:(rank + 1) * E].reshape(-1))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_functional_api_across_ranks_matches_loops(world):
    for rank, out in enumerate(launch(_functional_worker, world, 2, timeout=120)):
        assert all(out.values()), f"rank {rank}: {out}"


# ---------------------------------------------------------------------------------------- trees and masks
def _tree_mask_worker():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from labutils.moe import FMoE, FMoETransformerMLP, NaiveGate
    from labutils.moe.expert_parallel import shard_state
    from labutils.moe.transformer import _Expert

    rank, world = dist.get_rank(), dist.get_world_size()

    class TwoIn(_Expert):
        def forward(self, inp, fwd_expert_count):
            return {k: super(TwoIn, self).forward(v, fwd_expert_count) for k, v in inp.items()}

    class GateX(NaiveGate):
        def forward(self, inp, return_all_scores=False):
            return super().forward(inp["x"], return_all_scores)

    def mimo(ne, ws):
        m = FMoE(num_expert=ne, d_model=D, world_size=ws, gate=GateX, top_k=2)
        m.experts = TwoIn(ne, D, H, F.gelu)
        return m

    out = {}
    torch.manual_seed(0)
    full = mimo(E * world, 1)
    part = mimo(E, world)
    part.load_state_dict(shard_state(full.state_dict(), rank, E))
    torch.manual_seed(1 + rank)
    inp = {"x": torch.randn(3 + rank, D), "y": torch.randn(3 + rank, D)}
    got, want = part(inp), full(inp)
    out["mimo"] = max(_max_diff(got[k], want[k]) for k in inp)

    mask = torch.tensor([0, 1, 0, 2, 0, 0][:4 + rank])
    mask_dict = {1: torch.ones(D), 2: torch.full((2, D), 3.0)}          # (d,) or (k, d) values
    torch.manual_seed(0)
    full = FMoETransformerMLP(E * world, D, H, mask=mask, mask_dict=mask_dict)
    part = FMoETransformerMLP(E, D, H, world_size=world, mask=mask, mask_dict=mask_dict)
    part.load_state_dict(shard_state(full.state_dict(), rank, E))
    x = torch.randn(4 + rank, D)
    out["mask"] = _max_diff(part(x), full(x))
    return out


def test_nested_inputs_and_mask_with_expert_parallelism():
    for rank, out in enumerate(launch(_tree_mask_worker, 2, timeout=120)):
        assert max(out.values()) < 1e-5, f"rank {rank}: {out}"


# ------------------------------------------------------------------------------- DistributedGroupedDataParallel
def _dgdp_worker():
    import torch
    import torch.distributed as dist
    from torch import nn

    from labutils.data_parallel import DistributedGroupedDataParallel
    from labutils.moe import FMoETransformerMLP
    from labutils.moe.expert_parallel import shard_state

    rank, world = dist.get_rank(), dist.get_world_size()

    class Net(nn.Module):
        def __init__(self, ne, ws):
            super().__init__()
            self.dense = nn.Linear(D, D)
            self.moe = FMoETransformerMLP(ne, D, H, world_size=ws, top_k=2)   # experts "none", gate "gate"

        def forward(self, x):
            return self.moe(torch.relu(self.dense(x)))

    torch.manual_seed(0)
    full = Net(E * world, 1)
    torch.manual_seed(50 + rank)                                         # ranks start different: sync fixes it
    net = Net(E, world)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    ddp = DistributedGroupedDataParallel(net)
    synced = {n: p.detach().clone() for n, p in net.named_parameters()}
    net.load_state_dict(shard_state(full.state_dict(), rank, E))
    xs = [torch.randn(6, D, generator=torch.Generator().manual_seed(7 + r)) for r in range(world)]
    ddp(xs[rank]).pow(2).mean().backward()
    ddp.allreduce_gradients()
    sum(full(x).pow(2).mean() for x in xs).backward()                   # the sum of every rank's loss
    ref = shard_state({n: p.grad for n, p in full.named_parameters()}, rank, E)
    diffs = {}
    for n, p in net.named_parameters():
        want = ref[n] if "experts" in n else ref[n] / world               # experts: summed; the rest: averaged
        diffs[n] = _max_diff(p.grad, want)
    gathered = [None] * world
    dist.all_gather_object(gathered, {n: v for n, v in synced.items()})
    same = {n: all(torch.equal(g[n], synced[n]) for g in gathered) for n in synced}
    return diffs, same, {n: torch.equal(before[n], synced[n]) for n in before}


def _mp_tag_worker():
    """fastmoe's _test_fmoe_local_ddp: tags "mp", "dp", "world" with mp pairs and dp groups; no "mp" group."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from labutils.data_parallel import DistributedGroupedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    mp = [dist.new_group([2 * j, 2 * j + 1]) for j in range(world // 2)][rank // 2]
    dp = [dist.new_group(list(range(j, world, 2))) for j in range(2)][rank % 2]
    out = {}
    for with_mp in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        for layer, tag in zip(model[::2], ("mp", "dp", "world")):
            for p in layer.parameters():
                p.dp_comm = tag
        kw = {"mp_group": mp} if with_mp else {}
        ddp = DistributedGroupedDataParallel(model, dp_group=dp, **kw)
        torch.manual_seed(42 + rank)
        ddp(torch.randn(4, D)).mean().backward()
        local = [model[i].weight.grad.clone() for i in (0, 2, 4)]
        want = [g.clone() for g in local]
        for g, group in zip(want, (mp if with_mp else None, dp, None)):
            if group is None and g is want[0]:
                continue                                                 # "mp" without mp_group: untouched
            dist.all_reduce(g, group=group)
            g /= dist.get_world_size(group)
        ddp.allreduce_params(reduce_after=False, fp32_allreduce=False)
        out[with_mp] = [_max_diff(model[i].weight.grad, w) for i, w in zip((0, 2, 4), want)]
    return out


def test_distributed_grouped_data_parallel_sums_experts_and_averages_the_rest():
    for rank, (diffs, same, unchanged) in enumerate(launch(_dgdp_worker, 2, timeout=120)):
        assert max(diffs.values()) < 1e-5, f"rank {rank}: {diffs}"
        for n, equal in same.items():                                    # sync: all but experts ("none")
            if "experts" not in n:
                assert equal, (rank, n)
            elif n.endswith("weight"):                                   # (expert biases start at 0 anyway)
                assert not equal, (rank, n)
            if rank == 0:
                assert unchanged[n], n


def test_distributed_grouped_data_parallel_mp_tag():
    for rank, out in enumerate(launch(_mp_tag_worker, 4, timeout=120)):    # mp pairs {0,1} {2,3}, dp {0,2} {1,3}
        assert max(out[True]) < 1e-6 and max(out[False]) < 1e-6, f"rank {rank}: {out}"
