"""Issue 40: one token dispatcher (labutils/moe/dispatch.py) for every layer, two expert backends (loop, grouped GEMM)
with the same outputs and gradients, and a GPU path that reads nothing on the host, proved on the CPU by counting
host reads (labutils/host_syncs.py) with the grouped backend forced. Negative controls: the loop backend, a path
that calls ``.tolist()``, and garbage rows past the served ones, each caught.

References never import the code they check: the parity reference is a plain loop over tokens and choices.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from threaded_ranks import run_ranks

import labutils.moe.expert_mlp as expert_mlp
from labutils.host_syncs import count_host_syncs
from labutils.moe import FMoETransformerMLP
from labutils.moe.backends import EXPERT_BACKENDS, pick_backend
from labutils.moe.device_path import bincount, device_check, device_path, on_device_path
from labutils.moe.dispatch import dispatch, local
from labutils.moe.gates import NaiveGate
from labutils.moe.modern.layer import ModernMoE

D, H, E = 16, 32, 4           # widths multiples of 4: torch._grouped_mm's 16-byte rule in float32


def _mlp_pair(top_k=2, gate=NaiveGate, seed=0):
    torch.manual_seed(seed)
    loop = FMoETransformerMLP(E, D, H, top_k=top_k, gate=gate, backend="loop")
    grouped = copy.deepcopy(loop)
    grouped.backend = "grouped"
    return loop, grouped


def _fwd_bwd(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum().backward()  # a non-uniform grad
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _by_hand(layer, x):
    """The MLP layer token by token (no labutils code): sum over its choices of score * expert(x)."""
    x2 = x.reshape(-1, D)
    idx, score = layer.gate(x2)
    rows = []
    for t in range(x2.shape[0]):
        acc = torch.zeros(D)
        for e, s in zip(idx[t].tolist(), score[t]):
            if e < 0:
                continue
            ex = layer.experts[e]
            h = F.gelu(x2[t] @ ex.htoh4.weight[0].t() + ex.htoh4.bias[0])
            acc = acc + s * (h @ ex.h4toh.weight[0].t() + ex.h4toh.bias[0])
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


# ---- the backends agree --------------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_backend_equals_the_loop_and_the_token_loop(top_k):
    loop, grouped = _mlp_pair(top_k)
    x = torch.randn(3, 7, D)
    a, b = _fwd_bwd(loop, x), _fwd_bwd(grouped, x)
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-6)
    assert a[2].keys() == b[2].keys() and len(a[2]) == 4 * E + 2
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(a[0], _by_hand(loop, x), rtol=1e-5, atol=1e-6)


class DroppingGate(NaiveGate):
    """NaiveGate that drops every third choice (id -1), as a capacity gate does."""

    def forward(self, x):
        idx, score = super().forward(x)
        drop = torch.arange(idx.numel()).reshape(idx.shape) % 3 == 2
        return idx.masked_fill(drop, -1), score


class _Unwritten(torch.autograd.Function):
    """Rows past ``served`` are NaN forward and backward: what rows a grouped GEMM never wrote may hold."""

    @staticmethod
    def forward(ctx, t, served):
        ctx.save_for_backward(served)
        return torch.where(served[:, None], t, torch.full_like(t, float("nan")))

    @staticmethod
    def backward(ctx, grad):
        (served,) = ctx.saved_tensors
        return torch.where(served[:, None], grad, torch.full_like(grad, float("nan"))), None


def _garbage_past_served(real):
    """grouped_matmul whose rows past the last group are garbage (NaN), in its output and its input's gradient."""
    def mm(x, w, counts):
        served = torch.arange(x.shape[0]) < counts.sum()
        return _Unwritten.apply(real(_Unwritten.apply(x, served), w, counts), served)
    return mm


def test_dropped_choices_on_the_device_path_add_nothing_forward_or_backward(monkeypatch):
    loop, grouped = _mlp_pair(2, DroppingGate)
    x = torch.randn(2, 9, D)
    monkeypatch.setattr(expert_mlp, "grouped_matmul", _garbage_past_served(expert_mlp.grouped_matmul))
    a, b = _fwd_bwd(loop, x), _fwd_bwd(grouped, x)
    for got, want in zip(b[:2], a[:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(a[0], _by_hand(loop, x), rtol=1e-5, atol=1e-6)


def test_negative_control_experts_that_stop_at_the_served_rows_leave_garbage(monkeypatch):
    """The dispatcher hands the dropped rows to the last expert, so no row is left unwritten: give the experts
    only the served counts and the unwritten rows' garbage reaches the gradients."""
    import labutils.moe.dispatch as dispatcher
    loop, grouped = _mlp_pair(2, DroppingGate)
    monkeypatch.setattr(expert_mlp, "grouped_matmul", _garbage_past_served(expert_mlp.grouped_matmul))
    monkeypatch.setattr(dispatcher, "with_sink", lambda counts, rows: counts)     # the last expert stops short
    b = _fwd_bwd(grouped, torch.randn(2, 9, D))
    assert not all(torch.isfinite(g).all() for g in [b[0], b[1], *b[2].values()])


@pytest.mark.parametrize("kw", [dict(), dict(capacity_factor=0.5), dict(score_before_experts=True, n_shared=1),
                                dict(routing="expert", capacity_factor=1.0)], ids=str)
def test_modern_moe_grouped_equals_loop(kw):
    torch.manual_seed(1)
    loop = ModernMoE(D, H, E, 2, impl="loop", **kw)
    grouped = copy.deepcopy(loop)
    grouped.experts.impl = "grouped"
    x = torch.randn(2, 6, D)
    a, b = _fwd_bwd(loop, x), _fwd_bwd(grouped, x)
    for got, want in zip(b[:2], a[:2]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name in a[2]:
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-6, msg=name)


# ---- no host read on the device path -------------------------------------------------------------------------
@pytest.mark.parametrize("top_k", [1, 2])
def test_fmoe_mlp_grouped_forward_and_backward_read_nothing_on_the_host(top_k):
    _, grouped = _mlp_pair(top_k)
    x = torch.randn(4, 8, D, requires_grad=True)
    with count_host_syncs() as syncs:
        grouped(x).square().sum().backward()
    assert syncs.total == 0, syncs.calls
    assert x.grad is not None and all(p.grad is not None for p in grouped.parameters())


MODERN = [dict(), dict(capacity_factor=0.5), dict(balance="batch", z_coef=1e-3),
          dict(balance="sequence", bias_rate=1e-3, score_func="sigmoid", route_norm=True),
          dict(n_shared=1, score_before_experts=True)]


@pytest.mark.parametrize("kw", MODERN, ids=str)
def test_modern_moe_grouped_training_step_reads_nothing_until_its_history_is_read(kw):
    torch.manual_seed(2)
    layer = ModernMoE(D, H, E, 2, impl="grouped", **kw).train()
    x = torch.randn(2, 8, D)
    with count_host_syncs() as syncs:
        (layer(x).square().mean() + layer.router.get_loss()).backward()
    assert syncs.total == 0, syncs.calls
    assert len(layer.history) == 1 and layer.history[0]["counts"].shape == (E,)
    with count_host_syncs() as reading:
        (h,) = layer.read_history()
    assert reading.total > 0                                   # reading it is the one host read, when asked
    assert int(h["counts"].sum()) == round((1 - h["dropped"]) * 16 * 2) and isinstance(h["lse2"], float)


def test_negative_control_the_loop_backend_reads_counts_on_the_host():
    loop, _ = _mlp_pair(2)
    with count_host_syncs() as syncs:
        loop(torch.randn(8, D)).sum().backward()
    assert syncs.counts["Tensor.tolist"] >= 1 and syncs.counts["aten.bincount.default"] >= 1


def test_negative_control_a_tolist_on_the_grouped_path_is_caught(monkeypatch):
    real = expert_mlp.grouped_expert_mlps

    def reads_counts(x, counts, experts, activation):
        counts.tolist()                                          # a debugging print left in, say
        return real(x, counts, experts, activation)
    _, grouped = _mlp_pair(2)
    monkeypatch.setattr("labutils.moe.transformer.grouped_expert_mlps", reads_counts)
    with count_host_syncs() as syncs:
        grouped(torch.randn(8, D)).sum().backward()
    assert syncs.calls == ["Tensor.tolist"]


@pytest.mark.parametrize("what, fn, seen", [
    ("item", lambda t: t.sum().item(), "aten._local_scalar_dense.default"),
    ("int", lambda t: int(t[0]), "aten._local_scalar_dense.default"),
    ("bool", lambda t: bool(t.sum() > 0), "aten._local_scalar_dense.default"),
    ("tolist", lambda t: t.tolist(), "Tensor.tolist"),
    ("cpu", lambda t: t.cpu(), "Tensor.cpu"),
    ("to('cpu')", lambda t: t.to("cpu"), "Tensor.to(cpu)"),
    ("nonzero", lambda t: t.nonzero(), "aten.nonzero.default"),
    ("bool mask", lambda t: t[t > 1], "aten.index.Tensor (bool mask)"),
    ("bincount", lambda t: torch.bincount(t.long()), "aten.bincount.default"),
    ("repeat_interleave", lambda t: torch.repeat_interleave(t.long(), t.long()), "aten.repeat_interleave.Tensor"),
])
def test_count_host_syncs_sees_each_kind_of_host_read(what, fn, seen):
    t = torch.arange(4.0)
    with count_host_syncs() as syncs:
        fn(t)
    assert seen in syncs.calls, (what, syncs.calls)


def test_count_host_syncs_ignores_device_side_work():
    t = torch.arange(4)
    with count_host_syncs() as syncs:
        torch.repeat_interleave(t, t, output_size=6)
        torch._assert_async(t.sum() > 0, "fine")
        torch.zeros(5, dtype=torch.long).scatter_add_(0, t, torch.ones_like(t))
        t.to(t.device)
    assert syncs.total == 0, syncs.calls


# ---- the device path's checks still stop bad input -------------------------------------------------------------
class OutOfRangeGate(NaiveGate):
    def forward(self, x):
        idx, score = super().forward(x)
        return idx.index_fill(0, torch.tensor([1]), E), score      # token 1 routed to expert E: no such expert


def test_device_path_checks_still_stop_bad_ids_and_nan_logits():
    loop, grouped = _mlp_pair(2, OutOfRangeGate)
    with pytest.raises(RuntimeError, match=r"an expert id is outside -1\.\.3"):
        grouped(torch.randn(4, D))
    with pytest.raises(ValueError, match=r"holds expert ids in \[\d, 4\]"):
        loop(torch.randn(4, D))                                  # the host path names the range found
    x = torch.randn(4, D)
    x[2, 0] = float("nan")
    with pytest.raises(RuntimeError, match="gate logits hold NaN or inf"):
        ModernMoE(D, H, E, impl="grouped")(x)
    with pytest.raises(ValueError, match=r"tokens are NaN or inf \(token indices 2\)"):
        ModernMoE(D, H, E, impl="loop")(x)                      # the host path names the token


def test_device_check_and_bincount_on_both_paths():
    ids = torch.tensor([0, 2, 2, 3])
    for on in (False, True):
        with device_path(on):
            assert on_device_path() is on
            assert bincount(ids, 5).tolist() == [1, 0, 2, 1, 0]
            device_check(ids >= 0, lambda: ValueError("never"), "never")
    assert on_device_path() is False
    with pytest.raises(ValueError, match="host says"):
        device_check(ids > 0, lambda: ValueError("host says"), "device says")
    with device_path(), pytest.raises(RuntimeError, match="device says"):
        device_check(ids > 0, lambda: ValueError("host says"), "device says")


def test_pick_backend_by_machine_and_refusals():
    assert pick_backend("auto", "cpu") == "loop" and pick_backend("auto", torch.device("cuda")) == "grouped"
    assert pick_backend("grouped", "cpu") == "grouped" and pick_backend("loop", "cuda") == "loop"
    assert EXPERT_BACKENDS == ("auto", "loop", "grouped")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'loop', 'grouped'\), got 'gpu'"):
        FMoETransformerMLP(E, D, H, backend="gpu")
    with pytest.raises(ValueError, match=r"impl must be one of .* got 'fast'"):
        ModernMoE(D, H, E, impl="fast")
    layer = FMoETransformerMLP(E, D, H, backend="grouped")
    layer.experts[0].htoh4.bias = None                            # no longer the stacked experts it needs
    with pytest.raises(ValueError, match=r"backend='grouped'\) needs its own one-expert _Expert modules"):
        layer(torch.randn(3, D))
    layer.backend = "auto"                                       # auto falls back to the loop instead
    assert layer(torch.randn(3, D)).shape == (3, D)


# ---- the dispatcher itself ---------------------------------------------------------------------------------------
def test_dispatch_score_before_experts_weights_the_inputs():
    torch.manual_seed(3)
    x = torch.randn(5, D)
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, -1]])
    w = torch.rand(5, 2)
    expert_w = torch.randn(E, D, D)

    def run(xs, counts):                                          # expert e: x -> tanh(x @ W_e)
        parts = xs.split(counts.tolist())
        return torch.cat([torch.tanh(p @ expert_w[e]) for e, p in enumerate(parts)])
    for before in (False, True):
        y = dispatch([x], idx, w, lambda xs, c: [local(xs[0], c, run)], num_expert=E, score_before_experts=before)[0]
        want = torch.zeros(5, D)
        for t in range(5):
            for j in range(2):
                e = int(idx[t, j])
                if e >= 0:
                    want[t] += (torch.tanh(w[t, j] * x[t] @ expert_w[e]) if before
                                else w[t, j] * torch.tanh(x[t] @ expert_w[e]))
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


# ---- chapter 07's toy: its expert-parallel path is the dispatcher's all-to-all transport -----------------------------
def _tiny_moe_rank(ref, x):
    import torch.distributed as dist

    from labbook.toys.ch07_moe import ep_copy
    rank = dist.get_rank()
    m = ep_copy(ref, rank, dist.group.WORLD)
    mine = x.chunk(dist.get_world_size())[rank]
    y = m(mine)
    y.square().sum().backward()
    return y.detach(), m.experts[0].w1.weight.grad.clone()


def test_tiny_moe_expert_parallel_equals_its_single_process_reference():
    from labbook.toys.ch07_moe import TinyMoE
    torch.manual_seed(4)
    ref, x = TinyMoE(d=8, h=16, num_experts=2), torch.randn(12, 8)
    out = run_ranks(_tiny_moe_rank, 2, ref, x)
    y = ref(x)
    y.square().sum().backward()                                   # the same loss: a sum over both ranks' rows
    torch.testing.assert_close(torch.cat([o[0] for o in out]), y.detach(), rtol=1e-5, atol=1e-6)
    for rank, (_, grad) in enumerate(out):
        torch.testing.assert_close(grad, ref.experts[rank].w1.weight.grad, rtol=1e-5, atol=1e-6)


# ---- pins for the dispatcher's small pieces (issue 38: each mutant of them is killed here) ------------------------
def test_with_sink_gives_the_last_expert_every_unserved_row():
    from labutils.moe.dispatch import with_sink
    assert with_sink(torch.tensor([2, 0, 1]), 5).tolist() == [2, 0, 3]
    assert with_sink(torch.tensor([1, 1]), 2).tolist() == [1, 1]               # nothing dropped: unchanged
    assert with_sink(torch.tensor([0, 4, 0, 0]), 9).tolist() == [0, 4, 0, 5]


def test_score_before_experts_keeps_the_input_dtype():
    x = torch.randn(4, D, dtype=torch.bfloat16)
    idx, w = torch.tensor([[0], [1], [0], [1]]), torch.rand(4, 1)          # float32 scores, bf16 rows
    seen = []

    def run(xs, counts):
        seen.append(xs[0].dtype)
        return [xs[0]]
    y = dispatch([x], idx, w, run, num_expert=2, score_before_experts=True)[0]
    assert seen == [torch.bfloat16] and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, x * w.to(torch.bfloat16))


def test_expert_parallel_transport_checks_agreement_unless_told_not_to(monkeypatch):
    import labutils.moe.expert_parallel as ep
    from labutils.moe.dispatch import ExpertParallel
    calls = []
    monkeypatch.setattr(ep, "exchange_and_run", lambda layer, x, c, check, run: calls.append(check) or run(x, c))
    x, counts = torch.randn(3, D), torch.tensor([3])
    assert ExpertParallel(object())(x, counts, lambda a, c: a * 2).equal(x * 2)
    ExpertParallel(object(), check=False)(x, counts, lambda a, c: a)
    assert calls == [True, False]


def test_loop_matmul_with_no_expert_gives_an_empty_output_of_the_right_width():
    from labutils.moe.backends import loop_matmul
    y = loop_matmul(torch.randn(0, 4), torch.randn(0, 4, 8), torch.zeros(0, dtype=torch.long))
    assert y.shape == (0, 8) and y.dtype == torch.float32


def test_grouped_matmul_without_the_op_says_which_backend_to_use(monkeypatch):
    from labutils.moe.backends import grouped_matmul
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(RuntimeError, match=r"^torch .* has no torch\._grouped_mm; use the 'loop' backend$"):
        grouped_matmul(torch.randn(2, 4), torch.randn(1, 4, 4), torch.tensor([2]))
