"""The gates as fastmoe (laekov/fastmoe, fmoe/gates/*.py) computes them, against brute-force loops written here.

Single process, and 2 gloo ranks for the gates that talk across workers (SwitchGate's and DCGate's capacity
over all workers, SwipeGate's exchange), each compared with one process simulating every worker.
Tolerance: 1e-5 absolute and relative for float results (float32 sums in another order); ids exactly.
"""
import math
import warnings

import pytest
import torch

from labutils._deprecate import LabDeprecationWarning
from labutils.launcher import launch
from labutils.moe import (
    DCGate,
    FMoETransformerMLP,
    GShardGate,
    NaiveGate,
    NoisyGate,
    SwipeGate,
    SwitchGate,
    ZeroGate,
    drop_over_capacity,
    limit_by_capacity,
)
from labutils.moe.reference import reference_limit_by_capacity, reference_moe

TOL = dict(rtol=1e-5, atol=1e-5)
D = 8


# ---- brute-force references ---------------------------------------------------------------------------
def loop_top_k(logits, k):
    """(T, k) ids best first and the softmax over their logits, one row at a time."""
    ids, scores = [], []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        top = [row[e] for e in order]
        z = [math.exp(v - max(top)) for v in top]
        ids.append(order)
        scores.append([v / sum(z) for v in z])
    return torch.tensor(ids), torch.tensor(scores)


def loop_capacity(choices, num_expert, caps):
    """Keep a choice while its expert has room. ``choices``: one (T_r, k) list per worker; ``caps[w]``: room of
    each expert on worker w. Priority: worker 0 first, then choice column, then token."""
    load, out = {}, [[list(row) for row in c] for c in choices]
    for r, rows in enumerate(choices):
        for j in range(len(rows[0]) if rows else 0):
            for t, row in enumerate(rows):
                e = row[j]
                if e < 0:
                    continue
                if load.get(e, 0) < caps[e // num_expert]:
                    load[e] = load.get(e, 0) + 1
                else:
                    out[r][t][j] = -1
    return [torch.tensor(o, dtype=torch.long).reshape(len(o), -1) for o in out]


def cv2(values):
    n = len(values)
    if n == 1:
        return 0.0
    mean = sum(values) / n
    return sum((v - mean) ** 2 for v in values) / (n - 1) / (mean ** 2 + 1e-10)


def phi(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def close(a, b):
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), **TOL)


# ---- NaiveGate, NoisyGate, ZeroGate: fastmoe's shapes ---------------------------------------------------
def test_naive_gate_shapes_scores_and_dummy_loss():
    torch.manual_seed(0)
    gate = NaiveGate(D, 3, 2, 3)                           # 6 global experts
    x = torch.randn(11, D)
    idx, score, logits = gate(x, return_all_scores=True)
    want_idx, want_score = loop_top_k(logits.detach(), 3)
    assert idx.shape == (11, 3) and score.shape == (11, 3) and logits.shape == (11, 6)
    assert torch.equal(idx, want_idx) and close(score, want_score)
    loss = gate.get_loss()
    assert loss.shape == (1,) and loss.item() == 0.0 and loss.requires_grad   # fastmoe's dummy loss


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_noisy_gate_matches_loop_in_fastmoe_shapes(train):
    torch.manual_seed(0)
    E, k, T = 5, 2, 9
    gate = NoisyGate(D, E, 1, k).train(train)
    x = torch.randn(T, D)
    torch.manual_seed(1)
    idx, score = gate(x)
    assert idx.shape == (T * k,) and score.shape == (T, 1, k)               # fastmoe: flat ids, (T, 1, k)
    with torch.no_grad():
        clean = (x @ gate.w_gate).tolist()
        sd = (torch.nn.functional.softplus(x @ gate.w_noise) + 0.01).tolist()
    torch.manual_seed(1)
    noise = torch.randn(T, E).tolist()
    importance, load, ids, scores = [0.0] * E, [0.0] * E, [], []
    for t in range(T):
        noisy = [clean[t][e] + (noise[t][e] * sd[t][e] if train else 0.0) for e in range(E)]
        order = sorted(range(E), key=lambda e: -noisy[e])
        top = [noisy[e] for e in order[:k]]
        z = [math.exp(v - top[0]) for v in top]
        w = [v / sum(z) for v in z]
        ids += order[:k]
        scores.append(w)
        for e, g in zip(order[:k], w):
            importance[e] += g
        for e in range(E):
            if not train:
                load[e] += e in order[:k]
            elif noisy[e] > noisy[order[k]]:
                load[e] += phi((clean[t][e] - noisy[order[k]]) / sd[t][e])
            else:
                load[e] += phi((clean[t][e] - noisy[order[k - 1]]) / sd[t][e])
    assert idx.tolist() == ids
    assert close(score[:, 0], scores)
    loss = gate.get_loss()
    assert loss.shape == () and close(loss, cv2(importance) + cv2(load))
    if train:
        loss.backward()
        assert gate.w_noise.grad is not None and gate.w_noise.grad.abs().sum() > 0


def test_noisy_gate_one_expert_loss_has_fastmoe_shape():
    gate = NoisyGate(D, 1, 1, 1)
    idx, score = gate(torch.randn(4, D))
    assert idx.tolist() == [0] * 4 and score.shape == (4, 1, 1)
    assert gate.get_loss().shape == (1,) and gate.get_loss(clear=False) is None


def test_zero_gate_routes_everything_to_expert_zero():
    gate = ZeroGate(D, 2, 1, top_k=2)
    idx, score = gate(torch.randn(5, D))
    assert idx.dtype == torch.int64 and idx.tolist() == [0] * 10
    assert score.shape == (5, 1, 2) and torch.equal(score, torch.full((5, 1, 2), 0.5))
    assert not gate.has_loss


@pytest.mark.parametrize("gate,top_k", [(NoisyGate, 2), (ZeroGate, 2), (SwipeGate, 2), (DCGate, 2)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_layer_with_each_new_gate_matches_reference(gate, top_k):
    """The layer accepts every gate's output shape: the same routing, fed to the per-token loop, agrees."""
    torch.manual_seed(0)
    layer = FMoETransformerMLP(num_expert=4, d_model=D, d_hidden=12, top_k=top_k, gate=gate)
    x = torch.randn(7, D)
    seen = {}
    layer.gate_hook = lambda i, s, _: seen.update(idx=i.clone(), score=s.detach().clone())
    torch.manual_seed(1)
    y = layer(x)
    torch.manual_seed(1)
    idx, score = layer.gate(x)
    assert torch.equal(seen["idx"], idx)                      # gate_hook sees the ids as the gate returned them
    ref = reference_moe(layer, x, idx.reshape(7, top_k), score.reshape(7, top_k))
    assert close(y.detach(), ref.detach())


# ---- capacity: fastmoe's limit_by_capacity and the lab's drop_over_capacity ------------------------------
@pytest.mark.parametrize("capacity", [0, 1, 3, 100])
def test_drop_over_capacity_token_order(capacity):
    torch.manual_seed(capacity)
    idx = torch.randint(-1, 5, (30, 2))
    got = drop_over_capacity(idx, 5, capacity)
    assert torch.equal(got, reference_limit_by_capacity(idx, 5, capacity))
    assert torch.equal(got, loop_capacity([idx.tolist()], 5, [capacity])[0])
    per_expert = torch.tensor([0, 2, 1, 5, 3])
    got = drop_over_capacity(idx, 5, per_expert)
    kept = torch.bincount(got[got >= 0], minlength=5)
    assert torch.equal(kept, torch.minimum(torch.bincount(idx[idx >= 0], minlength=5), per_expert))


def test_limit_by_capacity_one_worker_returns_counts_and_ids():
    torch.manual_seed(0)
    idx = torch.randint(-1, 4, (20, 2))
    lec, gec, new = limit_by_capacity(idx, 4, world_size=1, capacity=3)
    assert torch.equal(new, drop_over_capacity(idx, 4, 3))
    assert torch.equal(lec, torch.bincount(new[new >= 0], minlength=4)) and torch.equal(lec, gec)
    with pytest.warns(LabDeprecationWarning, match=r"limit_by_capacity is deprecated since labutils 0\.3\.0 .*"
                                                    r"drop_over_capacity") as seen:
        old = limit_by_capacity(idx, 4, 3)                    # the 0.2.0 call (gate_idx, tot_expert, capacity)
    assert torch.equal(old, new) and len(seen) == 1
    with pytest.raises(TypeError, match="keywords only"):      # no positional overload: the two forms never mix
        limit_by_capacity(idx, 4, 1, capacity=3)
    with pytest.raises(TypeError, match="positional"):          # fastmoe's positional form is the face's
        limit_by_capacity(idx, 4, 1, 3)
    with pytest.raises(TypeError, match="needs world_size= and capacity="):
        limit_by_capacity(idx, 4, world_size=1)


# ---- SwitchGate ----------------------------------------------------------------------------------------
def switch_reference(logits_per_rank, num_expert, factor):
    """fastmoe's Switch on every worker at once: top-1 of the fp32 softmax, capacity ceil(f*T_owner/ne) per
    expert over all workers, loss after dropping."""
    probs = [torch.softmax(lg.double(), -1) for lg in logits_per_rank]
    choices = [p.argmax(-1)[:, None].tolist() for p in probs]
    caps = [math.ceil(factor * len(c) / num_expert) for c in choices]
    kept = loop_capacity(choices, num_expert, caps)
    losses = []
    for p, k in zip(probs, kept):
        valid = k[k >= 0].tolist()
        E = p.shape[1]
        if not valid:                                      # every token dropped: the lab's loss is 0 (fastmoe: NaN)
            losses.append(0.0)
            continue
        frac = [valid.count(e) / len(valid) for e in range(E)]
        losses.append(sum(frac[e] * float(p[:, e].sum()) / len(valid) for e in range(E)) * E)
    return kept, [p.max(-1).values for p in probs], losses


def test_switch_gate_noise_on_logits_capacity_and_loss_after_drops():
    torch.manual_seed(0)
    E, T, f = 4, 24, 0.5
    gate = SwitchGate(D, E, 1, 1, switch_eps=0.3, capacity=(f, 2 * f))
    x = torch.randn(T, D)
    torch.manual_seed(7)
    idx, score = gate(x)
    torch.manual_seed(7)
    with torch.no_grad():
        noisy = gate.gate(x) + torch.rand(T, E) * 0.6 + 0.7               # U(1-eps, 1+eps) added to the logits
    kept, top_p, losses = switch_reference([noisy], E, f)
    assert idx.shape == (T, 1) and torch.equal(idx, kept[0]) and (idx == -1).any()
    assert close(score[:, 0], top_p[0]) and close(gate.get_loss(), losses[0])
    clean_top = torch.softmax(gate.gate(x).detach(), -1).max(-1).values
    assert not close(score[:, 0], clean_top), "the jitter must change the scores in training"
    # fastmoe's formula differs from the before-drop one (E * sum f_e P_e over all tokens): the test can tell
    p = torch.softmax(noisy, -1)
    before = (torch.bincount(p.argmax(-1), minlength=E) / T * p.mean(0)).sum() * E
    assert not close(before, losses[0])
    gate.eval()                                                           # no noise, eval capacity factor
    idx_eval, _ = gate(x)
    kept, _, losses = switch_reference([gate.gate(x).detach()], E, 2 * f)
    assert torch.equal(idx_eval, kept[0]) and close(gate.get_loss(), losses[0])


# ---- GShardGate ----------------------------------------------------------------------------------------
def gshard_reference(logits, num_expert, world_size, factor, u, cut_first=True):
    """fastmoe's GShard: capacity floor(ceil(f*T)*2/E) on this worker's tokens, THEN random routing
    (drop the 2nd choice where 2*g2 < u); loss mean(c_e m_e) * num_expert**2."""
    T, E = logits.shape
    ids, score = loop_top_k(logits, 2)
    cap = math.ceil(factor * T) * 2 // E
    routed = ids.clone()
    if not cut_first:
        routed[:, 1] = torch.where(2 * score[:, 1] < u, -1, routed[:, 1])
    routed = loop_capacity([routed.tolist()], E, [cap])[0]
    if cut_first:
        routed[:, 1] = torch.where(2 * score[:, 1] < u, -1, routed[:, 1])
    c = [ids[:, 0].tolist().count(e) / T for e in range(E)]
    m = torch.softmax(logits.double(), -1).mean(0).tolist()
    loss = sum(c[e] * m[e] for e in range(E)) / E * num_expert ** 2
    return routed, score, loss


@pytest.mark.parametrize("world_size", [1, 2])
def test_gshard_gate_cut_before_random_routing_and_loss(world_size):
    torch.manual_seed(0)
    ne, T, f = 4 // world_size, 17, 1.0     # 4 global experts; cap floor(ceil(17)*2/4) = 8, not ceil(34/4) = 9
    gate = GShardGate(D, ne, world_size, 2, capacity=(f, 2.0))
    assert gate.capacity_per_expert(T) == 8
    x = torch.randn(T, D)
    torch.manual_seed(3)
    idx, score = gate(x)
    torch.manual_seed(3)
    u = torch.rand(T)
    logits = gate.gate(x).detach()
    want, want_score, want_loss = gshard_reference(logits, ne, world_size, f, u)
    assert torch.equal(idx, want) and close(score, want_score)
    assert close(gate.get_loss(), want_loss)
    other, _, _ = gshard_reference(logits, ne, world_size, f, u, cut_first=False)
    assert not torch.equal(other, want), "random routing before the cut would keep other choices here"


def test_gshard_random_routing_is_on_by_default_also_in_eval():
    torch.manual_seed(0)
    gate = GShardGate(D, 4, 1).eval()
    x = torch.randn(64, D)
    assert gate.random_routing and gate.capacity == (1.2, 2.4)
    torch.manual_seed(1)
    idx, score = gate(x)
    torch.manual_seed(1)
    want, _, _ = gshard_reference(gate.gate(x).detach(), 4, 1, 2.4, torch.rand(64))
    assert torch.equal(idx, want) and (idx[:, 1] == -1).any()
    assert (GShardGate(D, 4, 1, random_routing=False).eval()(x)[0] >= 0).all()  # the switch for a fixed eval


# ---- DCGate and SwipeGate, one worker ------------------------------------------------------------------
def test_dc_gate_one_worker():
    torch.manual_seed(0)
    gate = DCGate(D, 4, 1, capacity=(0.25, 1.0), random_routing=False)
    x = torch.randn(16, D)
    idx, score = gate(x)
    ids, want_score = loop_top_k(gate.gate(x).detach(), 2)
    assert torch.equal(idx, loop_capacity([ids.tolist()], 4, [4])[0]) and (idx == -1).any()  # ceil(0.25*16)
    assert close(score, want_score)


def test_swipe_gate_one_worker_is_the_naive_gate():
    torch.manual_seed(0)
    gate = SwipeGate(D, 4, 1, 2)
    x = torch.randn(10, D)
    ids, want = loop_top_k(gate.gate(x).detach(), 2)
    for train in (True, False):
        idx, score = gate.train(train)(x)
        assert torch.equal(idx, ids) and close(score, want)
    assert not gate.has_loss


# ---- 2 gloo ranks against one process simulating both --------------------------------------------------
def _dist_gates(kind, batches, seed, bias):
    import torch
    import torch.distributed as dist

    from labutils.moe import DCGate, SwipeGate, SwitchGate

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    x_all = torch.randn(sum(batches), D)
    x = x_all[sum(batches[:rank]): sum(batches[:rank + 1])]
    torch.manual_seed(seed + 1)
    if kind == "switch":
        gate = SwitchGate(D, 2, world, 1, switch_eps=0.2, capacity=(0.5, 1.0))
    elif kind == "dc":
        gate = DCGate(D, 2, world, 2, capacity=(0.4, 1.0), random_routing=False)
    else:
        gate = SwipeGate(D, 2, world, 3)
    with torch.no_grad():
        gate.gate.bias.copy_(torch.tensor(bias))          # workers' loads differ: rank 0's experts are popular
    torch.manual_seed(100 + rank)
    idx, score = gate(x)
    loss = gate.get_loss()
    return idx, score.detach(), None if loss is None else loss.detach(), gate.state_dict()


def swipe_reference(choices, num_expert, top_k, room=None):
    """SWIPE on every worker at once, one choice column at a time: each worker accepts incoming choices in
    worker order up to its room; refused choices go, worker by worker, to the first workers with room left,
    to expert ``column % num_expert`` there; the first accepted choices of each (source, destination) stay."""
    W = len(choices)
    room = [len(c) * top_k for c in choices] if room is None else list(room)
    out = [[list(row) for row in c] for c in choices]
    for j in range(top_k):
        accepted = [[0] * W for _ in range(W)]             # [source][destination]
        refused = [0] * W
        for w in range(W):
            for i in range(W):
                n = sum(1 for row in choices[i] if row[j] // num_expert == w)
                accepted[i][w] = min(n, room[w])
                room[w] -= accepted[i][w]
                refused[i] += n - accepted[i][w]
        extra = [[0] * W for _ in range(W)]
        for i in range(W):
            for w in range(W):
                moved = min(refused[i], room[w])
                extra[i][w] += moved
                refused[i] -= moved
                room[w] -= moved
        for i in range(W):
            left = list(accepted[i])
            moved_tokens = []
            for t, row in enumerate(choices[i]):
                w = row[j] // num_expert
                if left[w] > 0:
                    left[w] -= 1
                else:
                    moved_tokens.append(t)
            targets = [w for w in range(W) for _ in range(extra[i][w])]
            for t, w in zip(moved_tokens, targets):
                out[i][t][j] = w * num_expert + j % num_expert
    return [torch.tensor(o) for o in out]


def _one_process_gate(kind, state, tot_expert):
    if kind == "switch":
        gate = SwitchGate(D, tot_expert, 1, 1, switch_eps=0.2)
    elif kind == "dc":
        gate = DCGate(D, tot_expert, 1, 2)
    else:
        gate = SwipeGate(D, tot_expert, 1, 3)
    gate.load_state_dict(state)
    return gate


@pytest.mark.dist
@pytest.mark.parametrize("kind,batches,bias", [
    ("switch", [12, 8], [0.5, 0.3, 0, 0]),
    ("dc", [10, 10], [0.5, 0.3, 0, 0]),
    ("swipe", [9, 9], [1.5, 1.0, 0, 0]),
    ("switch", [7, 9, 5, 8], [0.6, 0.4, 0.2, 0, 0, 0, 0, 0]),
    ("swipe", [6, 6, 6, 6], [2.0, 1.5, 0.5, 0.3, 0, 0, 0, 0]),
])
def test_workers_equal_one_process_simulating_them_all(kind, batches, bias):
    """2 or 4 gloo ranks, 2 experts each, against the loops above fed every rank's logits."""
    seed, W = 3, len(batches)
    results = launch(_dist_gates, W, kind, batches, seed, bias, timeout=120)
    torch.manual_seed(seed)
    xs = torch.randn(sum(batches), D).split(batches)
    for r in range(1, W):                                                # replicated gate
        assert close(results[0][3]["gate.weight"], results[r][3]["gate.weight"])
    gate = _one_process_gate(kind, results[0][3], 2 * W)
    with torch.no_grad():
        logits = [gate.gate(x) for x in xs]
    if kind == "switch":
        noisy = []
        for r, lg in enumerate(logits):
            torch.manual_seed(100 + r)
            noisy.append(lg + torch.rand(lg.shape) * 0.4 + 0.8)
        want, top_p, losses = switch_reference(noisy, 2, 0.5)
        caps = [math.ceil(0.5 * b / 2) for b in batches]
        local_only = [loop_capacity([lg.argmax(-1)[:, None].tolist()], 2, caps)[0] for lg in noisy]
        for r in range(W):
            idx, score, loss, _ = results[r]
            assert torch.equal(idx, want[r]), f"rank {r}"
            assert close(score[:, 0], top_p[r]) and close(loss, losses[r])
        assert any(not torch.equal(want[r], local_only[r]) for r in range(W)), \
            "the data must make the capacity over ALL workers matter"
    elif kind == "dc":
        choices = [loop_top_k(lg, 2)[0].tolist() for lg in logits]
        want = loop_capacity(choices, 2, [math.ceil(0.4 * b) for b in batches])
        assert any((w == -1).any() for w in want)
        for r in range(W):
            assert torch.equal(results[r][0], want[r]), f"rank {r}"
            assert close(results[r][1], loop_top_k(logits[r], 2)[1])
    else:
        choices = [loop_top_k(lg, 3)[0].tolist() for lg in logits]
        want = swipe_reference(choices, 2, 3)
        assert any(not torch.equal(want[r], torch.tensor(choices[r])) for r in range(W)), "the test needs swipes"
        for r in range(W):
            idx, score, loss, _ = results[r]
            assert torch.equal(idx, want[r]), f"rank {r}"
            vals = torch.gather(logits[r], 1, want[r])
            assert close(score, torch.softmax(vals, -1)) and loss is None


def test_two_worker_gates_need_a_process_group():
    x = torch.randn(4, D)
    for gate in (SwitchGate(D, 2, 2, 1), DCGate(D, 2, 2), SwipeGate(D, 2, 2)):
        # no process group (the usual case), or a one-rank group an earlier test in this process left behind
        with pytest.raises((RuntimeError, ValueError), match="not initialised|the process group has 1 ranks"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gate(x)


def _layer_with_gate(gate_name, top_k):
    import torch
    import torch.distributed as dist

    import labutils.moe as moe

    torch.manual_seed(0)
    layer = moe.FMoETransformerMLP(num_expert=2, d_model=D, d_hidden=12, world_size=dist.get_world_size(),
                                   top_k=top_k, gate=getattr(moe, gate_name))
    seen = []
    layer.gate_hook = lambda i, s, _: seen.append(i.clone())
    torch.manual_seed(10 + dist.get_rank())
    x = torch.randn(6 + 3 * dist.get_rank(), D, requires_grad=True)
    y = layer(x)
    (y.sum() + moe.collect_aux_loss(layer)).backward()
    return tuple(y.shape), seen[0], x.grad is not None and bool(torch.isfinite(x.grad).all())


@pytest.mark.dist
def test_gates_that_talk_across_workers_run_inside_an_expert_parallel_layer():
    """The gates' count exchanges and the layer's token exchange interleave without a hang or a mismatch."""
    for name, k in [("SwitchGate", 1), ("DCGate", 2), ("SwipeGate", 2)]:
        for rank, (shape, idx, grad_ok) in enumerate(launch(_layer_with_gate, 2, name, k, timeout=90)):
            assert shape == (6 + 3 * rank, D) and grad_ok, (name, rank)
            assert idx.shape == (6 + 3 * rank, k) and int(idx.max()) < 4, (name, rank)


def test_naive_gate_with_its_linear_swapped_out_takes_logits():
    """Chapter 01's exercise feeds logits straight in (``gate.gate = nn.Identity()``): no d_model check then."""
    gate = NaiveGate(1, 6, 1, 2)
    gate.gate = torch.nn.Identity()
    logits = torch.randn(5, 6)
    idx, score = gate(logits)
    want_idx, want_score = loop_top_k(logits, 2)
    assert torch.equal(idx, want_idx) and close(score, want_score)


# ---- fastmoe's own gate tests (tests/test_gates.py, test_swipe.py), their checks and sizes, on CPU ----------
@pytest.mark.parametrize("n_expert,cap", [(4, 0.1), (4, 1.1)])
def test_fastmoe_test_gshard_gate_checks(n_expert, cap):
    torch.manual_seed(0)
    gate = GShardGate(1024, n_expert, 1, capacity=(cap, cap))
    x = torch.rand(16, 1024)
    topk_idx, topk_val = gate(x)
    counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=n_expert)
    assert int(counts.max()) <= math.ceil(cap * 16)
    want = torch.softmax(torch.topk(gate.gate(x), k=2, dim=-1).values, dim=-1)
    kept = topk_idx != -1
    assert torch.equal(topk_val[kept], want[kept])


@pytest.mark.parametrize("n_expert,cap", [(1, 0.1), (1, 0.8), (16, 0.1), (16, 0.8)])
def test_fastmoe_test_switch_gate_checks(n_expert, cap):
    torch.manual_seed(0)
    gate = SwitchGate(1024, n_expert, 1, capacity=(cap, cap))
    x = torch.rand(4096, 1024)
    rng = torch.get_rng_state()
    topk_idx, topk_val = gate(x)
    counts = torch.bincount(topk_idx[topk_idx >= 0], minlength=n_expert)
    assert int(counts.max()) <= math.ceil(cap * 4096)
    score = gate.gate(x)
    torch.set_rng_state(rng)                            # the same noise as in the forward
    noise = torch.rand_like(score) * 2 * gate.switch_eps + 1.0 - gate.switch_eps
    score = torch.softmax((score + noise).float(), -1)
    kept = topk_idx[:, 0] != -1
    assert torch.equal(topk_val[kept, 0], score[kept].gather(1, topk_idx[kept])[:, 0])


def _swipe_once_twice(batch_size, n_expert):
    import torch
    import torch.distributed as dist

    from labutils.moe import SwipeGate

    world = dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    gate = SwipeGate(4, n_expert, world)
    out = []
    capacity = torch.tensor(batch_size * 2, dtype=torch.long)
    for _ in range(2):
        idx = torch.randint(0, n_expert * world, (batch_size,))
        new_idx, capacity = gate.swipe_once(idx, capacity, 0)
        out.append((idx, new_idx, int(capacity)))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world,n_expert", [(2, 1), (2, 4), (4, 1)])
def test_fastmoe_test_swipe_once(world, n_expert):
    """fastmoe's test only runs swipe_once twice; here also: no worker receives more than its capacity, a choice
    keeps its worker or moves to local expert 0 of another, and the ranks agree with the one-process loop."""
    results = launch(_swipe_once_twice, world, 16, n_expert, timeout=90)
    room = [32] * world
    for step in range(2):
        want = swipe_reference([results[r][step][0][:, None].tolist() for r in range(world)], n_expert, 1, room)
        received = [0] * world
        for r in range(world):
            idx, new, _ = results[r][step]
            assert torch.equal(new, want[r][:, 0]), (step, r)
            moved = new != idx
            assert (new[moved] % n_expert == 0).all()
            for e in new.tolist():
                received[e // n_expert] += 1
        for w in range(world):
            room[w] -= received[w]
            assert room[w] >= 0 and results[w][step][2] == room[w], (step, w)


def test_router_logits_is_x_at_w_up_to_rounding():
    """``router_logits`` (NoisyGate's matmul in the GEMM's fast layout) is ``x @ w``: values and both gradients
    within float32 rounding; a different weight is caught (negative control)."""
    from labutils.moe.gates import router_logits
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=gen, requires_grad=True)        # (T, d)
    w = torch.randn(64, 8, generator=gen, requires_grad=True)           # (d, E), fastmoe's layout
    g = torch.randn(2048, 8, generator=gen)                             # (T, E)
    mine = router_logits(x, w)
    (gx, gw) = torch.autograd.grad(mine, (x, w), g)
    ref = x @ w
    (rx, rw) = torch.autograd.grad(ref, (x, w), g)
    for a, b in ((mine, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    assert mine.shape == (2048, 8) and mine.is_contiguous()
    w2 = w.detach().clone()
    w2[0, 0] += 1e-2
    assert not torch.allclose(router_logits(x, w2), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"w must be \(d_model, E\).*x of shape \(2048, 64\) and w of shape \(8, 64\)"):
        router_logits(x, w.detach().t())                                  # nn.Linear's (E, d) layout
    with pytest.raises(TypeError, match="two tensors, got Tensor and list"):
        router_logits(x, [[0.0] * 8] * 64)
