"""Expert parallelism: move each token to the rank that holds its expert and back. (Taught in chapter 06.)

FastMoE's recipe, in plain PyTorch collectives (gloo on CPU, NCCL on GPUs):

    agree+counts ONE small all_to_all: to each rank, this rank's fingerprint (layer, call, num_expert, d_model,
                 ...) and its per-expert counts for that rank's experts; every rank checks every fingerprint and
                 reads ``global_expert_count`` (what I will receive) from the same message
    dispatch     all_to_all of exactly the routed rows (no capacity padding)
    local order  received rows are (source rank, local expert); make each local expert contiguous
    experts      ``layer.run_experts(x, counts_per_local_expert)``
    undo         inverse of the local order
    return       all_to_all back (the split sizes swap roles)

Three collectives per forward call (agree+counts, dispatch, return; ``check=False``: the bare counts instead of
the checked message), two in the backward. Each is an all_to_all: the check rides on the counts
(:func:`check_agreement_and_exchange_counts`) rather than on an all_gather of its own, a round trip more, and a
slow one on gloo (8 ranks on 2 cores: a 9-int64 all_gather 12 ms, an all_to_all of the same size 4 ms).

Global expert ``g`` lives on rank ``g // num_expert`` as local expert ``g % num_expert``. Everything after the
counts is differentiable (``labutils.collectives.all_to_all``'s backward is the reverse all-to-all). The dispatch
and local order are :func:`to_experts`, their inverse :func:`from_experts` (fastmoe's ``global_scatter`` /
``global_gather``, which the fastmoe face's ``MOEScatter`` / ``MOEGather`` call too).
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.distributed as dist

from .._deprecate import forward_moved
from ..agreement import disagreements, dtype_code, dtype_name, gather_rows, require_process_group
from ..collectives import all_to_all
from .capacity import exchange_counts

__all__ = ["exchange_and_run", "local_order", "to_experts", "from_experts", "check_agreement",
           "check_agreement_and_exchange_counts", "COUNT_SLOTS",
           "assign_layer_ids", "layer_id", "ExpertParallelMismatch", "shard_state"]
forward_moved(__name__)  # its re-exports' old addresses warn (labutils._deprecate)

_MAGIC = 0x6D6F65  # "moe": tells our agreement gather apart from a stray all_gather of the same shape
_FIELDS = ["check tag", "world size", "num_expert", "d_model", "layer id", "call number of this layer",
           "dtype", "grad enabled", "counts length"]
# Count slots per peer in the checked exchange's message (fingerprint + counts). The message must have the same
# length on every rank BEFORE the ranks know whether they agree (gloo aborts on a size mismatch), so it cannot
# depend on num_expert; a layer with more experts per rank than this sends its counts in a second all_to_all.
COUNT_SLOTS = 16


class ExpertParallelMismatch(RuntimeError):
    """Ranks disagree about the expert-parallel layer they are running (raised on every rank)."""


# ---- which layer is this? ------------------------------------------------------------------------
_first_call_ids: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_next_id = itertools.count(1_000_000)  # ids given at first call, kept apart from assign_layer_ids' ids
_calls: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def assign_layer_ids(model: torch.nn.Module) -> int:
    """Number every expert-parallel layer of ``model`` in ``named_modules`` order (``layer.layer_id``).

    The same model code gives the same ids on every rank, whatever order the layers are called in, so a
    rank that skips a layer is caught at the next one. Without it a layer gets an id at its first call.
    Returns how many layers were numbered.
    """
    n = 0
    for _, module in model.named_modules():
        if hasattr(module, "run_experts"):
            module.layer_id = n  # pyright: ignore[reportArgumentType]  (a plain int attribute)
            n += 1
    return n


def layer_id(layer) -> int:
    """``layer.layer_id`` if set (see :func:`assign_layer_ids`), else an id given at the layer's first call."""
    lid = getattr(layer, "layer_id", None)
    if lid is not None:
        return int(lid)
    if layer not in _first_call_ids:
        _first_call_ids[layer] = next(_next_id)
    return _first_call_ids[layer]


def _next_call(layer) -> int:
    n = _calls.get(layer, 0)
    _calls[layer] = n + 1
    return n


# ---- agree -----------------------------------------------------------------------------------------
def _fingerprint(layer, x_sorted, local_expert_count, world: int) -> list:
    return [_MAGIC, world, int(layer.num_expert), int(x_sorted.shape[-1]), layer_id(layer), _next_call(layer),
            dtype_code(x_sorted.dtype), int(torch.is_grad_enabled()), int(local_expert_count.numel())]


def check_agreement(layer, x_sorted, local_expert_count, group=None) -> None:
    """One small all_gather of (world size, num_expert, d_model, layer id, call number, dtype, grad mode)
    (``labutils.agreement.gather_rows``, the lab's one agreement check).

    Raises :class:`ExpertParallelMismatch` on EVERY rank (each sees every fingerprint) when they differ,
    naming the field and each rank's value, so the exchange never starts with mismatched shapes.
    ``exchange_and_run`` sends the same fingerprint with its counts instead
    (:func:`check_agreement_and_exchange_counts`): one collective where this and the counts are two.
    """
    world = dist.get_world_size(group)
    rows = gather_rows(_fingerprint(layer, x_sorted, local_expert_count, world), x_sorted, group,  # (W, fields)
                       check_length=False)
    _raise_on_disagreement(rows, group)


def _raise_on_disagreement(rows: torch.Tensor, group) -> None:
    """The verdict of the check from every rank's fingerprint (``(W, len(_FIELDS))``), alike on every rank."""
    bad = disagreements(rows, _FIELDS, show={"dtype": dtype_name})                    # field -> its line
    if bad:
        hint = ""
        if bad.keys() & {"layer id", "call number of this layer"}:
            hint = "\n(a rank skipped or repeated an MoE layer: every rank must call every layer, even with 0 tokens)"
        if "check tag" in bad:
            hint = "\n(a rank is in a different collective: it skipped the MoE layer or called something else)"
        raise ExpertParallelMismatch("expert-parallel ranks disagree before the all-to-all "
                                     f"(rank {dist.get_rank(group)} speaking):\n"
                                     + "\n".join("  " + line for line in bad.values()) + hint)


def check_agreement_and_exchange_counts(layer, x_sorted, local_expert_count, group=None) -> torch.Tensor:
    """:func:`check_agreement` and ``capacity.exchange_counts`` in ONE all_to_all: returns ``global_expert_count``
    ``(W*E,)`` (block ``s``: rows rank ``s`` sends to my experts), or raises :class:`ExpertParallelMismatch` on
    every rank, with the messages of :func:`check_agreement`, before any row moves.

    Rank ``s`` sends rank ``r`` its fingerprint (``len(_FIELDS)`` int64, the same to every peer) and its counts for
    ``r``'s experts in :data:`COUNT_SLOTS` slots: ``W * (9 + COUNT_SLOTS)`` int64 each way, a length every rank
    knows before they agree. So rank ``r`` holds every rank's fingerprint, as the all_gather gave it, and its
    column block of the counts. Counts that do not fit the layout (not ``W * num_expert`` of them: the fingerprint
    says so) travel as zeros; with more than ``COUNT_SLOTS`` experts per rank the ranks, once agreed, exchange the
    counts in a second all_to_all (``capacity.exchange_counts``).
    """
    world = dist.get_world_size(group)
    ne = int(layer.num_expert)
    fields = _fingerprint(layer, x_sorted, local_expert_count, world)
    send = torch.zeros(world, len(fields) + COUNT_SLOTS, dtype=torch.long, device=x_sorted.device)  # (W, 9 + S)
    send[:, :len(fields)] = torch.tensor(fields, dtype=torch.long)
    fits = local_expert_count.numel() == world * ne and ne <= COUNT_SLOTS
    if fits:
        send[:, len(fields):len(fields) + ne] = local_expert_count.to(send.device, torch.long).view(world, ne)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                         # row s: rank s's fingerprint + counts
    rows = recv.cpu()
    _raise_on_disagreement(rows[:, :len(fields)], group)
    _check_counts(local_expert_count, world, ne, x_sorted)                  # this rank's own counts
    if ne > COUNT_SLOTS:                                                     # the same answer on every rank
        return exchange_counts(local_expert_count.long(), world, group)
    return recv[:, len(fields):len(fields) + ne].reshape(-1).to(local_expert_count.device)


def _check_counts(local_expert_count, world: int, ne: int, x_sorted) -> None:
    if local_expert_count.numel() != world * ne or int(local_expert_count.sum()) != x_sorted.shape[0]:
        raise ValueError(f"local_expert_count must have world_size*num_expert={world * ne} entries summing to "
                         f"the {x_sorted.shape[0]} rows of x_sorted; got {local_expert_count.tolist()}")


# ---- counts and local order (the counts exchange itself is capacity.exchange_counts) -----------------
def local_order(global_expert_count: torch.Tensor, num_expert: int) -> torch.Tensor:
    """Permutation that turns received rows, ordered (source rank, local expert), into (local expert, source
    rank): ``x_local = x_recv[perm]``. Stable, so each source's rows keep their order."""
    counts = global_expert_count.to(torch.long).cpu()                         # (W*E,) blocks in received order
    block = torch.repeat_interleave(torch.arange(counts.numel()), counts)     # (N_recv,) block of each row
    src, expert = torch.div(block, num_expert, rounding_mode="floor"), block % num_expert
    world = counts.numel() // num_expert
    return torch.argsort(expert * world + src, stable=True).to(global_expert_count.device)


# ---- the exchange (also fastmoe's global_scatter / global_gather: labutils.moe.fastmoe.api) ---------
def _splits(local_expert_count, global_expert_count, group) -> tuple:
    """``(world, rows to each rank, rows from each rank)`` from the two ``(W*E,)`` counts."""
    world = dist.get_world_size(group)
    return world, *(c.long().view(world, -1).sum(1).tolist() for c in (local_expert_count, global_expert_count))


def _to_experts(x_sorted, send: list, recv: list, global_expert_count, num_expert: int, group):
    x_recv = all_to_all(x_sorted, recv, send, group, check=False)             # (N_recv, d) by (src, expert)
    perm = local_order(global_expert_count, num_expert).to(x_recv.device)
    return x_recv.index_select(0, perm), perm                                 # (N_recv, d) by expert


def _from_experts(y_local, send: list, recv: list, perm, group):
    y_recv = y_local.index_select(0, torch.argsort(perm))                     # back to (src, expert)
    return all_to_all(y_recv, send, recv, group, check=False)                 # (N, d) in x_sorted's order


def to_experts(x_sorted: torch.Tensor, local_expert_count, global_expert_count, group=None):
    """Rows sorted by GLOBAL expert -> the rows this rank's experts run, ordered (local expert, source rank):
    ``(N, ...) -> (N_recv, ...)``, and the local-order permutation used. Differentiable (all_to_all back).
    One all_to_all: its split sizes come from the counts (no size exchange)."""
    world, send, recv = _splits(local_expert_count, global_expert_count, group)
    return _to_experts(x_sorted, send, recv, global_expert_count, local_expert_count.numel() // world, group)


def from_experts(y_local: torch.Tensor, local_expert_count, global_expert_count, group=None, perm=None):
    """Inverse of :func:`to_experts`: expert outputs back to the ranks, and the order, they came from
    (``perm``: the permutation ``to_experts`` returned; recomputed when not given)."""
    world, send, recv = _splits(local_expert_count, global_expert_count, group)
    if perm is None:
        perm = local_order(global_expert_count, local_expert_count.numel() // world).to(y_local.device)
    return _from_experts(y_local, send, recv, perm, group)


def exchange_and_run(layer, x_sorted: torch.Tensor, local_expert_count: torch.Tensor, *, check: bool = True,
                     run=None):
    """Run ``x_sorted`` (rows sorted by GLOBAL expert) through the experts on their ranks: ``(N, d) -> (N, d)``.

    ``local_expert_count``: ``(world_size*num_expert,)`` rows this rank routes to each global expert.
    Every rank of ``layer.moe_group`` must call this for the same layer in the same order (0 rows is fine).
    The agreement check travels with the counts (:func:`check_agreement_and_exchange_counts`): three collectives
    per forward call, checked or not; ``check=False`` exchanges the bare counts (``W*E`` int64 instead of
    ``W*(9 + COUNT_SLOTS)``). ``run(x, counts)`` replaces
    ``layer.run_experts`` (``FMoE`` passes one that unpacks a tree of inputs sent as one tensor).
    """
    group = getattr(layer, "moe_group", None)
    require_process_group(group, what="expert-parallel exchange")
    world, ne = dist.get_world_size(group), int(layer.num_expert)
    if check:                                                                 # checks the counts too
        global_expert_count = check_agreement_and_exchange_counts(layer, x_sorted, local_expert_count, group)
    else:
        _check_counts(local_expert_count, world, ne, x_sorted)
        global_expert_count = exchange_counts(local_expert_count.long(), world, group)  # (W*E,)
    _, send, recv = _splits(local_expert_count, global_expert_count, group)
    x_local, perm = _to_experts(x_sorted, send, recv, global_expert_count, ne, group)  # (N_recv, d)
    fwd_expert_count = global_expert_count.view(world, ne).sum(0)             # (E,) rows per local expert
    run = layer.run_experts if run is None else run
    y_local = run(x_local, fwd_expert_count)                                  # (N_recv, d) by expert
    _record(layer, send, recv, x_sorted)
    return _from_experts(y_local, send, recv, perm, group)                   # (N, d)


def _record(layer, send, recv, x) -> None:
    """Tell the layer's exchange hooks (``labutils.moe.traffic.record_traffic``) what this call sent."""
    for hook in getattr(layer, "exchange_hooks", ()):
        hook(layer, send, recv, x.shape[-1] * x.element_size())


# ---- from one process to W: the parity checks' helper -------------------------------------------------
def shard_state(full_state: dict, rank: int, num_expert: int) -> dict:
    """Rank ``rank``'s share of a single-process layer's ``state_dict`` (or any name -> tensor dict, e.g.
    gradients): experts ``rank*num_expert .. (rank+1)*num_expert-1``, everything else (the gate) as is.

    Fused experts (``experts.htoh4.weight`` of shape ``(E, ...)``) are sliced along dim 0; a ModuleList
    (``experts.<i>.<name>``) is renumbered. Load the result into the ``world_size=W`` layer.
    """
    lo, hi = rank * num_expert, (rank + 1) * num_expert
    out = {}
    for name, t in full_state.items():
        parts = name.split(".")
        if "experts" not in parts:
            out[name] = t
            continue
        at = parts.index("experts")
        if at + 1 < len(parts) and parts[at + 1].isdigit():                  # ModuleList: experts.<i>.*
            i = int(parts[at + 1])
            if lo <= i < hi:
                out[".".join(parts[:at + 1] + [str(i - lo)] + parts[at + 2:])] = t
        else:                                                                 # fused: (E, ...) tensors
            out[name] = t[lo:hi]
    return out
