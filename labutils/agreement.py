"""Ranks agree before data moves: the lab's one cross-rank agreement check. (Taught in chapter 06.)

A collective whose ranks disagree on shapes or dtypes crashes gloo with SIGABRT, reads one dtype's bits as
another's, or hands back rows nobody sent. So before the data moves, every rank all-gathers one small int64 row
describing what it is about to do (:func:`gather_rows`, the one metadata collective), and every rank computes the
same verdict from the same rows: when they disagree, each raises the same error.

* :func:`gather_rows`, :func:`disagreements`, :func:`raise_everywhere`: the mechanism, used by
  ``labutils.collectives`` (``check=True``) and ``labutils.moe.expert_parallel.check_agreement``.
* :data:`DTYPES`, :func:`dtype_code`, :func:`dtype_name`: the one dtype <-> int table the rows use.
* :func:`check_gather`, :func:`check_all_to_all`: the checks of the all-gathers and of ``all_to_all``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

MAX_DIMS = 16  # tensors with more dims than this are refused by the checked collectives
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
OK, ZERO_DIM, BAD_DIM, TOO_MANY_DIMS, BAD_SPLITS = range(5)  # a rank's own problem, before any exchange


class CollectiveMismatch(ValueError):
    """Ranks called a collective with inputs that do not fit together; raised on every rank alike."""


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as an int every rank maps back alike (its place in :data:`DTYPES`)."""
    return DTYPES.index(dtype)


def dtype_name(code: int):
    """Inverse of :func:`dtype_code` (a readable placeholder for an unknown code)."""
    return DTYPES[code] if 0 <= code < len(DTYPES) else f"dtype #{code}"


def gather_rows(row: list, like: torch.Tensor, group) -> torch.Tensor:
    """Every rank's int64 ``row`` (all of the same length): ``(world, len(row))``. The one metadata collective."""
    mine = torch.tensor(row, dtype=torch.long, device=like.device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu()


def disagreements(rows: torch.Tensor, names: list, show: dict | None = None) -> dict:
    """``{name: "name: rank 0=v, rank 1=w"}`` for every column of ``rows`` (``(world, fields)``) where ranks differ,
    in column order; ``show`` maps a field name to how its value prints (default: the int)."""
    show = show or {}
    return {names[i]: f"{names[i]}: " + ", ".join(f"rank {r}={show.get(names[i], int)(int(v))}"
                                                  for r, v in enumerate(rows[:, i]))
            for i in range(rows.shape[1]) if not bool((rows[:, i] == rows[0, i]).all())}


def raise_everywhere(what: str, problems: list, error: type[Exception] = CollectiveMismatch) -> None:
    """Raise the same message on every rank (each rank computed ``problems`` from the same gathered rows)."""
    if problems:
        raise error(f"{what}: " + "; ".join(problems) + " (raised on every rank before any data moved)")


def local_problem(t: torch.Tensor, dim: int | None) -> tuple[int, str]:
    """(code, text) of what is wrong with this rank's own input, before any exchange."""
    if dim is not None and t.dim() == 0:
        return ZERO_DIM, "passed a 0-d tensor (a scalar); gather t.reshape(1) instead"
    if dim is not None and not -t.dim() <= dim < t.dim():
        return BAD_DIM, f"passed dim={dim}, out of range for a tensor with ndim={t.dim()} " \
                        f"(expected {-t.dim()}..{t.dim() - 1})"
    if t.dim() > MAX_DIMS:
        return TOO_MANY_DIMS, f"passed a tensor with ndim={t.dim()} (the checked collectives take at most " \
                              f"{MAX_DIMS}; pass check=False)"
    return OK, ""


def _gather_texts(text: str, rows: torch.Tensor, group) -> list:
    """The ranks' own problem descriptions; a second (object) gather only when some rank has a problem, which
    every rank knows from ``rows``: the good path stays at one collective."""
    if bool((rows[:, 0] == OK).all()):
        return [""] * rows.shape[0]
    texts: list = [None] * rows.shape[0]
    dist.all_gather_object(texts, text, group=group)
    return texts


def _dtype_problems(codes, hint: str = "") -> list:
    dtypes = [dtype_name(int(c)) for c in codes]
    if len(set(dtypes)) == 1:
        return []
    return ["ranks disagree on dtype: " + ", ".join(f"rank {r} {dt}" for r, dt in enumerate(dtypes)) + hint]


def _padded(dims: list) -> list:
    return (dims + [-1] * MAX_DIMS)[:MAX_DIMS]


def check_gather(t: torch.Tensor, dim: int | None, sizes, group, what: str) -> list:
    """Exchange (problem, dtype, ndim, size along dim, the other dims, given sizes); raise alike on every rank
    when anything disagrees. ``dim=None``: every dim must agree (``all_gather_same_dim``).
    Returns every rank's size along ``dim``."""
    world = dist.get_world_size(group)
    code, text = local_problem(t, dim)
    given = [-1] * world
    if sizes is not None:
        given_list = [int(s) for s in torch.as_tensor(sizes).reshape(-1).tolist()]
        if len(given_list) != world:
            code, text = BAD_SPLITS, f"passed sizes= with {len(given_list)} entries for {world} ranks"
        else:
            given = given_list
    ok = code == OK
    d = (dim % t.dim()) if ok and dim is not None else -1
    shape = list(t.shape) if ok else []
    size = shape[d] if d >= 0 else -1
    other = [s for i, s in enumerate(shape) if i != d]
    rows = gather_rows([code, dtype_code(t.dtype), t.dim(), size] + _padded(other) + given, t, group)
    texts = _gather_texts(text, rows, group)                                    # rows: (W, 4 + MAX_DIMS + W)
    problems = [f"rank {r} {texts[r]}" for r in range(world) if rows[r, 0] != OK]
    errors = {int(rows[r, 0]) for r in range(world)} - {OK}
    if problems:
        raise_everywhere(what, problems, IndexError if errors == {BAD_DIM} else CollectiveMismatch)
    problems += _dtype_problems(rows[:, 1], " (every rank must pass the same dtype)")
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
    raise_everywhere(what, problems)
    return actual


def check_all_to_all(x, output_split_sizes, input_split_sizes, problem: str, group) -> None:
    """Exchange (problem, dtype, ndim, dims after 0, split sizes); raise alike on every rank when rank r expects a
    different number of rows from rank s than s sends it, or dtypes or trailing dims differ."""
    world = dist.get_world_size(group)
    pad = [-1] * world
    sent, expected = (pad, pad) if problem else (input_split_sizes, output_split_sizes)
    trailing = list(x.shape[1:]) if not problem else []
    row = [BAD_SPLITS if problem else OK, dtype_code(x.dtype), x.dim()] + _padded(trailing) + sent + expected
    rows = gather_rows(row, x, group)                                     # (W, 3 + MAX_DIMS + 2W)
    texts = _gather_texts(problem, rows, group)
    problems = [f"rank {r} {texts[r]}" for r in range(world) if rows[r, 0] != OK]
    raise_everywhere("all_to_all", problems)
    problems += _dtype_problems(rows[:, 1])
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
    raise_everywhere("all_to_all", problems)
