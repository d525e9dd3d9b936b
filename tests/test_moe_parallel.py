"""Expert parallelism (labutils.moe.expert_parallel): W workers with E/W experts each == one process with E experts.

Also: traffic accounting (labutils.moe.traffic) and what happens when ranks disagree (clear error, never a hang).
"""
import pytest
import torch

from labutils.launcher import WorkerError, launch

D, H = 6, 8


def _build(kind, num_expert, world_size):
    """Two stacked MoE layers, so backward crosses two exchanges in reverse order."""
    from torch import nn

    from labutils.moe import FMoE, FMoETransformerMLP

    def layer():
        if kind == "fused":
            return FMoETransformerMLP(num_expert, D, H, top_k=2, world_size=world_size)
        return FMoE(num_expert, D, world_size=world_size, top_k=2, expert=lambda d: nn.Linear(d, d))
    return nn.Sequential(layer(), layer())


def _parity(kind, num_expert, batches, fault=None, relative=False):
    """Every rank: the sharded model on its own batch vs the full model on the global batch. ``fault`` switches
    on an expert-parallel gradient bug of issue 28 (the parity check must then fail). ``relative``: order-one
    weights (fastmoe's init makes the gate's gradient tiny) and differences divided by the largest entry."""
    import torch
    import torch.distributed as dist

    from labutils.moe.expert_parallel import shard_state
    from labutils.moe.traffic import record_traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = _build(kind, num_expert * world, 1)
    if relative:
        with torch.no_grad():
            for p in full.parameters():
                p.normal_(0, p.shape[-1] ** -0.5)
    x_all = torch.randn(sum(batches), D, requires_grad=True)
    y_full = full(x_all)
    (y_full ** 2).sum().backward()                       # the loss of the global batch

    part = _build(kind, num_expert, world)
    part.load_state_dict(shard_state(full.state_dict(), rank, num_expert))
    if fault == "expert grads x W":
        for n, p in part.named_parameters():
            if "experts" in n:
                p.register_hook(lambda g: g * world)
    lo, hi = sum(batches[:rank]), sum(batches[:rank + 1])
    x = x_all.detach()[lo:hi].clone().requires_grad_()
    with record_traffic(part) as log:
        y = part(x)
    (y ** 2).sum().backward()                            # my share of it; ranks' losses sum to the global one
    grads = {n: p.grad for n, p in part.named_parameters()}
    for n, _p in part.named_parameters():
        if "experts" not in n:                           # the gate is replicated: sum its gradient over ranks
            if fault != "router grad not reduced":
                dist.all_reduce(grads[n])
            if fault == "router grad reduced twice":
                dist.all_reduce(grads[n])
    want = shard_state({n: p.grad for n, p in full.named_parameters()}, rank, num_expert)
    def diff(a, b):                                      # a rank with no rows compares empty tensors: 0
        if not a.numel():
            return 0.0
        return (a - b).abs().amax().item() / (max(b.abs().amax().item(), 1e-30) if relative else 1.0)

    diffs = {"output": diff(y, y_full[lo:hi]), "input grad": diff(x.grad, x_all.grad[lo:hi])}
    diffs.update({n: diff(grads[n], want[n]) for n in want})

    dest = torch.div(full[0].gate(x_all[lo:hi])[0], num_expert, rounding_mode="floor")  # (T, k) rank of each choice
    expected_rows = torch.bincount(dest.reshape(-1), minlength=world).tolist()
    return diffs, [c["send_rows"] for c in log.calls], expected_rows, log.sent_bytes(rank)


@pytest.mark.parametrize("world,kind,num_expert,batches", [
    (2, "fused", 2, [5, 3]),
    (2, "list", 1, [4, 6]),
    (4, "fused", 1, [5, 1, 7, 3]),
    (4, "fused", 1, [3, 0, 2, 4]),                                  # a rank with no tokens (chapter 06)
])
def test_expert_parallel_equals_one_process(world, kind, num_expert, batches):
    # 4 ranks under DETAIL: PyTorch's cross-rank collective checks accept the uneven all-to-alls
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if world == 4 else None
    results = launch(_parity, world, kind, num_expert, batches, timeout=90, env=env)
    for rank, (diffs, sent, expected_rows, sent_bytes) in enumerate(results):
        bad = {k: v for k, v in diffs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: sharded experts differ from one process by more than 1e-5: {bad}"
        per_layer = (4 if kind == "fused" else 2) * num_expert + 2        # experts' tensors + the gate's two
        assert len(diffs) == 2 + 2 * per_layer, sorted(diffs)            # every parameter compared
        # the first layer's exchange sent exactly the rows its gate routed to each rank: no padding
        assert sent[0] == expected_rows, f"rank {rank}: sent {sent[0]}, routing says {expected_rows}"
        assert sent_bytes == sum(sum(s) - s[rank] for s in sent) * D * 4


def _zero_rows():
    """A rank with no tokens still takes part; its experts serve the others. Direct exchange_and_run call."""
    import torch
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP
    from labutils.moe.expert_parallel import exchange_and_run, shard_state

    rank, world, ne = dist.get_rank(), dist.get_world_size(), 2
    torch.manual_seed(1)
    full = FMoETransformerMLP(ne * world, D, H)
    part = FMoETransformerMLP(ne, D, H, world_size=world)
    part.load_state_dict(shard_state(full.state_dict(), rank, ne))
    counts = torch.tensor([[2, 0, 1, 3], [0, 0, 0, 0]][rank])          # rank 1 routes nothing
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    y = exchange_and_run(part, x, counts)
    y.pow(2).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = full.run_experts(x_ref, counts)                            # full layer: global ids are local ids
    y_ref.pow(2).sum().backward()
    return (tuple(y.shape), (y - y_ref).abs().max().item() if y.numel() else 0.0,
            (x.grad - x_ref.grad).abs().max().item() if x.numel() else 0.0,
            torch.cat([e.htoh4.weight.grad for e in part.experts]),
            torch.cat([e.htoh4.weight.grad for e in full.experts]))


def test_rank_with_zero_tokens():
    results = launch(_zero_rows, 2, timeout=60)
    assert results[1][0] == (0, D)
    for _shape, dy, dgrad, _, _ in results:
        assert dy <= 1e-6 and dgrad <= 1e-6, (dy, dgrad)
    # expert gradients: each rank's experts get the gradient of every rank's rows routed to them
    total = sum(r[4] for r in results)                                # (4, H, D) full-layer gradient, summed
    for rank, (_, _, _, g_part, _) in enumerate(results):
        torch.testing.assert_close(g_part, total[2 * rank: 2 * rank + 2], atol=1e-6, rtol=1e-5)
    assert results[1][3].abs().sum() > 0, "rank 1 routed nothing but its experts served rank 0"


# ---- ranks that disagree ------------------------------------------------------------------------------
def _disagree(case):
    import torch
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP
    from labutils.moe.expert_parallel import assign_layer_ids

    rank, world = dist.get_rank(), dist.get_world_size()
    ne = 2 if case == "num_expert" and rank == 1 else 1
    d = D + 2 if case == "d_model" and rank == 1 else D
    torch.manual_seed(0)
    model = torch.nn.Sequential(FMoETransformerMLP(ne, d, H, world_size=world, top_k=1),
                                FMoETransformerMLP(ne, d, H, world_size=world, top_k=1))
    assign_layer_ids(model)
    x = torch.randn(4, d)
    if rank == 1 and case == "skip_layer":
        return model[1](x)                       # skips layer 0, goes straight to layer 1
    if rank == 1 and case.startswith("skip_then_all_reduce"):
        dist.all_reduce(torch.ones(1))           # skips the MoE block, calls another collective
        return None
    return model(x).sum().backward()


CASES = {"num_expert": "num_expert: rank 0=1, rank 1=2", "d_model": f"d_model: rank 0={D}, rank 1={D + 2}",
         "skip_layer": "layer id: rank 0=0, rank 1=1"}


def _disagree_each():
    """Each case raises on every rank BEFORE any data moves, so the ranks can catch it and go on."""
    from labutils.moe.expert_parallel import ExpertParallelMismatch

    seen = {}
    for case in CASES:
        try:
            _disagree(case)
            seen[case] = "no error"
        except ExpertParallelMismatch as exc:
            seen[case] = str(exc)
    return seen


def test_disagreeing_ranks_raise_on_every_rank():
    for rank, seen in enumerate(launch(_disagree_each, 2, timeout=60)):
        for case, field in CASES.items():
            assert field in seen[case], f"rank {rank}, {case}: {seen[case]}"


def test_disagreement_fails_the_launch():
    with pytest.raises(WorkerError) as info:
        launch(_disagree, 2, "num_expert", timeout=30)
    msg = str(info.value)
    assert "ExpertParallelMismatch" in msg and CASES["num_expert"] in msg, msg
    assert "then: rank" in msg and msg.count("ExpertParallelMismatch") >= 2, "both ranks must raise: " + msg


def test_skipped_layer_then_other_collective_detail_mode_names_both():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's kind and shape across ranks first."""
    with pytest.raises(WorkerError) as info:
        launch(_disagree, 2, "skip_then_all_reduce", timeout=30, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    msg = str(info.value)
    assert "Detected mismatch between collectives" in msg, msg
    assert "OpType=ALLTOALL" in msg and "OpType=ALLREDUCE" in msg, msg       # the checked counts' all_to_all


def test_skipped_layer_then_other_collective_without_detail_times_out_with_stacks():
    """Without DETAIL, gloo waits forever on mismatched collectives: the launcher's collective watch (or, failing
    that, its timeout) turns it into an error whose stacks show rank 0 in the agreement check."""
    with pytest.raises(WorkerError) as info:
        launch(_disagree, 2, "skip_then_all_reduce_plain", timeout=20)
    err = info.value
    assert "different collectives" in str(err) or "timed out" in str(err), str(err)[:300]
    assert "check_agreement" in err.stacks.get(0, ""), err.stacks


# ---- pure helpers ------------------------------------------------------------------------------------
def test_local_order_makes_each_local_expert_contiguous():
    from labutils.moe.expert_parallel import local_order

    global_expert_count = torch.tensor([2, 1, 0, 3, 1, 1])             # 3 source ranks x 2 local experts
    tags = [(src, e) for src in range(3) for e in range(2) for _ in range(int(global_expert_count[src * 2 + e]))]
    perm = local_order(global_expert_count, num_expert=2)
    reordered = [tags[i] for i in perm.tolist()]
    assert reordered == sorted(tags, key=lambda t: (t[1], t[0]))       # by expert, then source, stable



def test_disagreements_name_each_field_that_differs_and_nothing_else():
    """The agreement check's verdict (labutils.agreement, shared by collectives and check_agreement): one line
    per differing column, each rank's value, dtypes by name; ranks that agree give none."""
    from labutils.agreement import disagreements, dtype_code, dtype_name

    f32, f64 = dtype_code(torch.float32), dtype_code(torch.float64)
    rows = torch.tensor([[7, 2, f32], [7, 5, f64]])                      # (W=2, 3 fields)
    got = disagreements(rows, ["tag", "num_expert", "dtype"], show={"dtype": dtype_name})
    assert got == {"num_expert": "num_expert: rank 0=2, rank 1=5",
                   "dtype": "dtype: rank 0=torch.float32, rank 1=torch.float64"}
    assert disagreements(rows[[0, 0]], ["tag", "num_expert", "dtype"]) == {}

def test_shard_state_slices_fused_and_renumbers_lists():
    from labutils.moe.expert_parallel import shard_state

    state = {"gate.gate.weight": torch.ones(4, 3), "experts.htoh4.weight": torch.arange(4.).view(4, 1),
             "experts.2.weight": torch.full((1,), 2.0), "experts.3.weight": torch.full((1,), 3.0),
             "experts.0.weight": torch.zeros(1)}
    got = shard_state(state, rank=1, num_expert=2)
    assert got["experts.htoh4.weight"].view(-1).tolist() == [2.0, 3.0]
    assert got["experts.0.weight"].item() == 2.0 and got["experts.1.weight"].item() == 3.0
    assert "experts.2.weight" not in got and got["gate.gate.weight"] is state["gate.gate.weight"]


BUGS = {"expert grads x W": "experts", "router grad not reduced": "gate", "router grad reduced twice": "gate"}


def _parity_with_bugs():
    return {fault: _parity("fused", 2, [5, 3], fault, True)[0] for fault in (None, *BUGS)}


def test_parity_check_catches_expert_parallel_gradient_bugs():
    """Issue 28's bug classes: each makes the W-workers = 1-process check fail (relative difference far above
    1e-5) on the parameters it touches, and only there; the correct layer passes the same check."""
    results = launch(_parity_with_bugs, 2, timeout=90)
    flagged = {fault: {n for r in results for n, v in r[fault].items() if not v <= 1e-5} for fault in results[0]}
    assert not flagged[None], f"the correct layer failed the parity check: {sorted(flagged[None])}"
    for fault, group in BUGS.items():
        assert flagged[fault], f"the parity check missed {fault!r}"
        assert all(group in n for n in flagged[fault]), f"{fault!r} flagged other tensors: {sorted(flagged[fault])}"


# --- bytes on the wire ------------------------------------------------------------------------------------------

WIRE_FAULTS = ("extra padding all-to-all", "blocks padded to a fixed size", "rows sent twice", "extra all_reduce")


def _wire(tokens):
    """Every rank: the chapter's wire count of one exchange, as written and with each fault patched in."""
    import torch
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP, count_by_gate, expert_parallel
    from labutils.moe.traffic import wire_bytes_of_call

    rank, world = dist.get_rank(), dist.get_world_size()
    real = expert_parallel.all_to_all

    def extra_padding(x, *args, **kwargs):
        pad = x.new_zeros(8 * world, x.shape[-1])
        dist.all_to_all_single(torch.empty_like(pad), pad)
        return real(x, *args, **kwargs)

    def padded_blocks(x, out_splits, in_splits, group=None, check=True):
        cap = 2 * tokens                                                      # the largest block there can be
        send = torch.cat([torch.cat([b, b.new_zeros(cap - len(b), *b.shape[1:])]) for b in x.split(in_splits)])
        got = real(send, [cap] * world, [cap] * world, group, check=check)
        return torch.cat([b[:n] for b, n in zip(got.split(cap), out_splits)])

    def twice(x, *args, **kwargs):
        real(x, *args, **kwargs)
        return real(x, *args, **kwargs)

    def extra_all_reduce(x, *args, **kwargs):
        dist.all_reduce(torch.ones(4))
        return real(x, *args, **kwargs)

    faults = dict(zip(WIRE_FAULTS, (extra_padding, padded_blocks, twice, extra_all_reduce)))
    torch.manual_seed(0)
    layer = FMoETransformerMLP(2, D, H, top_k=2, world_size=world)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(rank))
    counts = count_by_gate(layer.gate(x)[0], 2, world)[1]
    out = {"counts": counts, None: wire_bytes_of_call(layer, x, repeats=2)}
    for name, fn in faults.items():
        expert_parallel.all_to_all = fn
        try:
            out[name] = wire_bytes_of_call(layer, x, repeats=2)
        finally:
            expert_parallel.all_to_all = real
    return out


def test_the_wire_check_passes_the_exchange_and_fails_every_extra_exchange():
    from labutils.moe import traffic as comm

    results = launch(_wire, 4, 12, timeout=90)
    matrix = comm.token_matrix(torch.stack([r["counts"] for r in results]), num_expert=2)
    on_wire = comm.check_wire([r[None] for r in results], matrix, D * 4)      # the clean exchange passes
    assert int(on_wire.sum()) == 2 * int(comm.minimum_bytes(matrix, D, 4).sum()) > 0
    for fault in WIRE_FAULTS:
        with pytest.raises(AssertionError, match="other bytes on the wire"):
            comm.check_wire([r[fault] for r in results], matrix, D * 4)


def _count_known_bytes():
    import torch
    import torch.distributed as dist

    from labutils.wire import count_wire

    world = dist.get_world_size()
    counted = []
    for rows in (0, 1, 100):                                                 # framing is the same for every size
        dist.barrier()
        with count_wire() as w:
            dist.all_to_all_single(torch.empty(world * rows), torch.zeros(world * rows))
            dist.barrier()
        counted.append(w.sent)
    return counted


def test_count_wire_sees_exactly_the_payload_of_a_raw_collective():
    for counted in launch(_count_known_bytes, 3, timeout=60):
        assert counted[1] - counted[0] == 2 * 1 * 4                          # 1 float to each of 2 peers
        assert counted[2] - counted[0] == 2 * 100 * 4


def test_two_minimums_and_deepspeed_without_drops():
    from labutils.moe import traffic as comm
    from labutils.moe.capacity import deepspeed_dropless_capacity

    # rank 0: token 0 -> experts 2, 3 (both on rank 1: one trip deduplicated), token 1 -> experts 0, 2
    gate_idx = [torch.tensor([[2, 3], [0, 2]]), torch.tensor([[0, 1], [3, -1]])]
    counts = torch.stack([torch.bincount(g[g >= 0], minlength=4) for g in gate_idx])
    m = comm.token_matrix(counts, num_expert=2)
    assert comm.minimum_bytes(m, 1, 1).tolist() == [3, 2]                  # one row per choice
    assert comm.dedup_minimum_bytes(gate_idx, 2, 1, 1).tolist() == [2, 1]  # one row per (token, remote rank)
    assert deepspeed_dropless_capacity(counts) == 2
    use = comm.capacity_use(counts, 1)
    assert (use["kept"] + use["dropped"]).tolist() == use["routed"].tolist() == counts.sum(0).tolist()
    assert (use["kept"] + use["padding"]).tolist() == [2, 2, 2, 2]
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    _, _, dispatch, exp_counts = sharded_moe.top2gating(logits, 1.0, 4, drop_tokens=False,
                                                        top2_2nd_expert_sampling=False)
    assert dispatch.shape[-1] == deepspeed_dropless_capacity(exp_counts.view(1, -1)) == int(exp_counts.max())


def test_comm_accounting():
    from labutils.moe import traffic as comm
    from labutils.moe.capacity import deepspeed_capacity

    counts = torch.tensor([[3, 1, 0, 2], [0, 0, 5, 1]])                # 2 ranks x (2 ranks * 2 experts)
    m = comm.token_matrix(counts, num_expert=2)
    assert m.tolist() == [[4, 2], [0, 6]]
    assert comm.minimum_bytes(m, d_model=8, element_size=4).tolist() == [2 * 32, 0]
    assert deepspeed_capacity(10, 4, 1.0, min_capacity=4) == 4 and deepspeed_capacity(10, 4, 1.0) == 3
    assert deepspeed_capacity(100, 4, 2.0, k=2, min_capacity=4) == 100
    # E*C*d*size*(W-1)/W, whatever the routing
    assert comm.deepspeed_bytes(100, 4, 2, 8, 4, 1.0) == 4 * 25 * 8 * 4 // 2
    assert comm.deepspeed_dropped(torch.tensor([[6, 0], [4, 4]]), tokens=8, capacity_factor=1.0) == 2


def test_deepspeed_capacity_matches_deepspeed():
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    from labutils.moe.capacity import deepspeed_capacity

    for tokens, experts, cf, k in [(64, 8, 1.0, 1), (64, 8, 2.0, 1), (10, 4, 1.25, 2), (3, 8, 1.0, 1)]:
        gates = torch.zeros(tokens, experts)
        want = int(sharded_moe._capacity(gates, torch.tensor(cf * k), torch.tensor(4)))
        assert deepspeed_capacity(tokens, experts, cf, k=k, min_capacity=4) == want


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs at least 2 CUDA GPUs for NCCL expert parallelism")
def test_expert_parallel_on_cuda_workers():
    world = min(4, torch.cuda.device_count())
    results = launch(_parity_cuda, world, timeout=120, backend="nccl")
    for rank, diffs in enumerate(results):
        assert all(v <= 1e-4 for v in diffs.values()), (rank, diffs)


def _parity_cuda():
    import torch
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP
    from labutils.moe.expert_parallel import shard_state

    rank, world, dev = dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    full = FMoETransformerMLP(2 * world, D, H).to(dev)
    x_all = torch.randn(8 * world, D, device=dev)
    y_full = full(x_all)
    part = FMoETransformerMLP(2, D, H, world_size=world).to(dev)
    part.load_state_dict(shard_state(full.state_dict(), rank, 2))
    y = part(x_all[8 * rank: 8 * rank + 8])
    return {"output": (y - y_full[8 * rank: 8 * rank + 8]).abs().max().item()}
