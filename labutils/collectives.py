"""Collectives for expert parallelism. (Taught in chapter 06.)

``all_to_all`` moves rows between ranks with per-rank split sizes and is differentiable: its backward is
the reverse all-to-all (the split sizes swap roles).

The all-gather helpers handle ranks holding different batch sizes (pad to the largest, gather, drop the
padding): ``all_gather_same_dim``, ``gather_sizes``, ``all_gather_variable_dim``, the differentiable
``all_gather`` / ``AllGather`` (gradient: own slice, or summed over ranks) and ``split_by_rank``.

Bad input fails on every rank alike, before any data moves: with ``check=True`` (the default) each of these
first all-gathers one small int64 row per rank (dtype, shape, ``sizes=`` or split sizes) and raises
:class:`CollectiveMismatch` (a ValueError; IndexError for a ``dim`` out of range) naming every rank's value
when they disagree. Without it gloo aborts the process (SIGABRT), reads one dtype's bits as another's or
returns rows nobody sent. ``check=False`` skips that collective where the sizes come from an exchange.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def require_process_group(group=None, world_size: int | None = None, what: str = "this collective") -> None:
    """The one process-group check of the lab: torch.distributed is initialised and, when ``world_size`` is
    given, ``group`` has that many ranks; raises a message naming ``what`` needs it otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs a process group, but torch.distributed is not initialised: run it "
                           "inside labutils.launch(...) workers, or call torch.distributed.init_process_group "
                           "first")
    if world_size is not None and dist.get_world_size(group) != world_size:
        raise ValueError(f"{what}: world_size={world_size}, but the process group has "
                         f"{dist.get_world_size(group)} ranks")


# --------------------------------------------------------------------------------------------------
# agreement checks: one small all_gather of metadata so that bad input fails on EVERY rank, clearly,
# before any data moves (a collective whose ranks disagree on shapes or dtypes crashes gloo with SIGABRT,
# reads one dtype's bits as another's, or hands back uninitialised rows)
# --------------------------------------------------------------------------------------------------
MAX_DIMS = 16  # tensors with more dims than this are refused by the checked collectives
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_OK, _ZERO_DIM, _BAD_DIM, _TOO_MANY_DIMS, _BAD_SPLITS = range(5)


class CollectiveMismatch(ValueError):
    """Ranks called a collective with inputs that do not fit together; raised on every rank alike."""


def _dtype_of(code: int):
    return _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype #{code}"


def _local_problem(t: torch.Tensor, dim: int | None) -> tuple[int, str]:
    """(code, text) of what is wrong with this rank's own input, before any exchange."""
    if dim is not None and t.dim() == 0:
        return _ZERO_DIM, "passed a 0-d tensor (a scalar); gather t.reshape(1) instead"
    if dim is not None and not -t.dim() <= dim < t.dim():
        return _BAD_DIM, f"passed dim={dim}, out of range for a tensor with ndim={t.dim()} " \
                         f"(expected {-t.dim()}..{t.dim() - 1})"
    if t.dim() > MAX_DIMS:
        return _TOO_MANY_DIMS, f"passed a tensor with ndim={t.dim()} (the checked collectives take at most " \
                               f"{MAX_DIMS}; pass check=False)"
    return _OK, ""


def _gather_rows(row: list, like: torch.Tensor, group) -> torch.Tensor:
    """Every rank's int64 ``row`` (all of the same length): ``(world, len(row))``. The one metadata collective."""
    mine = torch.tensor(row, dtype=torch.long, device=like.device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu()


def _raise_everywhere(what: str, problems: list, error: type[Exception] = CollectiveMismatch) -> None:
    """Raise the same message on every rank (each rank computed ``problems`` from the same gathered rows)."""
    if problems:
        raise error(f"{what}: " + "; ".join(problems) + " (raised on every rank before any data moved)")


def _check_gather(t: torch.Tensor, dim: int | None, sizes, group, what: str) -> list:
    """Exchange (problem, dtype, ndim, size along dim, the other dims, given sizes); raise alike on every rank
    when anything disagrees. ``dim=None``: every dim must agree (``all_gather_same_dim``).
    Returns every rank's size along ``dim``."""
    world = dist.get_world_size(group)
    code, text = _local_problem(t, dim)
    given = [-1] * world
    if sizes is not None:
        given_list = [int(s) for s in torch.as_tensor(sizes).reshape(-1).tolist()]
        if len(given_list) != world:
            code, text = _BAD_SPLITS, f"passed sizes= with {len(given_list)} entries for {world} ranks"
        else:
            given = given_list
    ok = code == _OK
    d = (dim % t.dim()) if ok and dim is not None else -1
    shape = list(t.shape) if ok else []
    size = shape[d] if d >= 0 else -1
    other = [s for i, s in enumerate(shape) if i != d]
    row = [code, _DTYPES.index(t.dtype), t.dim(), size] + (other + [-1] * MAX_DIMS)[:MAX_DIMS] + given
    rows = _gather_rows(row, t, group)                                          # (W, 4 + MAX_DIMS + W)
    texts = _gather_texts(text, rows, group)
    problems = [f"rank {r} {texts[r]}" for r in range(world) if rows[r, 0] != _OK]
    errors = {int(rows[r, 0]) for r in range(world)} - {_OK}
    if problems:
        _raise_everywhere(what, problems, IndexError if errors == {_BAD_DIM} else CollectiveMismatch)
    dtypes = [_dtype_of(int(c)) for c in rows[:, 1]]
    if len(set(dtypes)) > 1:
        problems.append("ranks disagree on dtype: " + ", ".join(f"rank {r} {dt}" for r, dt in enumerate(dtypes))
                        + " (every rank must pass the same dtype)")
    others = [tuple(int(s) for s in rows[r, 4:4 + int(rows[r, 2]) - (dim is not None)]) for r in range(world)]
    if len({int(n) for n in rows[:, 2]}) > 1 or len(set(others)) > 1:
        label = "shape" if dim is None else f"the dims other than dim {dim}"
        problems.append(f"ranks disagree on {label}: "
                        + ", ".join(f"rank {r} {list(o)} (ndim {int(rows[r, 2])})" for r, o in enumerate(others)))
    actual = [int(s) for s in rows[:, 3]]
    for r in range(world):
        claimed = [int(s) for s in rows[r, 4 + MAX_DIMS:]]
        if claimed[0] != -1 and claimed != actual:
            problems.append(f"rank {r} passed sizes={claimed} but the ranks hold {actual} along dim {dim}")
    _raise_everywhere(what, problems)
    return actual


def _gather_texts(text: str, rows: torch.Tensor, group) -> list:
    """The ranks' own problem descriptions; a second (object) gather only when some rank has a problem, which
    every rank knows from ``rows``: the good path stays at one collective."""
    if bool((rows[:, 0] == _OK).all()):
        return [""] * rows.shape[0]
    texts: list = [None] * rows.shape[0]
    dist.all_gather_object(texts, text, group=group)
    return texts


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.output_split_sizes, ctx.input_split_sizes, ctx.group = output_split_sizes, input_split_sizes, group
        out = x.new_zeros((sum(output_split_sizes),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_zeros((sum(ctx.input_split_sizes),) + tuple(grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes, input_split_sizes, group=None, *,
               check: bool = True) -> torch.Tensor:
    """Differentiable all-to-all along dim 0.

    ``x`` (sum(input_split_sizes), ...) is cut into pieces of ``input_split_sizes`` rows; piece r goes to
    rank r. Returns (sum(output_split_sizes), ...) holding, in rank order, the rows each rank sent here.

    ``check=True`` first all-gathers every rank's split sizes, dtype and trailing shape (one small int64
    all_gather, ``W * (2W + 19)`` numbers) and raises the same clear error on every rank when rank r expects
    a different number of rows from rank s than s sends it, or the ranks' dtypes or trailing dims differ:
    without it such a call returns rows nobody sent. A hot path whose split sizes come from an exchange
    (``moe.expert_parallel`` derives them from an all_to_all of counts) may pass ``check=False`` to skip
    that extra collective (its cost is one small collective's latency, paid once per call).
    """
    require_process_group(group)
    world = dist.get_world_size(group)
    input_split_sizes = [int(s) for s in input_split_sizes]
    output_split_sizes = [int(s) for s in output_split_sizes]
    problem = ""
    if len(input_split_sizes) != world or len(output_split_sizes) != world:
        problem = (f"split sizes need one entry per rank (world size {world}); got "
                   f"{len(input_split_sizes)} input and {len(output_split_sizes)} output entries")
    elif x.dim() == 0:
        problem = "x is a 0-d tensor; all_to_all cuts rows along dim 0"
    elif sum(input_split_sizes) != x.shape[0]:
        problem = f"input_split_sizes sum to {sum(input_split_sizes)} but x has {x.shape[0]} rows"
    elif min(input_split_sizes + output_split_sizes) < 0:
        problem = f"split sizes must be >= 0, got input {input_split_sizes} and output {output_split_sizes}"
    elif x.dim() > MAX_DIMS and check:
        problem = f"x has ndim={x.dim()} (the checked all_to_all takes at most {MAX_DIMS}; pass check=False)"
    if not check:
        if problem:
            raise ValueError(f"all_to_all: {problem}")
        return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
    _check_all_to_all(x, output_split_sizes, input_split_sizes, problem, group)
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


def _check_all_to_all(x, output_split_sizes, input_split_sizes, problem: str, group) -> None:
    world = dist.get_world_size(group)
    code = _BAD_SPLITS if problem else _OK
    pad = [-1] * world
    sent, expected = (pad, pad) if problem else (input_split_sizes, output_split_sizes)
    trailing = list(x.shape[1:]) if not problem else []
    row = [code, _DTYPES.index(x.dtype), x.dim()] + (trailing + [-1] * MAX_DIMS)[:MAX_DIMS] + sent + expected
    rows = _gather_rows(row, x, group)                                    # (W, 3 + MAX_DIMS + 2W)
    texts = _gather_texts(problem, rows, group)
    problems = [f"rank {r} {texts[r]}" for r in range(world) if rows[r, 0] != _OK]
    _raise_everywhere("all_to_all", problems)
    dtypes = [_dtype_of(int(c)) for c in rows[:, 1]]
    if len(set(dtypes)) > 1:
        problems.append("ranks disagree on dtype: " + ", ".join(f"rank {r} {dt}" for r, dt in enumerate(dtypes)))
    trail = [tuple(int(s) for s in rows[r, 3:3 + int(rows[r, 2]) - 1]) for r in range(world)]
    if len(set(trail)) > 1:
        problems.append("ranks disagree on the dims after dim 0: "
                        + ", ".join(f"rank {r} {list(t)}" for r, t in enumerate(trail)))
    sends = rows[:, 3 + MAX_DIMS:3 + MAX_DIMS + world]                        # sends[s, r]: rows s sends to r
    expects = rows[:, 3 + MAX_DIMS + world:]                                  # expects[r, s]: rows r expects from s
    for r in range(world):
        for s in range(world):
            if int(expects[r, s]) != int(sends[s, r]):
                problems.append(f"rank {r} expects {int(expects[r, s])} rows from rank {s} "
                                f"(output_split_sizes[{s}]) but rank {s} sends it {int(sends[s, r])} "
                                f"(input_split_sizes[{r}])")
    _raise_everywhere("all_to_all", problems)


# --------------------------------------------------------------------------------------------------
# all-gather helpers (after lucidrains/st-moe-pytorch's distributed.py; taught in chapter 06)
# --------------------------------------------------------------------------------------------------
def pad_dim_to(t: torch.Tensor, length: int, dim: int = 0) -> torch.Tensor:
    """Zero-pad ``t`` at the end of ``dim`` up to ``length`` entries."""
    pad = length - t.shape[dim]
    if pad < 0:
        raise ValueError(f"cannot pad dim {dim} of size {t.shape[dim]} down to {length}")
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def all_gather_same_dim(t: torch.Tensor, group=None, *, check: bool = True) -> list:
    """Every rank's ``t`` (all of the same shape and dtype) as a list indexed by rank. Not differentiable.

    ``check=True`` exchanges dtype and shape first (one small all_gather) and raises the same error on every
    rank when they differ; ``check=False`` skips that collective (then a mismatch may crash or hang gloo)."""
    require_process_group(group)
    if check:
        _check_gather(t, None, None, group, "all_gather_same_dim")
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def gather_sizes(t: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """``(world_size,)`` int64: the size of ``dim`` on every rank."""
    code, text = _local_problem(t, dim)
    if code == _ZERO_DIM:
        raise ValueError(f"gather_sizes: this rank {text}")
    if code == _BAD_DIM:
        raise IndexError(f"gather_sizes: this rank {text}")
    size = torch.tensor(t.shape[dim], device=t.device, dtype=torch.long)
    return torch.stack(all_gather_same_dim(size, group, check=False))


def all_gather_variable_dim(t: torch.Tensor, dim: int = 0, sizes=None, group=None, *, check: bool = True):
    """Concatenate every rank's ``t`` along ``dim`` when ranks hold different sizes there.

    Collectives need equal shapes, so: gather the sizes (unless given), pad every rank to the largest,
    all-gather, then drop the padding. Returns ``(gathered, sizes)``; ``gathered`` has ``sum(sizes)``
    entries along ``dim``, rank 0's first. Not differentiable: use :func:`all_gather` for autograd.

    ``check=True`` (default) gathers, in the one collective that gathers the sizes, every rank's dtype, other
    dims and given ``sizes=`` too, and raises the same error on every rank before the data moves when they
    disagree (a 0-d tensor or ``dim`` out of range raise on every rank as well). Cost: one int64 all_gather of
    ``W * (W + 20)`` numbers, which replaces the sizes gather, so it is one extra collective only when
    ``sizes=`` is given. ``check=False`` trusts ``sizes=`` and skips it.
    """
    require_process_group(group)
    if check:
        actual = _check_gather(t, dim, sizes, group, "all_gather_variable_dim")
        dim = dim % t.dim()
        sizes = torch.tensor(actual, dtype=torch.long, device=t.device) if sizes is None else \
            torch.as_tensor(sizes, dtype=torch.long)
    else:
        code, text = _local_problem(t, dim)
        if code != _OK:
            raise (IndexError if code == _BAD_DIM else ValueError)(f"all_gather_variable_dim: this rank {text}")
        dim = dim % t.dim()
        sizes = gather_sizes(t, dim, group) if sizes is None else torch.as_tensor(sizes, dtype=torch.long)
    sizes_list = [int(s) for s in sizes.tolist()]
    if len(sizes_list) != dist.get_world_size(group):
        raise ValueError(f"sizes has {len(sizes_list)} entries for {dist.get_world_size(group)} ranks")
    if sizes_list[dist.get_rank(group)] != t.shape[dim]:
        raise ValueError(f"sizes says this rank holds {sizes_list[dist.get_rank(group)]} entries along dim {dim} "
                         f"but t has {t.shape[dim]}")
    longest = max(sizes_list)
    if all(s == longest for s in sizes_list):
        return torch.cat(all_gather_same_dim(t, group, check=False), dim=dim), sizes
    pieces = all_gather_same_dim(pad_dim_to(t, longest, dim), group, check=False)   # W x (..., longest, ...)
    kept = [p.narrow(dim, 0, s) for p, s in zip(pieces, sizes_list)]                  # drop each rank's padding
    return torch.cat(kept, dim=dim), sizes


class AllGatherFunction(torch.autograd.Function):
    """Autograd all-gather along ``dim`` with per-rank sizes. See :func:`all_gather` for the gradient."""

    @staticmethod
    def forward(ctx, x, dim, sizes, grad, group, check=True):
        gathered, sizes = all_gather_variable_dim(x, dim=dim, sizes=sizes, group=group, check=check)
        sizes = sizes.clone()  # never hand an input back as an output
        ctx.sizes = [int(s) for s in sizes.tolist()]
        ctx.dim, ctx.grad, ctx.group = dim % x.dim(), grad, group
        ctx.mark_non_differentiable(sizes)
        return gathered, sizes

    @staticmethod
    def backward(ctx, grad_gathered, _grad_sizes):
        if ctx.grad == "sum":  # every rank's gradient for my slice, summed: a reduce-scatter
            grad_gathered = grad_gathered.contiguous().clone()
            dist.all_reduce(grad_gathered, group=ctx.group)
        mine = grad_gathered.split(ctx.sizes, dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None, None, None, None


def all_gather(x: torch.Tensor, dim: int = 0, sizes=None, grad: str = "slice", group=None, *, check: bool = True):
    """Differentiable all-gather of ranks holding different sizes along ``dim``: ``(gathered, sizes)``.

    The backward has two correct answers, depending on what happens downstream of the gather:

    * ``grad="slice"`` (lucidrains/st-moe's ``AllGather``): each rank keeps its own slice of ITS gradient.
      Right when the computation after the gather is *replicated*: every rank computes the same function
      of the same gathered tensor and the loss counts it once. Each rank already holds the full gradient
      of the gathered tensor, so its own slice is the gradient of its input. No communication.
    * ``grad="sum"``: the gradient of rank r's slice is the SUM over ranks of each rank's gradient for
      that slice (a reduce-scatter). Right when ranks do *different* things with the gathered tensor
      (each runs different experts on it, or computes its own loss from it) and the total loss is the sum
      of the ranks' losses. Done here as all_reduce + slice, which also works on gloo (no reduce-scatter
      there) and with unequal sizes; it moves W times more than a true reduce-scatter.

    Use "slice" where "sum" is needed and gradients silently lose the other ranks' contributions; use
    "sum" on replicated computation and they come out W times too large. (Taught in chapter 06.)

    ``check``: as in :func:`all_gather_variable_dim` (ranks' dtypes, dims and ``sizes=`` checked on every rank
    before data moves; ``check=False`` skips that collective).
    """
    require_process_group(group)
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
    return AllGatherFunction.apply(x, dim, sizes, grad, group, check)


class AllGather(torch.nn.Module):
    """Module form of :func:`all_gather` (as st-moe's ``AllGather``): ``forward(x, sizes=None)``."""

    def __init__(self, *, dim: int = 0, grad: str = "slice", check: bool = True):
        super().__init__()
        if grad not in ("slice", "sum"):
            raise ValueError(f"grad must be 'slice' or 'sum', not {grad!r}")
        self.dim, self.grad, self.check = dim, grad, check

    def forward(self, x, sizes=None):
        return all_gather(x, self.dim, sizes, self.grad, check=self.check)


def split_by_rank(x):
    """This rank's entry of a per-rank sequence, and every entry's size along dim 0.

    ``x`` is a tuple/list with one tensor per rank (sizes: each tensor's ``shape[0]``) or a tensor whose
    dim 0 is the rank (sizes: ``shape[1]`` for every rank). Returns ``(x[rank], sizes)``.
    """
    require_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(x) != world:
        raise ValueError(f"split_by_rank needs one entry per rank ({world}), got {len(x)}")
    out = x[rank]
    if isinstance(x, (tuple, list)):
        sizes = [t.shape[0] for t in x]
    else:
        sizes = [x.shape[1]] * x.shape[0]
    return out, torch.tensor(sizes, device=out.device, dtype=torch.long)
