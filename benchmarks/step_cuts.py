"""Cuts tried on MoE's training step (issue 26), each timed against the plain form, side by side.

    .venv/bin/python benchmarks/step_cuts.py               # -> benchmarks/results/step_cuts.json
    .venv/bin/python benchmarks/step_cuts.py --rounds 20   # a quicker look, same record

One MoE layer of chapter 05's ``full`` configuration (2,048 tokens of d 64, 8 experts of hidden 128, top-2,
NoisyGate), 1 torch thread, THE clock (``labbook.perf.timing.clock``: the thread's CPU time). Each cut is a pair
of callables doing the same forward + backward of one part of the layer: ``plain`` (the straightforward form) and
``cut`` (the change tried). Rounds interleave the two (order alternating per round); a cut's number is the
paired median of ``cut / plain`` over rounds with its quartiles (below 1: the cut is faster). Each cut's rounds
run together, after a warm-up of its own. Before timing, each
cut's output and gradients are compared with the plain form's (largest absolute difference recorded).

``adopted`` says whether labutils runs the cut; it is a fact about the code, the ratio is the measurement.
Chapter 08 §10 prints the record.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labbook.perf.timing import clock, clock_name, machine_info, paired_ratio, save_result  # noqa: E402
from labutils.models import make_ffn  # noqa: E402
from labutils.moe.expert_mlp import expert_mlps  # noqa: E402
from labutils.moe.gates import NoisyGate, cv_squared  # noqa: E402

T, D, H, E, K = 2048, 64, 128, 8, 2  # chapter 05's full preset: batch 32 x block 64 tokens


def grads_of(fn, inputs):
    """``(output, grads of inputs)`` of ``fn()`` under a fixed random upstream gradient."""
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach()] + [t.grad.clone() for t in inputs]


def same_computation(name: str, plain, cut, leaves, tol: float = 1e-3) -> float:
    """The largest absolute difference between the two forms' outputs and gradients; above ``tol`` a ValueError
    (not the same computation, so timing it would mean nothing)."""
    a, b = grads_of(plain, leaves), grads_of(cut, leaves)
    if any(p.shape != q.shape for p, q in zip(a, b)):
        raise ValueError(f"{name}: the cut's output or gradient shapes differ from the plain form's")
    diff = max(float((p - q).abs().max()) for p, q in zip(a, b))
    if not diff <= tol:
        raise ValueError(f"{name}: the cut differs from the plain form by {diff:.2e} (tolerance {tol:g}): not the "
                         "same computation, so its time would mean nothing")
    return diff


def gate_step(gate, x, logits_fn=None, top_k_fn=None, balance_fn=None):
    """NoisyGate's forward as its three methods run it (``labutils.moe.gates.NoisyGate.forward``), any of them
    swapped for a cut, reduced to what a training step backpropagates: the task's pull on the scores (a fixed
    quadratic here) plus the balancing loss. The noise is drawn from a fixed seed, so both forms see the same."""
    torch.manual_seed(1)
    clean, logits, stddev = (logits_fn or gate.noisy_logits)(x)                 # (T, E) each
    top_logits, idx, score = (top_k_fn or gate.top_k_choice)(logits)            # (T, k+1), (T, k), (T, k)
    loss = (balance_fn or gate.balance_loss)(clean, logits, stddev, top_logits, idx, score)
    return score.square().sum() + loss.sum()


def gate_cuts(gate) -> dict:
    """The cuts tried inside NoisyGate, each as the method it replaces: ``{name: (plain, cut, adopted)}`` where
    plain and cut are ``(logits_fn, top_k_fn, balance_fn)`` overrides (None: the core's method)."""
    eps = gate.noise_epsilon

    def matmul_logits(x):  # the router before issue 26's cut: x @ w in the weight's stored layout
        clean = x @ gate.w_gate
        stddev = F.softplus(x @ gate.w_noise) + eps
        return clean, clean + torch.randn_like(clean) * stddev, stddev

    def one_matmul_logits(x):  # both router weights in one GEMM, split after
        clean, raw = F.linear(x, torch.cat([gate.w_gate, gate.w_noise], 1).t().contiguous()).split(E, 1)
        stddev = F.softplus(raw) + eps
        return clean, clean + torch.randn_like(clean) * stddev, stddev

    def exp_sum_top_k(logits):  # the softmax over the chosen k as exp / sum (the top logit is the max)
        top_logits, top_idx = logits.topk(K + 1, dim=-1)
        e = (top_logits[:, :K] - top_logits[:, :1]).exp()
        return top_logits, top_idx[:, :K], e / e.sum(-1, keepdim=True)

    def index_add_balance(clean, logits, stddev, top_logits, idx, score):  # importance without a (T, E) buffer
        importance = score.new_zeros(E).index_add(0, idx.reshape(-1), score.reshape(-1))
        load = gate._prob_in_top_k(clean, logits, stddev, top_logits).sum(0)
        return cv_squared(importance) + cv_squared(load)

    return {
        "router matmul x @ w (d, E) in F.linear's layout": ((matmul_logits, None, None), (None, None, None), True),
        "NoisyGate's two router matmuls as one": ((None, None, None), (one_matmul_logits, None, None), False),
        "softmax of the top-k as exp / sum": ((None, None, None), (None, exp_sum_top_k, None), False),
        "importance by index_add instead of a dense scatter": ((None, None, None), (None, None, index_add_balance),
                                                               False),
    }


def cuts(seed: int = 0) -> dict:
    """``{name: (plain fn, cut fn, leaves, adopted)}``: each fn is one forward + backward. The gate's cuts are
    timed on the whole gate (a cut that is faster alone can be slower where its output is used); the experts'
    on the whole expert block."""
    torch.manual_seed(seed)
    layer = make_ffn("fmoe", D, H, num_expert=E, top_k=K, gate=NoisyGate)
    gate = layer.gate
    x = torch.randn(T, D, requires_grad=True)                                   # (T, d)
    table = {}
    for name, (plain, cut, adopted) in gate_cuts(gate).items():
        table[name] = (lambda p=plain: gate_step(gate, x, *p), lambda c=cut: gate_step(gate, x, *c),
                       [x, gate.w_gate, gate.w_noise], adopted)
    with torch.no_grad():
        idx, _ = gate(x)
    idx = idx.view(T, K)                                                        # (T, k)
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
    xs = torch.randn(T * K, D, requires_grad=True)                              # (N, d) expert-contiguous rows
    ex = layer.experts
    act = ex[0].activation
    C = max(counts)
    rows = torch.cat([torch.arange(c) + e * C for e, c in enumerate(counts)])   # (N,) slots in the padded buffer

    def experts_loop():
        return expert_mlps(xs, counts, ex, act)

    def experts_padded_bmm():
        w1 = torch.cat([m.htoh4.weight for m in ex])                            # (E, h, d)
        b1 = torch.cat([m.htoh4.bias for m in ex]).unsqueeze(1)                 # (E, 1, h)
        w2 = torch.cat([m.h4toh.weight for m in ex])                            # (E, d, h)
        b2 = torch.cat([m.h4toh.bias for m in ex]).unsqueeze(1)                 # (E, 1, d)
        xp = xs.new_zeros(E * C, D).index_copy(0, rows, xs).view(E, C, D)       # (E, C, d)
        hid = act(torch.baddbmm(b1, xp, w1.transpose(1, 2)))                    # (E, C, h)
        return torch.baddbmm(b2, hid, w2.transpose(1, 2)).view(E * C, D).index_select(0, rows)  # (N, d)

    table["experts as one padded bmm instead of a loop"] = (
        experts_loop, experts_padded_bmm, [xs] + [p for m in ex for p in m.parameters()], False)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    ap.add_argument("--out", default="step_cuts.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error(f"--rounds must be at least 5 (quartiles of fewer rounds say little), got {args.rounds}")
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    table = cuts()
    diffs = {name: same_computation(name, plain, cut, leaves) for name, (plain, cut, leaves, _) in table.items()}

    def once(fn, leaves):
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(torch.ones_like(out))

    tick = clock()
    times = {name: {"plain": [], "cut": []} for name in table}
    for name, (plain, cut, leaves, _) in table.items():  # one cut at a time: the expert block's memory traffic
        for _ in range(3):                                 # would otherwise leave the next cut's caches cold
            once(plain, leaves)
            once(cut, leaves)
        for r in range(args.rounds):
            for which in (("plain", "cut") if r % 2 == 0 else ("cut", "plain")):
                t0 = tick()
                once(plain if which == "plain" else cut, leaves)
                times[name][which].append(tick() - t0)
    results = {}
    for name, (_, _, _, adopted) in table.items():
        med, (q1, q3) = paired_ratio(times[name]["cut"], times[name]["plain"])
        results[name] = {"cut_over_plain": {"median": med, "q1": q1, "q3": q3}, "adopted": adopted,
                         "max_abs_diff": diffs[name], "seconds": times[name]}
    record = {"what": "cuts tried on MoE's training step: cut / plain form, forward + backward, paired rounds",
              "machine": machine_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "config": {"tokens": T, "d_model": D, "hidden": H, "num_expert": E, "top_k": K, "threads": 1,
                         "rounds": args.rounds, "clock": clock_name()},
              "cuts": results}
    path = save_result(record, ROOT / "benchmarks" / "results" / args.out, root=ROOT)
    for name, res in results.items():
        r = res["cut_over_plain"]
        print(f"{name:52s} cut/plain {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f}); "
              f"{'adopted' if res['adopted'] else 'not adopted'}; max diff {res['max_abs_diff']:.1e}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
