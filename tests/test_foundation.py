"""Presets, parity helpers, parameter counts, plots and exercise checkers."""
import matplotlib
import pytest
import torch
from torch import nn

from labbook.exercises import check_exercise, strip_solution
from labutils import check, cmp, compare_models, count_params, plot_expert_load, plot_losses, plot_param_counts
from labutils.presets import preset_name, select_preset


def test_presets_follow_the_environment(monkeypatch):
    monkeypatch.delenv("LAB_PRESET", raising=False)
    assert select_preset(tiny={"n": 1}, full={"n": 2}, verbose=False).n == 1
    for value in ("full", "book", "FULL"):
        monkeypatch.setenv("LAB_PRESET", value)
        assert select_preset(tiny={"n": 1}, full={"n": 2}, verbose=False).n == 2
    monkeypatch.setenv("LAB_PRESET", "huge")
    with pytest.raises(ValueError, match="not a preset"):
        preset_name()


def test_presets_must_share_knobs():
    with pytest.raises(ValueError, match="only in tiny"):
        select_preset(tiny={"a": 1, "b": 2}, full={"a": 1})


def test_compare_models_reports_the_largest_difference():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    b.load_state_dict(a.state_dict())
    assert compare_models(a, b).ok
    with torch.no_grad():
        b[1].bias[0] += 1e-3
    report = compare_models(a, b, atol=1e-5)
    assert not report.ok and abs(report.max_abs - 1e-3) < 1e-6
    first_row = report.table().splitlines()[2]
    assert first_row.startswith("1.bias") and "DIFFERENT" in first_row
    with pytest.raises(AssertionError, match="1.bias"):
        report.assert_ok()


def test_compare_models_grads_and_missing():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    a(torch.ones(1, 2)).sum().backward()
    assert compare_models(a, b, "grads").missing  # b has no grads yet
    with pytest.raises(ValueError, match="params"):
        compare_models(a, b, "weights")


def test_cmp_and_check(capsys):
    assert cmp("same", torch.ones(3), torch.ones(3))
    assert not cmp("off", torch.ones(3), torch.ones(3) + 1e-3)
    out = capsys.readouterr().out
    assert "exact: True" in out and "approximate: False" in out
    with pytest.raises(AssertionError, match="FAILED: bad"):
        check("bad", False)


def test_count_params_by_category_on_meta():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 8)      # 800
            self.norm = nn.LayerNorm(8)            # 16
            self.attn = nn.MultiheadAttention(8, 2)  # 4*8*8 + 4*8 = 288
            self.gate = nn.Linear(8, 4)            # 36
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # 4 * 72 = 288
            self.head = nn.Linear(8, 3)            # 27

    with torch.device("meta"):
        model = Block()
    counts = count_params(model)
    assert counts.by_category == {"embeddings": 800, "attention": 288, "moe experts": 288, "router/gate": 36,
                                  "norms": 16, "other": 27}
    assert counts.total == 1455 == sum(p.numel() for p in model.parameters())


def test_count_params_counts_shared_weights_once():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, lin)
    assert count_params(model).total == 20


def test_plots_return_figures(tmp_path):
    figs = [plot_losses([3, 2, 1]), plot_losses({"a": [3, 2, 1], "b": [3, 2.5, 2]}, smooth=0.5, logy=True),
            plot_param_counts({"experts": 100, "attention": 10}), plot_expert_load(torch.tensor([5, 1, 3])),
            plot_expert_load(torch.rand(4, 6), normalize=True)]
    for i, fig in enumerate(figs):
        assert isinstance(fig, matplotlib.figure.Figure)
        fig.savefig(tmp_path / f"{i}.png")
        assert (tmp_path / f"{i}.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="smooth"):
        plot_losses([1, 2], smooth=1.0)
    with pytest.raises(ValueError, match="load must be"):
        plot_expert_load(torch.rand(2, 2, 2))


def test_strip_solution_and_checker_fail_on_blank():
    src = "def f(x):\n    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION\n"
    stripped = strip_solution(src)
    assert "x * 2" not in stripped and 'raise NotImplementedError("exercise' in stripped
    namespace = {}
    exec(stripped, namespace)
    with pytest.raises(AssertionError, match="cases wrong .*not a grade"):
        check_exercise("double", namespace["f"], lambda x: x * 2, torch.ones(2))
    check_exercise("double", lambda x: x * 2, lambda x: x * 2, torch.ones(2))
    with pytest.raises(AssertionError, match="1 of 1 cases wrong"):                     # integers exactly
        check_exercise("capacity", lambda n: torch.tensor(n * 1000 + 1), lambda n: torch.tensor(n * 1000), 1000)
    with pytest.raises(ValueError, match="no END"):
        strip_solution("### BEGIN SOLUTION\nx = 1\n")
