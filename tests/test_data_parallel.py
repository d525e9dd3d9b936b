"""Chapter 07: DDP, replicate() and fully_shard() train like a local model; MoE gradient grouping.

Ports the CPU-applicable checks of PyTorch's test/distributed/_composable/test_replicate.py and
test/distributed/_spmd/test_data_parallel.py (whose `_spmd.compile` API no longer exists: fully_shard and
replicate replace it). The models and workers are chapter 07's, imported from `labbook.toys`. Each test
batches its checks into one `launch` (a launch costs ~1.5 s plus imports).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from labbook import toys
from labbook.toys.ch07_costs import COST_MODES, dp_costs
from labbook.toys.ch07_ddp import Net, data_parallel_checks, ddp_controls, ddp_run, replicate_checks
from labbook.toys.ch07_ep_groups import broadcast_checks, lab_fmoe_check, moe_ep_groups
from labbook.toys.ch07_fsdp import FSDP_CASES, fsdp_vs_ddp
from labbook.toys.ch07_moe import TinyMoE, moe_checks
from labutils import launch
from labutils.data_parallel import (
    GroupedDataParallel,
    allreduce_grouped_grads,
    grad_group,
    is_expert_param,
    mark_expert_params,
    split_dense_expert,
)


def _assert_reports(reports_by_case):
    for case, reports in reports_by_case.items():
        for step, rep in enumerate(reports):
            assert rep.ok, f"{case}, step {step}:\n{rep.table()}"


def _ddp_and_replicate():
    return ddp_run(2), replicate_checks(2), ddp_controls(2)  # one launch for all


def _failing(checks):
    return [what for what, ok, _ in checks if not ok]


def test_ddp_and_replicate_match_local_training():
    for ddp, rep, controls in launch(_ddp_and_replicate, 2, timeout=120):
        assert not _failing(data_parallel_checks(ddp)), data_parallel_checks(ddp)
        for key in ("train_whole", "train_parts", "train_kwargs", "train_fsdp2"):
            assert not _failing(data_parallel_checks(rep[key])), key
        _assert_reports({"sd whole": [rep["sd_whole"]], "sd per layer": [rep["sd_parts"]]})
        keys = rep["keys"]
        assert keys["replicate"] == keys["local"], "replicate() must keep the local state_dict keys"
        assert keys["DDP wrapper"] == [f"module.{k}" for k in keys["local"]]
        spread = rep["ignored_grad_diff"]
        assert spread["fc1"] > 1e-3, f"ignored fc1 grads should differ across ranks: {spread}"
        assert spread["fc2"] == 0.0 and spread["fc3"] == 0.0, f"fc2/fc3 grads must be all-reduced: {spread}"
        for seen in rep["device_ids"].values():
            assert seen == {"alive": True, "device_ids": None, "param devices": ["cpu"]}, seen
        err = rep["device_id_error"]
        assert err["raised"] == "RuntimeError" and err["retry"].startswith("AssertionError"), err
        # the negative controls: no all-reduce fails parity; whole-batch training passes parity, fails the slices
        assert _failing(data_parallel_checks(controls["no all-reduce"])) == [
            "parameters == local model's after every step"]
        assert _failing(data_parallel_checks(controls["whole batch"])) == [
            "the ranks trained on disjoint slices that make up the global batch"]


def _whole_batch_fault():
    toys.ch07_ddp.batch_rows = lambda n, rank, world: slice(0, n)  # every rank trains on the whole global batch
    return ddp_run(2)


def test_fault_whole_batch_on_every_rank_fails_the_chapter_checks():
    """Fault injection: chapter 07's section 2 checks (data_parallel_checks) on a run whose row rule is patched to
    the whole batch must fail; the clean run passes (test above)."""
    for run in launch(_whole_batch_fault, 2, timeout=120):
        assert "the ranks trained on disjoint slices that make up the global batch" in _failing(
            data_parallel_checks(run))


def _noop_broadcast_fault():
    import labutils.data_parallel as dp

    dp.broadcast_grouped_params = lambda *args, **kwargs: None  # the start-up broadcast does nothing
    return moe_ep_groups(8, 16, 6, 2, 1.0, True)


def test_fault_noop_startup_broadcast_fails_the_chapter_checks():
    """Fault injection: chapter 07's start-up broadcast checks with a no-op broadcast must fail."""
    failing = _failing(broadcast_checks(launch(_noop_broadcast_fault, 4, timeout=120), 1.0))
    assert any(w.startswith("the wrap's broadcast makes them equal") for w in failing), failing


# ---------------------------------------------------------------------------------------------- FSDP2
def test_fully_shard_matches_ddp_sgd_adam_and_batch_dim_1():
    for out in launch(fsdp_vs_ddp, 2, FSDP_CASES, 16, timeout=120):
        assert set(out["reports"]) == set(FSDP_CASES)
        _assert_reports(out["reports"])
        assert {kind for kind, *_ in out["shards"].values()} == {"DTensor"}, out["shards"]
        if not torch.cuda.is_available():
            assert out["offload_error"] is not None, "CPUOffloadPolicy should need an accelerator"
        assert not any(r.ok for r in out["control"]), "fully_shard on a 1-rank mesh must not match DDP"
        status = {k: v[0] for k, v in out["features"].items()}
        assert set(status.values()) <= {"works", "skipped"}, out["features"]


def test_spmd_compile_api_is_gone():
    with pytest.raises(ImportError):
        import torch.distributed._spmd  # noqa: F401


# ---------------------------------------------------------------------------------------------- MoE
def _moe_and_lab_fmoe():
    return moe_checks(8, 16, 8, 2), lab_fmoe_check(8, 16, 8)  # one launch for both


def test_moe_naive_ddp_is_wrong_and_grouping_matches_single_process():
    outs = launch(_moe_and_lab_fmoe, 2, timeout=120)
    assert outs[1][0]["naive_expert_overwritten"] > 1e-3, "DDP's start-up broadcast should overwrite rank 1's expert"
    for rank, (out, (fmoe_report, _tags, fmoe_counts)) in enumerate(outs):
        assert out["grouped_expert_overwritten"] == 0.0, \
            "GroupedDataParallel must not broadcast experts across expert-parallel ranks"
        assert out["counts"] == {"dp": 6, "world": 0, "expert": 4}
        assert not out["naive DDP"].ok
        no_sync = out["DDP init_sync=False"]
        dense = [d for d in no_sync.diffs if not d.name.startswith("experts.")]
        expert = [d for d in no_sync.diffs if d.name.startswith("experts.")]
        assert all(d.close for d in dense), no_sync.table()
        assert not any(d.close for d in expert), "DDP must mix the experts' gradients: " + no_sync.table()
        for key in ("grouped", "sum_scale", "replicate(ignored_modules=experts)",
                    "fully_shard(ignored_params=experts)"):
            assert out[key].ok, f"rank {rank} {key}:\n{out[key].table()}"
        _assert_reports({"train": out["train"]})
        assert fmoe_report.ok, f"rank {rank} lab FMoE:\n{fmoe_report.table()}"
        assert fmoe_counts == {"dp": 4, "world": 2, "expert": 2 * 4}  # 2 local experts x htoh4/h4toh x weight/bias


def test_moe_grouping_with_expert_data_parallel_groups():
    """4 ranks, expert-parallel size 2: experts summed over {0,2} / {1,3}, divided by 4; dense averaged. The
    replicas start from different expert weights: the wrap must broadcast within the expert-DP group."""
    out = launch(moe_ep_groups, 4, 8, 16, 6, 2, 1.0, True, timeout=120)
    assert not _failing(broadcast_checks(out, 1.0)), broadcast_checks(out, 1.0)
    for rank, (rep, layout) in enumerate(out):
        assert rep.ok, f"rank {rank}:\n{rep.table()}"
        assert layout["ep"] == [[0, 1], [2, 3]] and layout["edp"] == [[0, 2], [1, 3]]
        assert layout["counts"] == {"dp": 6, "world": 0, "expert": 4}, layout["counts"]


# ---------------------------------------------------------------------------------------------- costs
def test_costs_memory_wire_and_the_counters_control():
    """Chapter 07's cost worker at W=2, one round: fully_shard holds 1/W of what DDP holds, Adam's moments are twice
    the parameters, every mode sent at least its ring minimum, and the padded control is seen."""
    for out in launch(dp_costs, 2, rounds=1, steps=2, threads=1, timeout=120):
        mem = out["memory"]
        assert set(mem) == set(COST_MODES)
        assert mem["fully_shard"]["params"] * 2 == mem["DDP"]["params"] == mem["replicate (FSDP2)"]["params"]
        for m in COST_MODES:
            assert mem[m]["adam moments"] == 2 * mem[m]["params"] == 2 * mem[m]["grads"], (m, mem[m])
            low = out["minimum"][m]
            assert low is None or min(out["sent"][m]) >= low, (m, out["sent"][m], low)
            assert len(out["round_ms"][m]) == 1
        ctl = out["control"]
        assert ctl["padded"] - ctl["plain"] >= ctl["pad_minimum"], ctl
        assert mem["MoE, expert parallel (grouped)"]["params"] < mem["MoE, experts replicated (DDP)"]["params"]


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
