"""Chapter 07: DDP, replicate() and fully_shard() train like a local model; MoE gradient grouping.

Ports the CPU-applicable checks of PyTorch's test/distributed/_composable/test_replicate.py and
test/distributed/_spmd/test_data_parallel.py (whose `_spmd.compile` API no longer exists: fully_shard and
replicate replace it). Each test batches its checks into one `launch` (a launch costs ~1.5 s plus imports).
"""
from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labutils import compare_models, launch
from labutils.parallel import (
    GroupedDataParallel,
    allreduce_grouped_grads,
    grad_group,
    is_expert_param,
    mark_expert_params,
    split_dense_expert,
)

RTOL, ATOL = 1.3e-6, 5e-5  # PyTorch's replicate tests


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):  # (B, 2)
        return self.fc3(self.fc2(self.fc1(x)))


def _train_side_by_side(wrap, local_batch=2, iterations=2):
    """Local model on the global batch vs wrap(copy) on this rank's slice, lr-1 SGD; a report per step."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    local = Net()
    dp = wrap(deepcopy(local))
    x, t = torch.randn(world * local_batch, 2), torch.randn(world * local_batch, 2)
    mine = slice(rank * local_batch, (rank + 1) * local_batch)
    reports = []
    for it in range(iterations):
        for model, xs, ts in ((local, x, t), (dp, x[mine], t[mine])):
            F.mse_loss(model(xs), ts).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= p.grad
                    p.grad = None
        reports.append(compare_models(dp, local, "params", rtol=RTOL, atol=ATOL))
        torch.manual_seed(it)
        x = x[torch.randperm(world * local_batch)]
    return reports


def _replicate_layers(model):
    from torch.distributed._composable.replicate import replicate

    for layer in (model.fc1, model.fc2, model.fc3):
        replicate(layer)
    return model


def _ddp_and_replicate_checks():
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"DDP": _train_side_by_side(lambda m: DDP(m)),
           "replicate": _train_side_by_side(lambda m: replicate(m)),
           "replicate per layer": _train_side_by_side(_replicate_layers),
           "replicate kwargs": _train_side_by_side(
               lambda m: replicate(m, bucket_cap_mb=1, gradient_as_bucket_view=True))}
    torch.manual_seed(0)
    model = Net()
    out["sd whole"] = [compare_models(replicate(deepcopy(model)), model, "state_dict", rtol=0, atol=0)]
    out["sd per layer"] = [compare_models(_replicate_layers(deepcopy(model)), model, "state_dict", rtol=0, atol=0)]
    keys = list(replicate(deepcopy(model)).state_dict()) == list(model.state_dict())

    torch.manual_seed(rank)  # ignored_modules: different weights and inputs per rank
    ign = Net()
    replicate(ign, ignored_modules=[ign.fc1])
    (ign(torch.randn(5, 2) * (rank + 1)) * 10).sum().backward()
    spread = {}
    for name in ("fc1", "fc2", "fc3"):
        g = getattr(ign, name).weight.grad
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g)
        spread[name] = (every[1] - every[0]).abs().max().item()
    device_ids = replicate.state(ign)._ddp_weakref().device_ids
    try:
        replicate(Net(), device_id=[torch.device("cpu")])
        err = None
    except RuntimeError as exc:
        err = str(exc)
    return out, keys, spread, device_ids, err


def _assert_reports(reports_by_case):
    for case, reports in reports_by_case.items():
        for step, rep in enumerate(reports):
            assert rep.ok, f"{case}, step {step}:\n{rep.table()}"


def test_ddp_and_replicate_match_local_training():
    for out, keys, spread, device_ids, err in launch(_ddp_and_replicate_checks, 2, timeout=120):
        _assert_reports(out)
        assert keys, "replicate() must keep the local state_dict keys"
        assert spread["fc1"] > 1e-3, f"ignored fc1 grads should differ across ranks: {spread}"
        assert spread["fc2"] == 0.0 and spread["fc3"] == 0.0, f"fc2/fc3 grads must be all-reduced: {spread}"
        assert device_ids is None
        assert err is not None and "Expected device_id to be int or torch.device" in err


# ---------------------------------------------------------------------------------------------- FSDP2
class SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1, self.net2 = nn.Linear(50, 32), nn.Linear(32, 8)

    def forward(self, x):  # (B, 50) -> (B, 8)
        return torch.sigmoid(self.net2(torch.relu(self.net1(x))))


class BatchDim1(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = SimpleMLP()

    def forward(self, x):  # (50, B) -> (8, B)
        return self.mlp(x.t().contiguous()).t().contiguous()


FSDP_CASES = {
    "SGD": (SimpleMLP, "SGD", dict(lr=0.1), 0),
    "SGD momentum": (SimpleMLP, "SGD", dict(lr=0.1, momentum=0.9), 0),
    "SGD momentum foreach": (SimpleMLP, "SGD", dict(lr=0.1, momentum=0.9, foreach=True), 0),
    "Adam": (SimpleMLP, "Adam", dict(lr=0.1), 0),
    "Adam fused": (SimpleMLP, "Adam", dict(lr=0.1, fused=True), 0),
    "batch dim 1, Adam fused": (BatchDim1, "Adam", dict(lr=0.1, fused=True), 1),
}


def _fsdp_vs_ddp(rows=16, steps=2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (cls, opt_name, opts, batch_dim) in FSDP_CASES.items():
        torch.manual_seed(0)
        mod = cls()
        ddp, fsdp = DDP(deepcopy(mod)), deepcopy(mod)
        for layer in [m for m in fsdp.modules() if isinstance(m, nn.Linear)]:
            fully_shard(layer, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)
        opt_d = getattr(torch.optim, opt_name)(ddp.parameters(), **opts)
        opt_f = getattr(torch.optim, opt_name)(fsdp.parameters(), **opts)
        torch.manual_seed(100 + rank)
        x, y = torch.randn(rows, 50), torch.randn(rows, 8)
        batch = (x, y) if batch_dim == 0 else (x.t().contiguous(), y.t().contiguous())
        out[name] = []
        for _ in range(steps):
            for model, opt in ((ddp, opt_d), (fsdp, opt_f)):
                opt.zero_grad()
                (model(batch[0]) - batch[1]).sum().backward()
                opt.step()
            assert type(fsdp.mlp.net1.weight if batch_dim else fsdp.net1.weight).__name__ == "DTensor"
            gathered = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
            out[name].append(compare_models(gathered, ddp, "params", rtol=RTOL, atol=ATOL))
    return out


def test_fully_shard_matches_ddp_sgd_adam_and_batch_dim_1():
    for out in launch(_fsdp_vs_ddp, 2, timeout=120):
        assert set(out) == set(FSDP_CASES)
        _assert_reports(out)


def test_spmd_compile_api_is_gone():
    with pytest.raises(ImportError):
        import torch.distributed._spmd  # noqa: F401


# ---------------------------------------------------------------------------------------------- MoE
class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class TinyMoE(nn.Module):
    """dense -> top-1 gate -> experts -> dense; ``keep_expert`` makes it expert parallel over a group."""

    def __init__(self, d=8, h=16, num_experts=2):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(d, d), nn.Linear(d, num_experts), nn.Linear(d, d)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))
        self.ep_group = None

    def keep_expert(self, e, ep_group):
        self.experts, self.ep_group = nn.ModuleList([self.experts[e]]), ep_group
        mark_expert_params(self.experts)
        self.zero_grad(set_to_none=True)
        return self

    def forward(self, x):  # (T, d)
        h = self.inp(x)
        score, idx = F.softmax(self.gate(h), dim=-1).max(dim=-1)
        if self.ep_group is None:
            y = torch.stack([e(h) for e in self.experts], 1)[torch.arange(h.shape[0]), idx]
        else:
            y = self._expert_parallel(h, idx)
        return self.out(h + score[:, None] * y)

    def _expert_parallel(self, h, idx):
        import torch.distributed as dist

        from labutils.dist import all_to_all

        order = idx.argsort(stable=True)
        send = torch.bincount(idx, minlength=dist.get_world_size(self.ep_group))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        mine = all_to_all(h[order], recv.tolist(), send.tolist(), group=self.ep_group)
        back = all_to_all(self.experts[0](mine), send.tolist(), recv.tolist(), group=self.ep_group)
        return back[order.argsort()]


def _reference(num_experts, world, tokens=8):
    torch.manual_seed(0)
    ref = TinyMoE(num_experts=num_experts)
    x, t = torch.randn(world * tokens, 8), torch.randn(world * tokens, 8)
    F.mse_loss(ref(x), t).backward()
    return ref, x, t


def _as_rank_names(ref, e, what="grads"):
    own = f"experts.{e}."
    return {k.replace(own, "experts.0."): (p.grad if what == "grads" else p.detach())
            for k, p in ref.named_parameters() if not k.startswith("experts.") or k.startswith(own)}


def _moe_checks(tokens=8, steps=2):
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    ref, x, t = _reference(world, world, tokens)
    want = _as_rank_names(ref, rank)
    mine = slice(rank * tokens, (rank + 1) * tokens)

    def run(model, loss_model=None):
        F.mse_loss((loss_model or model)(x[mine]), t[mine]).backward()
        return {k.removeprefix("module."): p.grad for k, p in model.named_parameters()}

    out = {}
    m = deepcopy(ref).keep_expert(rank, dist.group.WORLD)
    ddp = DDP(m)
    out["overwritten"] = (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()
    out["naive"] = compare_models(run(m, ddp), want, "grads")
    m = deepcopy(ref).keep_expert(rank, dist.group.WORLD)
    out["no_init_sync"] = compare_models(run(m, DDP(m, init_sync=False)), want, "grads")
    m = deepcopy(ref).keep_expert(rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m)
    out["kept"] = (m.experts[0].w1.weight - ref.experts[rank].w1.weight).abs().max().item()
    run(m, gdp)
    out["counts"] = gdp.allreduce_gradients()
    out["grouped"] = compare_models(m, want, "grads")
    m = deepcopy(ref).keep_expert(rank, dist.group.WORLD)
    gdp = GroupedDataParallel(m, expert_scale="sum")
    run(m, gdp)
    gdp.allreduce_gradients()
    out["sum"] = compare_models({k: g / world if k.startswith("experts.") else g for k, g in
                                 {n: p.grad for n, p in m.named_parameters()}.items()}, want, "grads")
    m = deepcopy(ref).keep_expert(rank, dist.group.WORLD)
    replicate(m, ignored_modules=[m.experts])
    run(m)
    for p in m.experts.parameters():
        p.grad /= world
    out["replicate_ignored"] = compare_models(m, want, "grads")

    out["lab_fmoe"] = _lab_fmoe(tokens)

    # training parity: SGD steps, new global batch each step
    torch.manual_seed(0)
    ref2 = TinyMoE(num_experts=world)
    m = GroupedDataParallel(deepcopy(ref2).keep_expert(rank, dist.group.WORLD))
    opt_ref, opt = torch.optim.SGD(ref2.parameters(), lr=0.5), torch.optim.SGD(m.parameters(), lr=0.5)
    out["train"] = []
    for step in range(steps):
        torch.manual_seed(1000 + step)
        xs, ts = torch.randn(world * tokens, 8), torch.randn(world * tokens, 8)
        opt_ref.zero_grad()
        opt.zero_grad()
        F.mse_loss(ref2(xs), ts).backward()
        F.mse_loss(m(xs[mine]), ts[mine]).backward()
        m.allreduce_gradients()
        opt_ref.step()
        opt.step()
        out["train"].append(compare_models(m.module, _as_rank_names(ref2, rank, "params"), "params",
                                           rtol=RTOL, atol=ATOL))
    return out


def _lab_fmoe(tokens, d=8, h=16, num_expert=2):
    """labutils.moe's FMoETransformerMLP(world_size=W) (fastmoe tags "none"/"gate") vs the world_size=1 layer."""
    import torch.distributed as dist

    from labutils.moe import FMoETransformerMLP
    from labutils.moe.parallel import shard_state

    rank, world = dist.get_rank(), dist.get_world_size()

    def block(world_size, ne):
        moe = FMoETransformerMLP(num_expert=ne, d_model=d, d_hidden=h, world_size=world_size, top_k=2)
        return nn.Sequential(nn.Linear(d, d), moe, nn.Linear(d, d))

    torch.manual_seed(0)
    ref = block(1, world * num_expert)
    x, t = torch.randn(world * tokens, d), torch.randn(world * tokens, d)
    F.mse_loss(ref(x), t).backward()
    m = block(world, num_expert)
    m.load_state_dict(shard_state(ref.state_dict(), rank, num_expert))
    gdp = GroupedDataParallel(m)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    F.mse_loss(gdp(x[mine]), t[mine]).backward()
    assert gdp.allreduce_gradients() == {"dp": 4, "world": 2, "expert": 4}
    return compare_models(m, shard_state({n: p.grad for n, p in ref.named_parameters()}, rank, num_expert), "grads")


def test_moe_naive_ddp_is_wrong_and_grouping_matches_single_process():
    outs = launch(_moe_checks, 2, timeout=120)
    assert outs[1]["overwritten"] > 1e-3, "DDP's start-up broadcast should overwrite rank 1's expert"
    for rank, out in enumerate(outs):
        assert out["kept"] == 0.0, "GroupedDataParallel must not broadcast experts across expert-parallel ranks"
        assert out["counts"] == {"dp": 6, "world": 0, "expert": 4}
        assert not out["naive"].ok
        dense = [d for d in out["no_init_sync"].diffs if not d.name.startswith("experts.")]
        expert = [d for d in out["no_init_sync"].diffs if d.name.startswith("experts.")]
        assert all(d.close for d in dense), out["no_init_sync"].table()
        assert not any(d.close for d in expert), "DDP must mix the experts' gradients: " + out["no_init_sync"].table()
        for key in ("grouped", "sum", "replicate_ignored", "lab_fmoe"):
            assert out[key].ok, f"rank {rank} {key}:\n{out[key].table()}"
        _assert_reports({"train": out["train"]})


def _moe_expert_data_parallel(ep_size, tokens=6):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    ep_groups = [dist.new_group(list(range(g, g + ep_size))) for g in range(0, world, ep_size)]
    edp_groups = [dist.new_group(list(range(e, world, ep_size))) for e in range(ep_size)]
    e = rank % ep_size
    ref, x, t = _reference(ep_size, world, tokens)
    # start from different expert weights on the replicas: the wrap must broadcast within the expert-DP group
    m = deepcopy(ref).keep_expert(e, ep_groups[rank // ep_size])
    if rank >= ep_size:
        with torch.no_grad():
            for p in m.experts.parameters():
                p.add_(1.0)
    gdp = GroupedDataParallel(m, expert_dp_group=edp_groups[e])
    mine = slice(rank * tokens, (rank + 1) * tokens)
    F.mse_loss(gdp(x[mine]), t[mine]).backward()
    gdp.allreduce_gradients()
    return compare_models(m, _as_rank_names(ref, e), "grads")


def test_moe_grouping_with_expert_data_parallel_groups():
    """4 ranks, expert-parallel size 2: experts summed over {0,2} / {1,3}, divided by 4; dense averaged."""
    for rank, rep in enumerate(launch(_moe_expert_data_parallel, 4, 2, timeout=120)):
        assert rep.ok, f"rank {rank}:\n{rep.table()}"


# ---------------------------------------------------------------------------------------------- no workers
def test_tagging_and_bad_input():
    model = TinyMoE()
    mark_expert_params(model.experts)
    dense, expert = split_dense_expert(model)
    assert [n for n, _ in expert] == [n for n, _ in model.named_parameters() if n.startswith("experts.")]
    assert len(dense) == 6
    ds_style = nn.Linear(2, 2)
    ds_style.weight.allreduce = False  # DeepSpeed's marker for expert parameters
    assert is_expert_param(ds_style.weight) and not is_expert_param(ds_style.bias)
    fast = nn.Linear(2, 2)
    fast.weight.dp_comm, fast.bias.dp_comm = "none", "gate"  # fastmoe's tags: expert, gate
    assert [grad_group(p) for p in fast.parameters()] == ["expert", "world"]
    model.inp.weight.dp_comm = "tensor"
    with pytest.raises(ValueError, match="unknown dp_comm 'tensor'"):
        split_dense_expert(model)
    with pytest.raises(ValueError, match="expert_scale must be 'mean' or 'sum'"):
        allreduce_grouped_grads(model, expert_scale="avg")
    with pytest.raises(ValueError, match="expert_scale must be 'mean' or 'sum'"):
        GroupedDataParallel(model, expert_scale="avg")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replicate(device_id=cuda) needs a CUDA GPU")
def test_replicate_device_id_cuda():
    def check():
        from torch.distributed._composable.replicate import replicate

        dev = torch.cuda.current_device()
        ids = []
        for device_id in (torch.device("cuda", dev), int(dev)):
            m = Net().cuda()
            replicate(m, device_id=device_id)
            m(torch.randn(2, 2, device="cuda"))
            ids.append(replicate.state(m)._ddp_weakref().device_ids)
        return ids

    assert launch(check, 1, backend="nccl", timeout=120)[0] == [[0], [0]]
