"""labbook.diagrams: the chapter diagrams draw from real routings and refuse input they cannot draw."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labbook.diagrams import plot_capacity_dispatch, plot_expert_parallel  # noqa: E402


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_capacity_dispatch_labels_every_kept_slot_and_names_dropped_tokens():
    indices = torch.tensor([[0, 1, -1, 0]])    # (k=1, S=4): token 2 dropped
    locations = torch.tensor([[0, 0, 0, 1]])
    fig = plot_capacity_dispatch(indices, locations, capacity=2, num_experts=2, chosen=torch.tensor([[0, 1, 0, 0]]))
    texts = _texts(fig)
    assert "full: t2 dropped" in texts
    assert "3 of 4 slots used, 1 padding, 1 route(s) dropped" in " ".join(texts)
    plt.close(fig)


def test_capacity_dispatch_bad_input():
    with pytest.raises(ValueError, match="outside the buffer"):
        plot_capacity_dispatch(torch.tensor([[0, 3]]), torch.tensor([[0, 0]]), capacity=2, num_experts=2)
    with pytest.raises(ValueError, match=r"\(k, S\)"):
        plot_capacity_dispatch(torch.tensor([0, 1]), torch.tensor([0, 0]), capacity=2, num_experts=2)


def test_expert_parallel_counts_crossing_routes():
    fig = plot_expert_parallel([torch.tensor([[0, 3]]), torch.tensor([[2, 1], [3, -1]])], num_expert=2)
    # rank 0: 0 stays, 3 crosses; rank 1: 2, 3 stay, 1 crosses
    assert any("5 routes: 2 cross ranks" in t for t in _texts(fig))
    plt.close(fig)
    with pytest.raises(ValueError, match="routes to expert 4"):
        plot_expert_parallel([torch.tensor([[4]]), torch.tensor([[0]])], num_expert=2)
