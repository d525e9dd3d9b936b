"""Chapter 03's exercise cases for the grader (:mod:`labbook.grader`): ``moe_layer_params(num_expert, d_model,
d_hidden)``, the parameter count of an ``FMoETransformerMLP`` with a ``NaiveGate``, from the formula alone. Serves
notebooks/03_transformer_fastmoe.ipynb; red-teamed by tests/test_grader_ch03.py.

The reference builds the real layer on the meta device and counts its tensors (in the grading parent), so it does
not share a formula with the answer; counts are integers and are compared exactly (a count that forgets the router's
32 biases is wrong, although it is within 1e-7 of the answer). The exercise's policy refuses building any layer or
reading a module's parameters: the count must come from the formula."""
from __future__ import annotations

import torch

from labbook.grader.answers import Cases

VISIBLE = ((32, 1024, 4096), (8, 64, 128), (3, 10, 7))     # the book's layer, the tiny preset's, an odd one


def _counted(num_expert: int, d_model: int, d_hidden: int) -> torch.Tensor:
    """The real layer's parameter count: built on the meta device, every tensor's numel summed. () int64."""
    from labutils.moe import FMoETransformerMLP, NaiveGate
    with torch.device("meta"):
        layer = FMoETransformerMLP(num_expert=num_expert, d_model=d_model, d_hidden=d_hidden, gate=NaiveGate)
    return torch.tensor(sum(p.numel() for p in layer.parameters()), dtype=torch.int64)


def _hidden(gen: torch.Generator, i: int) -> tuple:
    """Sizes up to the book's scale and beyond (counts past 2**31 and past float32's exact integers); 2 experts at
    least (the layer routes top-2)."""
    hi = (9, 65, 257, 4097, 16385)[i % 5]
    num_expert = int(torch.randint(2, min(257, max(3, hi // 4)), (1,), generator=gen))   # top-2 needs 2 experts
    d_model, d_hidden = (int(torch.randint(1, hi, (1,), generator=gen)) for _ in range(2))
    return (num_expert, d_model, d_hidden)


CASES = {"moe_layer_params": lambda: Cases(_counted, VISIBLE, _hidden, n_hidden=10)}
