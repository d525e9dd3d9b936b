"""labutils.ds: DeepSpeed in one process and in launch workers, the prebuilt op, quiet output,
ep_size=2 parity and the capacity-agreement guard (all with the real DeepSpeed, never mocked). The ep_size=2 and
capacity-guard workers are chapter 02's, imported from labbook.toys."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from labbook.toys.ch02_deepspeed import capacity_pitfall, ep_parity
from labutils.launcher import WorkerError, launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
D, E = 8, 4


@pytest.fixture(scope="module")
def ds():
    from labutils import ds

    ds.import_deepspeed()
    return ds


def test_init_deepspeed_single_process_is_quiet_idempotent_and_uses_a_free_port():
    code = """
import json, os
from labutils.ds import init_deepspeed
a = init_deepspeed()  # prepares DeepSpeed's environment (importing labutils.ds does not), then imports it
b = init_deepspeed()
import deepspeed.comm as dc
print(json.dumps({"a": a, "b": b, "ds": dc.is_initialized(), "world": dc.get_world_size(),
                  "port": os.environ["MASTER_PORT"], "ext": os.environ["TORCH_EXTENSIONS_DIR"]}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK",
                                                            "TORCH_EXTENSIONS_DIR")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=env)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, f"init_deepspeed printed something:\n{run.stdout}"  # quiet: only our JSON
    out = json.loads(lines[0])
    assert out["a"] == out["b"] == {"rank": 0, "world_size": 1, "backend": "gloo", "adopted": False}
    assert out["ds"] and out["world"] == 1
    assert out["ext"] == str(ROOT / ".cache" / "torch_extensions")
    assert out["port"] != "29500"  # a free port, not DeepSpeed's fixed default


def test_init_deepspeed_ignores_an_inherited_one_process_port():
    """A kernel started by a process that used DeepSpeed inherits WORLD_SIZE=1 and a MASTER_PORT that process
    still holds; a one-process init must pick a fresh port instead of failing with EADDRINUSE."""
    import socket

    code = """
import os
from labutils.ds import init_deepspeed
init_deepspeed()
print(os.environ["MASTER_PORT"])
"""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                             env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() != str(port)


_ENV_PROBE = """
import json, os
before = dict(os.environ)
import labutils.ds, labutils.ds.gating, labutils.ds.runtime, labutils.moe.traffic
{then}
after = dict(os.environ)
print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))
"""


@pytest.mark.parametrize("then, changed", [
    ("", []),
    ("labutils.ds.runtime._prepare_environment()  # what importing runtime used to do", ["TORCH_EXTENSIONS_DIR"]),
], ids=["import", "negative control: the old import-time set-up"])
def test_importing_the_deepspeed_wing_leaves_the_environment_alone(then, changed):
    """Importing labutils.ds (and its gating) sets no environment variable; DeepSpeed's cache and accelerator are
    set by import_deepspeed / init_deepspeed / build_ops when they run. The control runs that set-up by hand
    (the probe sees it), with the two variables unset as in a fresh shell."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")}
    run = subprocess.run([sys.executable, "-c", _ENV_PROBE.format(then=then)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(changed) <= set(got) <= {"TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR"} and bool(got) == bool(changed), got


def _adopt():
    import deepspeed.comm as dc
    import torch.distributed as dist

    from labutils.ds import init_deepspeed

    before = dist.is_initialized()
    info = init_deepspeed()
    return {"before": before, "info": info, "again": init_deepspeed(), "ds_world": dc.get_world_size(),
            "ds_rank": dc.get_rank(), "port_set": "MASTER_PORT" in os.environ}


def test_init_deepspeed_adopts_the_launch_group():
    results = launch(_adopt, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["before"], "launch should have started torch.distributed"
        assert r["info"] == r["again"] == {"rank": rank, "world_size": 2, "backend": "gloo", "adopted": True}
        assert (r["ds_world"], r["ds_rank"]) == (2, rank)
        assert not r["port_set"], "adopting must not invent rendezvous variables"


def test_quiet_swallows_c_level_output_and_keeps_it_on_error(ds, capfd):
    with ds.quiet():
        print("python level")
        os.write(1, b"c level\n")
        os.write(2, b"c level err\n")
    captured = capfd.readouterr()
    assert "level" not in captured.out + captured.err
    with pytest.raises(RuntimeError) as info, ds.quiet():
        os.write(1, b"linker says hi\n")
        raise RuntimeError("boom")
    assert "linker says hi" in "\n".join(getattr(info.value, "__notes__", []))


def test_build_ops_uses_the_project_cache():
    run = subprocess.run([sys.executable, "tools/build_ds_ops.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    from labutils.ds import extensions_dir, shm_op_built

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        assert extensions_dir() == ROOT / ".cache" / "torch_extensions"
    if sys.platform == "linux":  # elsewhere DeepSpeed uses no shared-memory op and the tool says so
        assert "deepspeed_shm_comm" in run.stdout
        assert shm_op_built()


def test_shard_for_rank_maps_local_experts_to_global_ones(ds):
    from deepspeed.moe.layer import MoE

    torch.manual_seed(0)
    model = torch.nn.ModuleList([MoE(D, torch.nn.Linear(D, D), num_experts=n, ep_size=2) for n in (2, 4)])
    full = {name: torch.tensor(float(i)) for i, name in enumerate(
        torch.nn.ModuleList([MoE(D, torch.nn.Linear(D, D), num_experts=n) for n in (2, 4)]).state_dict())}
    mapped = ds.shard_for_rank(full, model, rank=1)
    assert set(mapped) == set(model.state_dict())
    assert mapped["1.deepspeed_moe.experts.deepspeed_experts.0.weight"] == \
        full["1.deepspeed_moe.experts.deepspeed_experts.2.weight"]
    assert mapped["0.deepspeed_moe.experts.deepspeed_experts.0.bias"] == \
        full["0.deepspeed_moe.experts.deepspeed_experts.1.bias"]
    assert mapped["1.deepspeed_moe.gate.wg.weight"] == full["1.deepspeed_moe.gate.wg.weight"]


def _ep_parity_k12():
    return {k: ep_parity(D, E, k, 24) for k in (1, 2)}  # one launch for both k


@pytest.fixture(scope="module")
def ep_parity_results():
    return launch(_ep_parity_k12, 2, timeout=180)


@pytest.mark.parametrize("k", [1, 2])
def test_ep_size_2_matches_ep_size_1(ep_parity_results, k):
    from labutils.compare import compare_models

    for rank, per_k in enumerate(ep_parity_results):
        res = per_k[k]
        outs = res["out"]
        torch.testing.assert_close(outs["ep2"], outs["ep1"], atol=1e-6, rtol=1e-5)
        assert not torch.equal(outs["ep1"], torch.zeros_like(outs["ep1"]))
        report = compare_models(res["grads_ep2"], res["grads_ep1"], "grads", atol=1e-6, rtol=1e-5)
        assert report.ok, f"rank {rank}\n{report.table()}"
        assert len(report.diffs) == 1 + 2 * 4  # gate + 2 local experts x (2 Linear layers x (weight, bias))


def test_capacity_guard_turns_the_all_to_all_mismatch_into_a_clear_error():
    guarded = launch(capacity_pitfall, 2, D, E, True, False, timeout=120)
    for message in guarded:
        assert message.startswith("CapacityMismatchError: MoE layer 0:"), message  # the one guarded layer
        assert "disagree on the expert capacity" in message and "set_deepspeed_parallelism" in message
    fixed = launch(capacity_pitfall, 2, D, E, True, True, timeout=120)
    assert [r.split(":")[0] for r in fixed] == ["ran", "ran"]  # the expert group's all-reduce(MAX) makes them agree


def test_unguarded_mismatch_fails_in_the_worker_not_silently():
    with pytest.raises(WorkerError, match="size|collective|SIGABRT|Connection"):
        launch(capacity_pitfall, 2, D, E, False, False, timeout=60)
