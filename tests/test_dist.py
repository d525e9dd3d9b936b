"""labutils.collectives collectives on 2 and 4 gloo workers, forward and backward, against single-process references."""
import pytest
import torch

from labutils.launcher import launch

SIZES = {2: [3, 1], 4: [2, 0, 3, 1]}  # rows per rank: unequal on purpose, one rank with none


def _rank_input(rank, rows, cols=3):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, cols, generator=g, dtype=torch.double)


def _collectives(sizes):
    """Runs on every rank: each distributed result next to its single-process reference."""
    import torch
    import torch.distributed as dist

    from labutils.collectives import (
        all_gather,
        all_gather_same_dim,
        all_gather_variable_dim,
        all_to_all,
        gather_sizes,
        split_by_rank,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [_rank_input(r, n) for r, n in enumerate(sizes)]                   # every rank's input, known to all
    out = {}

    same = all_gather_same_dim(_rank_input(rank, 2))
    out["same_dim"] = torch.stack(same) - torch.stack([_rank_input(r, 2) for r in range(world)])
    out["sizes"] = gather_sizes(xs[rank]) - torch.tensor(sizes)
    got, s = all_gather_variable_dim(xs[rank])
    out["variable_dim0"] = got - torch.cat(xs)
    got1, _ = all_gather_variable_dim(xs[rank].t().contiguous(), dim=1)     # (3, n_r) gathered along dim 1
    out["variable_dim1"] = got1 - torch.cat(xs).t()
    got_given, _ = all_gather_variable_dim(xs[rank], sizes=s)
    out["variable_sizes_given"] = got_given - torch.cat(xs)

    # replicated downstream computation: every rank computes the same loss -> "slice" is the gradient
    weights = torch.linspace(-1, 2, sum(sizes) * 3, dtype=torch.double).view(-1, 3)
    leaves = [x.clone().requires_grad_() for x in xs]
    ((torch.cat(leaves) * weights).sin().sum()).backward()
    x = xs[rank].clone().requires_grad_()
    gathered, _ = all_gather(x, grad="slice")
    ((gathered * weights).sin().sum()).backward()
    out["slice_grad_replicated"] = x.grad - leaves[rank].grad

    # different per-rank losses, total = their sum -> "sum" (reduce-scatter) is the gradient, "slice" is not
    def rank_loss(g, r):
        return (g * weights * (r + 1)).cos().sum()

    leaves = [x.clone().requires_grad_() for x in xs]
    sum(rank_loss(torch.cat(leaves), r) for r in range(world)).backward()
    for mode in ("sum", "slice"):
        x = xs[rank].clone().requires_grad_()
        gathered, _ = all_gather(x, grad=mode)
        rank_loss(gathered, rank).backward()
        out[f"{mode}_grad_per_rank_loss"] = x.grad - leaves[rank].grad

    # all_to_all with a split matrix S[src, dst], forward and backward
    S = torch.tensor([[(src * 3 + dst * 2 + 1) % 4 for dst in range(world)] for src in range(world)])
    ins = [_rank_input(10 + r, int(S[r].sum())) for r in range(world)]
    leaves = [t.clone().requires_grad_() for t in ins]
    blocks = [leaf.split(S[r].tolist()) for r, leaf in enumerate(leaves)]
    refs = [torch.cat([blocks[src][dst] for src in range(world)]) for dst in range(world)]
    sum(((ref * (d + 1)) ** 2).sum() for d, ref in enumerate(refs)).backward()
    t = ins[rank].clone().requires_grad_()
    y = all_to_all(t, S[:, rank].tolist(), S[rank].tolist())
    ((y * (rank + 1)) ** 2).sum().backward()
    out["all_to_all"] = y - refs[rank]
    out["all_to_all_grad"] = t.grad - leaves[rank].grad

    mine, sz = split_by_rank(tuple(xs))
    out["split_by_rank_tuple"] = torch.cat([(mine - xs[rank]).view(-1), (sz - torch.tensor(sizes)).double()])
    stacked = torch.arange(world * 2 * 3, dtype=torch.double).view(world, 2, 3)
    mine, sz = split_by_rank(stacked)
    out["split_by_rank_tensor"] = torch.cat([(mine - stacked[rank]).view(-1), (sz - 2).double()])
    return {k: float(v.abs().max()) if v.numel() else 0.0 for k, v in out.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process(world):
    results = launch(_collectives, world, SIZES[world], timeout=90)
    for rank, diffs in enumerate(results):
        wrong = diffs.pop("slice_grad_per_rank_loss")
        bad = {k: v for k, v in diffs.items() if v > 1e-12}
        assert not bad, f"rank {rank}: differs from the single-process reference: {bad}"
        if SIZES[world][rank]:
            # the slice gradient misses the other ranks' losses: far off, not a rounding difference
            assert wrong > 1e-3, f"rank {rank}: slice gradient should be wrong for per-rank losses ({wrong})"


def _bad_calls():
    import torch

    from labutils.collectives import all_gather, all_gather_variable_dim, all_to_all

    errors = []
    for call in (lambda: all_gather(torch.ones(2, 2), grad="mean"),
                 lambda: all_to_all(torch.ones(3, 2), [1, 1], [1]),
                 lambda: all_to_all(torch.ones(3, 2), [1, 2], [1, 1]),
                 lambda: all_gather_variable_dim(torch.ones(2, 2), sizes=[5, 5])):
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_arguments_raise_clear_errors():
    errors = launch(_bad_calls, 2, timeout=60)[0]
    assert "grad must be 'slice' or 'sum'" in errors[0]
    assert "one entry per rank" in errors[1]
    assert "sum to 2 but x has 3 rows" in errors[2]
    assert "passed sizes=[5, 5] but the ranks hold [2, 2]" in errors[3]


def test_without_process_group_says_how_to_start_one():
    from labutils.collectives import all_gather, all_to_all

    with pytest.raises(RuntimeError, match="labutils.launch"):
        all_gather(torch.ones(2))
    with pytest.raises(RuntimeError, match="labutils.launch"):
        all_to_all(torch.ones(2), [2], [2])


def test_pad_dim_to():
    from labutils.collectives import pad_dim_to

    t = torch.ones(2, 3)
    assert pad_dim_to(t, 4, dim=1).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert pad_dim_to(t, 2, dim=0) is t
    with pytest.raises(ValueError, match="cannot pad"):
        pad_dim_to(t, 1, dim=0)
