"""Ranks agree before data moves: the lab's one cross-rank agreement check. (Taught in chapter 06.)

A collective whose ranks disagree on shapes or dtypes crashes gloo with SIGABRT, reads one dtype's bits as
another's, or hands back rows nobody sent. So before the data moves, every rank all-gathers one small int64 row
describing what it is about to do (:func:`gather_rows`, the one metadata collective), and every rank computes the
same verdict from the same rows: when they disagree, each raises the same error.

* :func:`gather_rows`, :func:`disagreements`, :func:`raise_everywhere`: the mechanism, used by
  ``labutils.collectives`` (``check=True``) and ``labutils.moe.expert_parallel.check_agreement``.
* :data:`DTYPES`, :func:`dtype_code`, :func:`dtype_name`: the one dtype <-> int table the rows use.
* :func:`check_gather`, :func:`check_all_to_all`: the checks of the all-gathers and of ``all_to_all``.
* :func:`check_replicas`: data-parallel replicas hold the same parameters (names, shapes, dtypes, tags, which
  ones have a gradient) before a wrapper reduces them (``labutils.data_parallel``).
* :func:`require_process_group`: the lab's one "is torch.distributed initialised" check.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

MAX_DIMS = 16  # tensors with more dims than this are refused by the checked collectives
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
OK, ZERO_DIM, BAD_DIM, TOO_MANY_DIMS, BAD_SPLITS = range(5)  # a rank's own problem, before any exchange


class CollectiveMismatch(ValueError):
    """Ranks called a collective with inputs that do not fit together; raised on every rank alike."""


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


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as an int every rank maps back alike (its place in :data:`DTYPES`)."""
    if not isinstance(dtype, torch.dtype):
        named = isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
        raise TypeError(f"dtype_code: dtype must be a torch.dtype such as torch.float32, got the "
                        f"{type(dtype).__name__} {dtype!r}" + (f" (pass torch.{dtype})" if named else ""))
    return DTYPES.index(dtype)


def dtype_name(code: int):
    """Inverse of :func:`dtype_code` (a readable placeholder for an unknown code)."""
    return DTYPES[code] if 0 <= code < len(DTYPES) else f"dtype #{code}"


def gather_rows(row: list, like: torch.Tensor, group, *, check_length: bool = True) -> torch.Tensor:
    """Every rank's int64 ``row`` (all of the same length): ``(world, len(row))``. The one metadata collective.

    ``check_length`` (default): first all-gather the rows' lengths (one int each) and raise
    :class:`CollectiveMismatch` on every rank when they differ (gloo would abort the process). The package's own
    callers, whose rows have a length fixed by the group's size, pass ``check_length=False``, so that their good
    path stays at one collective (what ``labutils.moe.traffic`` counts on the wire)."""
    require_process_group(group, what="gather_rows")
    mine = torch.tensor(row, dtype=torch.long, device=like.device)
    if mine.dim() != 1:
        raise ValueError(f"gather_rows: row must be a flat list of ints, got one of shape {tuple(mine.shape)}")
    world = dist.get_world_size(group)
    if check_length:
        lengths = [torch.empty(1, dtype=torch.long, device=like.device) for _ in range(world)]
        dist.all_gather(lengths, torch.tensor([mine.numel()], dtype=torch.long, device=like.device), group=group)
        if len({int(n) for n in lengths}) > 1:
            raise_everywhere("gather_rows", ["ranks passed rows of different lengths: "
                                             + ", ".join(f"rank {r} {int(n)}" for r, n in enumerate(lengths))
                                             + " (every rank must pass a row of the same length)"])
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu()


def disagreements(rows: torch.Tensor, names: list, show: dict | None = None) -> dict:
    """``{name: "name: rank 0=v, rank 1=w"}`` for every column of ``rows`` (``(world, fields)``) where ranks differ,
    in column order; ``show`` maps a field name to how its value prints (default: the int)."""
    if rows.dim() != 2 or len(names) != rows.shape[1]:
        raise ValueError(f"disagreements: names has {len(names)} entries but rows has shape {tuple(rows.shape)}: "
                         f"give one name per column ({rows.shape[-1] if rows.dim() else 0}), rows as (world, "
                         "fields)")
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
    rows = gather_rows([code, dtype_code(t.dtype), t.dim(), size] + _padded(other) + given, t, group,
                       check_length=False)
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
    rows = gather_rows(row, x, group, check_length=False)                 # (W, 3 + MAX_DIMS + 2W)
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


def _digest(items) -> int:
    """A short hash of ``items`` that every rank computes alike (Python's own ``hash`` of str is salted)."""
    return int.from_bytes(hashlib.blake2b(repr(items).encode(), digest_size=8).digest(), "little", signed=True)


def check_replicas(module, tag_of, reduced_over: dict, setup: dict, group, what: str, need_grad: bool,
                   tag_name: str = "tag") -> None:
    """Data-parallel replicas agree before their parameters or gradients move: every rank of ``group`` holds the
    parameters of ``module`` with the same names, shapes, dtypes and tags (``tag_of(p)`` returns ``(tag, problem
    text or "")``), in the same order, the same ``setup`` (settings) and, with ``need_grad``, a gradient for the
    same parameters among the ranks that reduce a parameter over the same group (``reduced_over[tag]``: that
    group's first global rank; -1: not reduced). Good path: one all-gather of five int64 per rank; otherwise every
    rank's parameter list is all-gathered and the same :class:`CollectiveMismatch` raised on every rank, naming the
    ranks and what differs."""
    entries, problems = [], []
    for name, p in module.named_parameters():
        tag, problem = tag_of(p)
        problems += [f"parameter {name!r}: {problem}"] if problem else []
        grad = "" if not need_grad else "requires_grad=False" if not p.requires_grad else \
            "no grad" if p.grad is None else "grad"
        entries.append((name, tuple(p.shape), str(p.dtype), tag, reduced_over.get(tag, -1), grad))
    fingerprint = [BAD_SPLITS if problems else OK, len(entries), _digest([e[:4] for e in entries]),
                   _digest([(e[0], e[5]) for e in entries if e[4] >= 0]), _digest(sorted(setup.items()))]
    rows = gather_rows(fingerprint, next(module.parameters(), torch.empty(0)), group, check_length=False)  # (W, 5)
    if bool((rows == rows[0]).all()) and int(rows[0, 0]) == OK:
        return
    gathered: list = [None] * rows.shape[0]
    dist.all_gather_object(gathered, ("; ".join(problems), entries, setup), group=group)
    ranks = list(range(rows.shape[0])) if group is None else dist.get_process_group_ranks(group)
    problems = _replica_problems(gathered, ranks, tag_name)
    raise_everywhere(what, problems[:12] + [f"... and {len(problems) - 12} more"] * (len(problems) > 12))


def _replica_problems(gathered: list, ranks: list, tag_name: str) -> list:
    problems = [f"rank {r} {p}" for r, (p, _, _) in zip(ranks, gathered) if p]
    if problems:
        return problems
    setups = [s for _, _, s in gathered]
    problems += [f"ranks differ in {key}: " + ", ".join(f"rank {r} {s.get(key)!r}" for r, s in zip(ranks, setups))
                 for key in sorted(set().union(*setups)) if len({repr(s.get(key)) for s in setups}) > 1]
    tables = [{e[0]: e for e in entries} for _, entries, _ in gathered]
    common = [n for n in tables[0] if all(n in t for t in tables)]
    holders: dict = {}
    for name in dict.fromkeys(n for t in tables for n in t):
        if name not in common:
            holders.setdefault(tuple(r for r, t in zip(ranks, tables) if name in t), []).append(name)
    problems += [f"parameters {names} are held by rank{'s' * (len(where) > 1)} {', '.join(map(str, where))} only"
                 for where, names in holders.items()]
    problems += [f"{name!r} {label}: " + ", ".join(f"rank {r} {t[name][i]}" for r, t in zip(ranks, tables))
                 for name in common for label, i in (("shape", 1), ("dtype", 2), (tag_name, 3))
                 if len({str(t[name][i]) for t in tables}) > 1]
    orders = [[n for n in t if n in common] for t in tables]
    for r, order in zip(ranks, orders):
        if not problems and order != orders[0]:
            i = next(i for i, (a, b) in enumerate(zip(order, orders[0])) if a != b)
            problems.append(f"the parameters come in a different order (the flat buffers would add different "
                            f"parameters together): parameter #{i} is {orders[0][i]!r} on rank {ranks[0]}, "
                            f"{order[i]!r} on rank {r}")
    missing = []
    for name in common:
        by_group: dict = {}
        for r, t in zip(ranks, tables):
            if t[name][4] >= 0 and t[name][5]:
                by_group.setdefault(t[name][4], []).append((r, t[name][5]))
        missing += [f"{name!r} gradient: " + ", ".join(f"rank {r} {g}" for r, g in seen)
                    for seen in by_group.values() if len({g for _, g in seen}) > 1]
    hint = (" (the ranks that reduce a parameter must all have a gradient for it: use it in every rank's forward, "
            "or give it a zero gradient)")
    return problems + missing[:-1] + [m + hint for m in missing[-1:]]
