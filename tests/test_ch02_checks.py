"""Chapter 02's checks read what they check (issue 38): the dispatch picture is read back from its labels, so
a picture that puts a token in the wrong slot fails cell 4's literal layout."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from labbook.diagrams import plot_capacity_dispatch, read_dispatch  # noqa: E402


def test_read_dispatch_returns_the_slot_of_every_kept_route():
    indices = torch.tensor([[0, 1, -1, 0, 0]])        # (k=1, S=5): token 2 dropped
    locations = torch.tensor([[1, 0, 0, 0, 2]])       # expert 0 holds t3, t0, t4 in slots 0, 1, 2
    fig = plot_capacity_dispatch(indices, locations, capacity=3, num_experts=2, chosen=torch.tensor([[0, 1, 0, 0, 0]]))
    assert read_dispatch(fig) == {(0, 0): 3, (0, 1): 0, (0, 2): 4, (1, 0): 1}
    plt.close(fig)


def test_read_dispatch_reads_second_choices_too():
    indices = torch.tensor([[0, 1, 0], [1, 0, -1]])   # (k=2, S=3)
    locations = torch.tensor([[0, 0, 1], [1, 2, 0]])
    fig = plot_capacity_dispatch(indices, locations, capacity=3, num_experts=2)
    assert read_dispatch(fig) == {(0, 0): 0, (0, 1): 2, (0, 2): 1, (1, 0): 1, (1, 1): 0}
    plt.close(fig)


def test_read_dispatch_sees_a_picture_with_its_slots_reversed():
    """What the chapter's fault 'the dispatch picture draws every expert's slots in reverse order' plants: the labels
    move, so the read-back differs from the routing the picture was given."""
    indices, locations = torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 0]])
    fig = plot_capacity_dispatch(indices, locations, capacity=2, num_experts=2)
    truth = read_dispatch(fig)
    plt.close(fig)
    reversed_fig = plot_capacity_dispatch(indices, 1 - locations, capacity=2, num_experts=2)
    assert read_dispatch(reversed_fig) != truth == {(0, 0): 0, (0, 1): 1, (1, 0): 2}
    plt.close(reversed_fig)


def test_read_dispatch_refuses_another_figure():
    fig, ax = plt.subplots()
    ax.text(0, 0, "t0")
    with pytest.raises(ValueError, match="not a plot_capacity_dispatch figure"):
        read_dispatch(fig)
    plt.close(fig)
