"""Chapter 07, sections 2 and 3: DDP and ``replicate()`` against the local model on gloo workers. (Taught in
chapter 07.)

Section 2: ``Net``, ``step_model``, ``train_side_by_side``; worker ``ddp_run`` (and the wrong set-ups of
``ddp_controls``), checked by ``data_parallel_checks``. Section 3: ``replicate_each_layer`` and the parts of worker
``replicate_checks``. Workers are module-level functions: cloudpickle ships them by reference.
"""
from __future__ import annotations

from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labutils.compare import compare_models

RTOL, ATOL = 1.3e-6, 5e-5  # the tolerance of PyTorch's replicate tests


class Net(nn.Module):
    """The 3-layer net of PyTorch's replicate tests."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):  # (B, 2) -> (B, 2)
        return self.fc3(self.fc2(self.fc1(x)))


def step_model(model, x, target):
    """One SGD step with learning rate 1 on the mean-squared error."""
    model.train()
    F.mse_loss(model(x), target).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
            p.grad = None


def batch_rows(n, rank, world):
    """This rank's contiguous share of a global batch of ``n`` rows, ``n`` a multiple of ``world``: a slice."""
    if n % world:
        raise ValueError(f"batch_rows: n={n} rows do not split equally over world={world} ranks; the parity runs "
                         "need equal slices (a mean loss over unequal slices is not the global mean)")
    return slice(rank * n // world, (rank + 1) * n // world)


def plain_params(model):
    """name -> parameter as a plain tensor (a sharded or replicated ``DTensor`` gathered whole), detached."""
    return {n: getattr(p, "full_tensor", lambda p=p: p)().detach() for n, p in model.named_parameters()}


def train_side_by_side(wrap, local_batch=2, iterations=2, rtol=RTOL, atol=ATOL, rows=None):
    """Local model on the global batch vs ``wrap(copy)`` on this rank's rows (``rows(n, rank, world)``, default
    :func:`batch_rows`). Returns ``{"reports": a ParityReport per step, "seen": per step, the input each rank's copy
    really received (a forward pre-hook, all-gathered: a list over ranks), "batches": each step's global batch}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = rows or batch_rows  # looked up at call time: a test can patch ch07_ddp.batch_rows
    torch.manual_seed(0)  # same model and same global batch on every rank
    local = Net()
    dp = wrap(deepcopy(local))
    received = []
    dp.register_forward_pre_hook(lambda _mod, args: received.append(args[0].detach().clone()))
    n = world * local_batch
    x, target = torch.randn(n, 2), torch.randn(n, 2)  # (W*B, 2)
    out: dict = {"reports": [], "seen": [], "batches": []}
    for it in range(iterations):
        step_model(local, x, target)
        mine = rows(n, rank, world)
        step_model(dp, x[mine], target[mine])
        out["reports"].append(compare_models(plain_params(dp), local, "params", rtol=rtol, atol=atol))
        every = [None] * world
        dist.all_gather_object(every, received.pop())
        out["seen"].append(every)
        out["batches"].append(x)
        torch.manual_seed(it)
        perm = torch.randperm(n)  # reshuffle the examples (input and target together) for the next step
        x, target = x[perm], target[perm]
    return out


def slices_partition(out):
    """(ok, detail): at every step the inputs the ranks' copies received are the rows of the global batch, each row
    on exactly one rank (none twice, none dropped), in any layout: contiguous slices, interleaved (``rank::world``)
    or shuffled. Observed, not assumed (see train_side_by_side): every received row is matched to an unused row of
    the batch equal to it."""
    for step, (every, batch) in enumerate(zip(out["seen"], out["batches"])):
        unused = list(range(batch.shape[0]))
        for rank, rows in enumerate(every):
            for row in rows:
                hit = next((i for i in unused if torch.equal(batch[i], row)), None)
                if hit is None:
                    why = "a row twice" if any(torch.equal(batch[i], row) for i in range(batch.shape[0])) \
                        else "a row that is not in the batch"
                    return False, (f"step {step}: rank {rank} received {why}; the ranks received "
                                   f"{[s.shape[0] for s in every]} rows of a global batch of {batch.shape[0]}")
                unused.remove(hit)
        if unused:
            return False, (f"step {step}: rows {unused} of the global batch reached no rank (the ranks received "
                           f"{[s.shape[0] for s in every]} rows of {batch.shape[0]})")
    sizes = [s.shape[0] for s in out["seen"][0]]
    return True, f"{len(out['batches'])} steps; each rank received {sizes} rows, together the global batch"


def ddp_run(local_batch=2):
    """Worker: ``DistributedDataParallel`` against the local model (see train_side_by_side for the result)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return train_side_by_side(lambda m: DDP(m), local_batch)


def ddp_controls(local_batch=2):
    """Worker: two wrong set-ups. ``"no all-reduce"``: each rank trains a plain copy on its slice (no gradient
    average); ``"whole batch"``: DDP, but every rank trains on the whole global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return {"no all-reduce": train_side_by_side(lambda m: m, local_batch),
            "whole batch": train_side_by_side(lambda m: DDP(m), local_batch, rows=lambda n, rank, world: slice(0, n))}


def data_parallel_checks(run):
    """Section 2's checks of one ``train_side_by_side`` result: ``[(what, ok, detail)]``. Parity alone cannot tell a
    data-parallel run from whole-batch training on every rank; the slices check can."""
    bad = [r for r in run["reports"] if not r.ok]
    return [("parameters == local model's after every step", not bad, bad[0].table(top=2) if bad else ""),
            ("the ranks trained on disjoint slices that make up the global batch", *slices_partition(run))]


# ------------------------------------------------------------------ chapter 07, section 3: replicate()
def replicate_each_layer(model):
    from torch.distributed._composable.replicate import replicate

    for layer in (model.fc1, model.fc2, model.fc3):
        replicate(layer)
    return model


def replicate_state_dicts():
    """The state_dict keys of the local model, of replicate() and of the DDP wrapper; the values compared."""
    from torch.distributed._composable.replicate import replicate
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Net()
    whole, parts = replicate(deepcopy(model)), replicate_each_layer(deepcopy(model))
    return {"keys": {"local": list(model.state_dict()), "replicate": list(whole.state_dict()),
                     "DDP wrapper": list(DDP(deepcopy(model)).state_dict())},
            "sd_whole": compare_models(whole, model, "state_dict", rtol=0, atol=0),
            "sd_parts": compare_models(parts, model, "state_dict", rtol=0, atol=0)}


def replicate_fsdp2(model):
    """torch 2.13's FSDP2-based ``replicate`` (private: ``torch.distributed._composable.replicate_with_fsdp``) on a
    CPU mesh: every parameter becomes a ``Replicate()`` DTensor, gradients are all-reduced by FSDP2's machinery."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    return replicate(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))


def replicate_trains(local_batch):
    """replicate() on the whole model, on each layer, with DDP's options, and the FSDP2-based replicate: a
    train_side_by_side result each."""
    from torch.distributed._composable.replicate import replicate

    return {"train_whole": train_side_by_side(lambda m: replicate(m), local_batch),
            "train_parts": train_side_by_side(replicate_each_layer, local_batch),
            "train_kwargs": train_side_by_side(
                lambda m: replicate(m, bucket_cap_mb=1, gradient_as_bucket_view=True), local_batch),
            "train_fsdp2": train_side_by_side(replicate_fsdp2, local_batch)}


def replicate_ignored_fc1():
    """replicate(ignored_modules=[fc1]): max |grad(rank 1) - grad(rank 0)| per layer, and its device_ids."""
    from torch.distributed._composable.replicate import replicate

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different weights AND inputs per rank
    ign = Net()
    replicate(ign, ignored_modules=[ign.fc1])  # fc1's gradient stays local, fc2/fc3 are averaged
    inp = torch.randn(5, 2) * (rank + 1)  # (B, 2)
    (ign(inp) * 10).sum().backward()
    grads = {}
    for name in ("fc1", "fc2", "fc3"):
        g = getattr(ign, name).weight.grad
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g)
        grads[name] = (every[1] - every[0]).abs().max().item()
    return {"ignored_grad_diff": grads, **replicate_device_ids()}


def replicate_device_ids():
    """The DDP instance behind ``replicate()`` on CPU (default and ``device_id=torch.device("cpu")``): is it alive,
    and what are its ``device_ids``? A dead weak reference is reported as such, never as ``device_ids=None``."""
    from torch.distributed._composable.replicate import replicate

    out = {}
    for label, device_id in (("default", None), ("device_id=cpu", torch.device("cpu"))):
        m = Net()
        replicate(m) if device_id is None else replicate(m, device_id=device_id)
        m(torch.randn(2, 2))  # the DDP instance is built lazily, at the first forward
        ddp = replicate.state(m)._ddp_weakref()  # private API: a weak reference to the DDP behind the hooks
        out[label] = {"alive": ddp is not None, "device_ids": None if ddp is None else ddp.device_ids,
                      "param devices": sorted({p.device.type for p in m.parameters()})}
    return {"device_ids": out}


def replicate_device_id_error():
    """What ``replicate(model, device_id=<a list>)`` does, observed: ``{"raised": the exception's type name (None if
    none), "message", "retry": what a second, valid ``replicate(model)`` on the same model then does ("trains" or
    the exception's type and first line)}``."""
    from torch.distributed._composable.replicate import replicate

    m = Net()
    raised = message = None
    try:
        replicate(m, device_id=[torch.device("cpu")])
    except Exception as exc:  # noqa: BLE001  (the type is what we report)
        raised, message = type(exc).__name__, str(exc)
    try:
        replicate(m)
        m(torch.randn(2, 2)).sum().backward()
        retry = "trains"
    except Exception as exc:  # noqa: BLE001
        retry = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return {"raised": raised, "message": message, "retry": retry}


def replicate_checks(local_batch=2):
    """Worker: the checks of PyTorch's test_replicate.py that apply to CPU, in one dict."""
    return {**replicate_state_dicts(), **replicate_trains(local_batch), **replicate_ignored_fc1(),
            "device_id_error": replicate_device_id_error()}
