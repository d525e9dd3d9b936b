"""Red team for chapter 03's exercise (moe_layer_params): the book's solution and two honest variants pass; the
library, a built layer, pasted library code, a lookup table and near misses fail, each naming the rule it broke."""
import pytest
from redteam import fails, passes, pasted, solution

from labutils.params import count_params

NAME = "moe_layer_params"


def test_the_books_solution_passes():
    report = passes(NAME, solution(NAME))
    assert "all 13 cases match (3 visible, 10 hidden)" in report.text()


@pytest.mark.parametrize("src", [
    """
    def moe_layer_params(num_expert, d_model, d_hidden):
        per_expert = 2 * d_model * d_hidden + d_hidden + d_model      # two linears with biases
        return num_expert * per_expert + num_expert * (d_model + 1)   # + the router's (E, d) weight and E biases
    """,
    """
    import math

    def moe_layer_params(num_expert, d_model, d_hidden):
        total = 0
        for shape in [(num_expert, d_hidden, d_model), (num_expert, d_hidden), (num_expert, d_model, d_hidden),
                      (num_expert, d_model), (num_expert, d_model), (num_expert,)]:
            total += math.prod(shape)
        return torch.tensor(total)
    """,
], ids=["formula-in-python-ints", "shapes-listed"])
def test_honest_variants_pass(src):
    passes(NAME, src)


@pytest.mark.parametrize("src, rule", [
    ("""
    from labutils.moe import FMoETransformerMLP, NaiveGate
    def moe_layer_params(num_expert, d_model, d_hidden):
        return sum(p.numel() for p in FMoETransformerMLP(num_expert, d_model, d_hidden, gate=NaiveGate).parameters())
    """, "import"),
    ("""
    def moe_layer_params(num_expert, d_model, d_hidden):
        layer = torch.nn.Linear(d_model, d_hidden)
        return num_expert * 2 * sum(p.numel() for p in layer.parameters())
    """, "exercise"),
    ("""
    TABLE = {(32, 1024, 4096): 268469280, (8, 64, 128): 132168, (3, 10, 7): 507}
    def moe_layer_params(num_expert, d_model, d_hidden):
        return TABLE[(num_expert, d_model, d_hidden)]
    """, None),
    ("""
    def moe_layer_params(num_expert, d_model, d_hidden):
        return num_expert * (2 * d_model * d_hidden + d_hidden + d_model) + num_expert * d_model   # no router bias
    """, None),
    ("""
    def moe_layer_params(num_expert, d_model, d_hidden):
        return float(num_expert * (2 * d_model * d_hidden + d_hidden + d_model + d_model + 1))     # a float count
    """, None),
], ids=["labutils-layer", "nn.Linear-count", "lookup-table", "router-bias-forgotten", "float-count"])
def test_shortcuts_fail(src, rule):
    fails(NAME, src, rule)


def test_pasted_library_code_is_refused():
    fails(NAME, pasted(count_params, NAME, "count_params(*args)"), says="rule '")
