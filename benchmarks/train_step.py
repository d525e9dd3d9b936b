"""One training step of chapter 05's study, dense against MoE, split into phases (issue 26).

    .venv/bin/python benchmarks/train_step.py                  # -> benchmarks/results/train_step.json
    .venv/bin/python benchmarks/train_step.py --rounds 20 --out train_step_quick.json

The models, batch, block, learning rate and thread count are chapter 05's ``full`` preset
(``labutils.lm_study.PRESETS["full"]``): d 64, 2 layers, E 8, top-2, equal active FFN FLOPs, batch 32 x block 64,
Adam, 1 torch thread per run. A step is the study's own (``labutils.train._step``: forward, task loss + aux loss,
``zero_grad``, backward, ``optimizer.step``) on the study's batches (``CharBatches`` over the stdlib corpus).

How it is measured (say it with the numbers):

* THE clock (``labutils.perf.timing.clock``): with 1 torch thread, the calling thread's CPU time, which other
  processes sharing the cores do not inflate (the book machine is shared while this runs; the record keeps
  ``os.getloadavg()`` before and after). On CPU the autograd engine runs the backward on the calling thread.
* Whole steps: dense and MoE interleaved (order alternating per round), each round's MoE/dense ratio; medians
  and quartiles over rounds (paired).
* Phases: NOT the profiler (its wall-clock spans are inflated by the other processes on the cores). Each phase is
  replayed on the tensors of a real training step (each FFN's input captured by a forward hook), forward and
  backward separately (the backward from a graph built on detached leaves, ``retain_graph``), median of many
  repetitions. Per layer, summed over the layers. ``Python overhead`` (MoE) is what the whole step leaves over
  after its phases, the optimizer and the dense model's non-FFN part (attention, embeddings, head, loss: the same
  modules in both models), so it is a difference of medians, not a direct measurement.
* Peak memory of one step (``labutils.perf.timing.peak_memory``: the CPU allocator's events under the profiler),
  above what was allocated when the step began (parameters and Adam's state already exist).
* The optimizer is also timed as ``Adam(foreach=True)`` and ``Adam(fused=True)`` on the same gradients: what
  ``labutils.train`` could save by treating the 90 parameter tensors as groups (it builds the default Adam).
"""
from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from labutils import lm_study  # noqa: E402
from labutils.data import CharBatches  # noqa: E402
from labutils.moe.functions import check_gate_output, count_by_gate, gather_combine, scatter  # noqa: E402
from labutils.perf.timing import clock, machine_info, paired_ratio, peak_memory, quartiles, save_result  # noqa: E402
from labutils.train import _step, lm_cross_entropy  # noqa: E402

MOE_PHASES = ("router", "top-k", "aux loss", "sort/count", "scatter (gather rows)", "experts", "combine")


def median_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on THE clock."""
    tick = clock()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = tick()
        fn()
        times.append(tick() - t0)
    return statistics.median(times)


def leaf(t: torch.Tensor | None):
    return None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())


def fwd_bwd(build, reps: int) -> tuple:
    """(forward s, backward s) of ``build()`` (which returns a tensor built from leaves): the forward as called,
    the backward of a retained graph with a fixed random output gradient."""
    fwd = median_time(build, reps)
    out = build()
    if not out.requires_grad:
        return fwd, 0.0
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    bwd = median_time(lambda: out.backward(grad, retain_graph=True), reps)
    return fwd, bwd


def moe_phases(layer, x: torch.Tensor, reps: int) -> dict:
    """{phase: (forward s, backward s)} of one ``FMoETransformerMLP`` with a ``NoisyGate`` on input ``x`` (T, d)."""
    gate, k = layer.gate, layer.top_k
    x = leaf(x)
    clean, logits, stddev = gate.noisy_logits(x)                                    # (T, E) each
    top_logits, idx, score = gate.top_k_choice(logits)
    gate_idx, gate_score = check_gate_output(idx.reshape(-1), score.unsqueeze(1), x.shape[0], k, layer.tot_expert)
    pos, counts = count_by_gate(gate_idx, layer.num_expert)
    x_sorted = scatter(x, pos, k)                                                   # (N, d)
    y_sorted = layer.run_experts(x_sorted, counts)                                  # (N, d)
    c, lg, sd, tl, sc, xs, ys = (leaf(t) for t in (clean, logits, stddev, top_logits, score, x_sorted, y_sorted))
    return {
        "router": fwd_bwd(lambda: gate.noisy_logits(x)[1], reps),
        "top-k": fwd_bwd(lambda: gate.top_k_choice(lg)[2], reps),
        "aux loss": fwd_bwd(lambda: gate.balance_loss(c, lg, sd, tl, idx, sc), reps),
        "sort/count": fwd_bwd(lambda: count_by_gate(
            check_gate_output(idx.reshape(-1), sc.unsqueeze(1), x.shape[0], k, layer.tot_expert)[0],
            layer.num_expert)[0], reps),
        "scatter (gather rows)": fwd_bwd(lambda: scatter(x, pos, k), reps),
        "experts": fwd_bwd(lambda: layer.run_experts(xs, counts), reps),
        "combine": fwd_bwd(lambda: gather_combine(ys, pos, sc), reps),
    }


def ffn_inputs(model, step) -> list:
    """The ``(T, d)`` input of every block's FFN during one real training ``step()``."""
    seen = []
    hooks = [b.ffn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, a[0].shape[-1])))
             for b in model.blocks]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return seen


def optimizer_times(model, step, lr: float, reps: int) -> dict:
    """Seconds of ``Adam.step()`` (default, foreach, fused) on copies of ``model`` holding one step's gradients."""
    step()  # fills .grad
    out = {}
    for name, kw in (("default", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        m = copy.deepcopy(model)
        for p, q in zip(model.parameters(), m.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        opt = torch.optim.Adam(m.parameters(), lr=lr, **kw)
        with torch.no_grad():
            out[name] = median_time(opt.step, reps)
    return out


def setup(cfg, name: str, corpus, seed: int = 0):
    variant = lm_study.variants(cfg)[name]
    model = lm_study.build(cfg, variant, corpus.vocab_size, seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)  # what labutils.train builds
    data = CharBatches(lm_study.training_text(cfg, corpus), cfg.batch, cfg.block, seed=seed)

    def step():
        _step(model, model, data, lm_cross_entropy, opt, variant.aux_coef, None, False)
    return model, opt, step, variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="interleaved whole-step rounds per model")
    ap.add_argument("--reps", type=int, default=40, help="repetitions of each replayed phase")
    ap.add_argument("--out", default="train_step.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    cfg = lm_study.PRESETS["full"]
    torch.set_num_threads(cfg.threads)
    load_before = os.getloadavg()
    corpus = lm_study.corpus_for(cfg.val_one_in)
    runs = {name: setup(cfg, name, corpus) for name in ("dense", "MoE")}
    for _, _, step, _ in runs.values():
        for _ in range(10):  # warm-up: allocator, Adam state, first-call costs
            step()

    tick = clock()
    times: dict = {"dense": [], "MoE": []}
    for r in range(args.rounds):
        for name in (("dense", "MoE") if r % 2 == 0 else ("MoE", "dense")):
            t0 = tick()
            runs[name][2]()
            times[name].append(tick() - t0)
    ratio, (r_lo, r_hi) = paired_ratio(times["MoE"], times["dense"])  # median of MoE/dense per round

    breakdown: dict = {}
    for name, (model, opt, step, _) in runs.items():
        xs = ffn_inputs(model, step)
        phases: dict = {}
        for x, block in zip(xs, model.blocks):
            ffn = block.ffn
            x = leaf(x)
            parts = (moe_phases(ffn, x, args.reps) if name == "MoE"
                     else {"FFN (fc1, GELU, fc2)": fwd_bwd(lambda f=ffn, x=x: f(x), args.reps)})
            for phase, (f, b) in parts.items():
                acc = phases.setdefault(phase, [0.0, 0.0])
                acc[0] += f
                acc[1] += b
        opt_t = optimizer_times(model, step, cfg.lr, args.reps)
        zero = median_time(lambda o=opt: o.zero_grad(set_to_none=True), args.reps)
        step_median = statistics.median(times[name])
        breakdown[name] = {"phases": {p: {"forward_s": f, "backward_s": b} for p, (f, b) in phases.items()},
                           "optimizer_s": opt_t, "zero_grad_s": zero, "step_median_s": step_median,
                           "step_quartiles_s": quartiles(times[name]),
                           "ffn_s": sum(f + b for f, b in phases.values())}
    dense, moe = breakdown["dense"], breakdown["MoE"]
    rest = dense["step_median_s"] - dense["ffn_s"] - dense["optimizer_s"]["default"] - dense["zero_grad_s"]
    dense["rest_of_model_s"] = rest  # attention, embeddings, head, loss, trainer: the same modules in both models
    moe["python_overhead_s"] = (moe["step_median_s"] - moe["ffn_s"] - moe["optimizer_s"]["default"]
                                - moe["zero_grad_s"] - rest)
    peaks = {name: peak_memory(run[2]) for name, run in runs.items()}
    record = {
        "what": "one training step of chapter 05's full study, dense vs MoE, phases replayed on real step tensors",
        "machine": machine_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "config": {"preset": cfg.name, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "batch": cfg.batch,
                   "block": cfg.block, "num_expert": cfg.num_expert, "top_k": cfg.top_k, "threads": cfg.threads,
                   "lr": cfg.lr, "rounds": args.rounds, "reps": args.reps},
        "step_seconds": times, "moe_over_dense": {"median": ratio, "q1": r_lo, "q3": r_hi},
        "breakdown": breakdown, "peak_bytes": peaks, "peak_moe_over_dense": peaks["MoE"] / peaks["dense"],
    }
    path = save_result(record, ROOT / "benchmarks" / "results" / args.out, root=ROOT)
    report(record)
    print(f"-> {path}")


def report(record: dict) -> None:
    ms = 1e3
    b, r = record["breakdown"], record["moe_over_dense"]
    print(f"{record['machine']['clock']}; load avg {record['load_avg_before'][0]:.1f} -> "
          f"{record['load_avg_after'][0]:.1f} on {record['machine']['cores']} cores")
    print(f"step: dense {b['dense']['step_median_s'] * ms:.2f} ms, MoE {b['MoE']['step_median_s'] * ms:.2f} ms; "
          f"MoE/dense {r['median']:.3f} (paired rounds, quartiles {r['q1']:.3f}-{r['q3']:.3f}, "
          f"n={len(record['step_seconds']['MoE'])})")
    for name in ("dense", "MoE"):
        d = b[name]
        print(f"  {name}:")
        for phase, t in d["phases"].items():
            print(f"    {phase:24s} fwd {t['forward_s'] * ms:6.2f}  bwd {t['backward_s'] * ms:6.2f} ms")
        o = d["optimizer_s"]
        print(f"    {'Adam step':24s} {o['default'] * ms:6.2f} ms (foreach {o['foreach'] * ms:.2f}, fused "
              f"{o['fused'] * ms:.2f}); zero_grad {d['zero_grad_s'] * ms:.2f} ms")
        if "rest_of_model_s" in d:
            print(f"    {'rest of model (by diff.)':24s} {d['rest_of_model_s'] * ms:6.2f} ms")
        if "python_overhead_s" in d:
            print(f"    {'Python overhead (diff.)':24s} {d['python_overhead_s'] * ms:6.2f} ms")
    p = record["peak_bytes"]
    print(f"peak memory of a step: dense {p['dense'] / 2**20:.1f} MiB, MoE {p['MoE'] / 2**20:.1f} MiB "
          f"({record['peak_moe_over_dense']:.2f}x)")


if __name__ == "__main__":
    main()
