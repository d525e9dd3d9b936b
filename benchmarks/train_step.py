"""One training step of chapter 05's study, dense against MoE, split into phases (issue 26).

    .venv/bin/python benchmarks/train_step.py                  # -> benchmarks/results/train_step.json
    .venv/bin/python benchmarks/train_step.py --rounds 20 --out train_step_quick.json

The models, batch, block, learning rate and thread count are chapter 05's ``full`` preset
(``labbook.lm_study.config.PRESETS["full"]``): d 64, 2 layers, E 8, top-2, equal active FFN FLOPs, batch 32 x block 64,
Adam, 1 torch thread per run. A step is the study's own (``labutils.train._step``: forward, task loss + aux loss,
``zero_grad``, backward, ``optimizer.step``) on the study's batches (``CharBatches`` over the stdlib corpus).

How it is measured (say it with the numbers):

* THE clock (``labbook.perf.timing.clock``): with 1 torch thread, the calling thread's CPU time, which other
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
* Peak memory of one step (``labbook.perf.timing.peak_memory``: the CPU allocator's events under the profiler),
  above what was allocated when the step began (parameters and Adam's state already exist).
* Both models step with the study's optimizer (``lm_study.config.optimizer``: fused Adam; ``--adam`` picks another).
  Adam's step is also timed alone as torch's default loop, ``foreach=True`` and ``fused=True`` on the same
  gradients: what treating the MoE's 90 parameter tensors as one group saves.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# --labutils=DIR: import the package from another tree, e.g. the core before a change
# (``git archive <commit> labutils | tar -x -C DIR``); with --steps-only, its whole steps against the same dense.
OTHER = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--labutils=")), None)
if OTHER:
    sys.path.insert(0, OTHER)

import torch  # noqa: E402

from labbook.lm_study import config, runner  # noqa: E402
from labbook.perf.timing import clock, clock_name, machine_info, paired_ratio, peak_memory, quartiles, save_result  # noqa: E402
from labutils.data import CharBatches  # noqa: E402
from labutils.moe.gates import collect_aux_loss  # noqa: E402
from labutils.train import _step, lm_cross_entropy  # noqa: E402


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


class PhaseClock:
    """Per-phase CPU time inside real training steps.

    Forward: the phase's functions are wrapped (:meth:`labelled`), each call timed on THE clock. Every autograd
    node a phase creates has a sequence number between the two read at its start and end (:meth:`seq`), so after
    the forward the graph is walked from the loss and each node gets a pre-hook and a hook that charge its
    backward to that phase (nodes of no phase: ``rest``). The hooks are Python calls (a few us per node), so the
    instrumented step is slower than a plain one; both are reported.
    """

    def __init__(self):
        self.tick = clock()
        self.fwd: dict = {}
        self.bwd: dict = {}
        self.ranges: list = []
        self.active = None

    @staticmethod
    def seq() -> int:
        """The autograd sequence number the next node will get (this probe takes one)."""
        return (torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr() + 1  # pyright: ignore

    def labelled(self, fn, phase: str):
        def timed(*args, **kwargs):
            if self.active is not None:              # nested: the outer phase owns it
                return fn(*args, **kwargs)
            self.active, lo, t0 = phase, self.seq(), self.tick()
            try:
                return fn(*args, **kwargs)
            finally:
                self.fwd[phase] = self.fwd.get(phase, 0.0) + self.tick() - t0
                self.ranges.append((lo, self.seq(), phase))
                self.active = None
        return timed

    def phase_of(self, node) -> str:
        nr = node._sequence_nr()
        return next((p for lo, hi, p in self.ranges if lo <= nr < hi), "rest")

    def hook_backward(self, loss: torch.Tensor) -> None:
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
            phase, start = self.phase_of(node), []
            node.register_prehook(lambda g, start=start: start.append(self.tick()))
            node.register_hook(lambda gi, go, start=start, phase=phase: self.bwd.__setitem__(
                phase, self.bwd.get(phase, 0.0) + self.tick() - start.pop()))


@contextlib.contextmanager
def phases_labelled(pc: PhaseClock):
    """Wrap the MoE core's steps (the gate's three pieces, count/sort, scatter, experts, combine) and the dense
    MLP's forward in ``pc.labelled`` for the duration of the block."""
    from labutils.models import DenseMLP
    from labutils.moe import dispatch, layers
    from labutils.moe.gates import NoisyGate

    targets = [(NoisyGate, "noisy_logits", "router"), (NoisyGate, "top_k_choice", "top-k"),
               (NoisyGate, "balance_loss", "aux loss"), (layers, "check_gate_output", "sort/count"),
               (dispatch, "count_by_gate", "sort/count"), (dispatch, "scatter", "scatter (gather rows)"),
               (layers.FMoE, "expert_exchange", "experts"), (dispatch, "gather_combine", "combine"),
               (DenseMLP, "forward", "FFN (fc1, GELU, fc2)")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, phase in targets:
        setattr(owner, name, pc.labelled(getattr(owner, name), phase))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def instrumented_steps(model, opt, data, variant, steps: int) -> dict:
    """Per-phase medians over ``steps`` real training steps (the study's step, written out so the backward
    can be hooked between forward and backward)."""
    per_step: dict = {}
    tick = clock()
    for _ in range(steps):
        pc = PhaseClock()
        t0 = tick()
        with phases_labelled(pc):
            x, y = data.next_batch()
            task = lm_cross_entropy(model(x), y)
            loss = task + variant.aux_coef * collect_aux_loss(model, clear=True)
            task.item(), float(loss.detach())
        t1 = tick()
        pc.hook_backward(loss)
        t2 = tick()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = tick()
        opt.step()
        t4 = tick()
        rows = {f"{p} fwd": v for p, v in pc.fwd.items()} | {f"{p} bwd": v for p, v in pc.bwd.items()}
        rows |= {"forward total": t1 - t0, "backward total": t3 - t2, "optimizer (Adam)": t4 - t3,
                 "instrumented step": (t1 - t0) + (t4 - t2)}
        rows["rest fwd"] = rows["forward total"] - sum(pc.fwd.values())
        for k, v in rows.items():
            per_step.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per_step.items()}


def optimizer_times(model, step, lr: float, reps: int) -> dict:
    """Seconds of ``Adam.step()`` (default, foreach, fused) on copies of ``model`` holding one step's gradients."""
    step()  # fills .grad
    out = {}
    for name, kw in ADAM.items():
        m = copy.deepcopy(model)
        for p, q in zip(model.parameters(), m.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
        opt = torch.optim.Adam(m.parameters(), lr=lr, **kw)
        with torch.no_grad():
            out[name] = median_time(opt.step, reps)
    return out


ADAM = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def setup(cfg, name: str, corpus, seed: int = 0, adam: str = "study"):
    variant = config.variants(cfg)[name]
    model = config.build(cfg, variant, corpus.vocab_size, seed)
    if adam == "study":
        opt = config.optimizer(cfg, model)                          # what the study trains with
    else:
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, **ADAM[adam])
    data = CharBatches(runner.training_text(cfg, corpus), cfg.batch, cfg.block, seed=seed)

    def step():
        _step(model, model, data, lm_cross_entropy, opt, variant.aux_coef, None, False)
    return model, opt, step, variant, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60, help="interleaved whole-step rounds per model")
    ap.add_argument("--reps", type=int, default=40, help="repetitions of each optimizer variant")
    ap.add_argument("--phase-steps", type=int, default=30, help="instrumented steps per model (phase medians)")
    ap.add_argument("--out", default="train_step.json", help="file name under benchmarks/results/")
    ap.add_argument("--labutils", help="=DIR: the labutils package of another tree (see the top of this file)")
    ap.add_argument("--steps-only", action="store_true", help="whole steps only: print, record nothing")
    ap.add_argument("--adam", choices=sorted(ADAM) + ["study"], default="study",
                    help="both models' Adam: the study's (lm_study.config.optimizer: fused) or one of torch's variants")
    args = ap.parse_args()
    cfg = config.PRESETS["full"]
    torch.set_num_threads(cfg.threads)
    load_before = os.getloadavg()
    corpus = runner.corpus_for(cfg.val_one_in)
    runs = {name: setup(cfg, name, corpus, adam=args.adam)
            for name in ("dense", "MoE")}
    for step in (run[2] for run in runs.values()):
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
    if args.steps_only:
        import labutils
        print(f"{labutils.__file__} (Adam {args.adam}): dense {statistics.median(times['dense']) * 1e3:.2f} ms, MoE "
              f"{statistics.median(times['MoE']) * 1e3:.2f} ms; MoE/dense {ratio:.3f} ({r_lo:.3f}-{r_hi:.3f}, "
              f"{args.rounds} paired rounds; {clock_name()}; load avg {os.getloadavg()[0]:.1f})")
        return

    breakdown: dict = {}
    for name, (model, opt, step, variant, data) in runs.items():
        phases = instrumented_steps(model, opt, data, variant, args.phase_steps)
        breakdown[name] = {"phases_s": phases, "adam_variants_s": optimizer_times(model, step, cfg.lr, args.reps),
                           "step_median_s": statistics.median(times[name]),
                           "step_quartiles_s": quartiles(times[name])}
    peaks = {name: peak_memory(run[2]) for name, run in runs.items()}
    record = {
        "what": "one training step of chapter 05's full study, dense vs MoE, phases timed inside real steps",
        "machine": machine_info(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "config": {"preset": cfg.name, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "batch": cfg.batch,
                   "block": cfg.block, "num_expert": cfg.num_expert, "top_k": cfg.top_k, "threads": cfg.threads,
                   "lr": cfg.lr, "rounds": args.rounds, "reps": args.reps, "phase_steps": args.phase_steps},
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
    print(f"phases inside real steps (medians over {record['config']['phase_steps']} instrumented steps, ms):")
    d, m = b["dense"]["phases_s"], b["MoE"]["phases_s"]
    print(f"  {'':28s} {'dense':>8s} {'MoE':>8s}")
    for key in dict.fromkeys(list(d) + list(m)):
        print(f"  {key:28s} {d.get(key, 0.0) * ms:8.2f} {m.get(key, 0.0) * ms:8.2f}")
    for name in ("dense", "MoE"):
        o = b[name]["adam_variants_s"]
        print(f"  Adam.step alone, {name}: default {o['default'] * ms:.2f}, foreach {o['foreach'] * ms:.2f}, "
              f"fused {o['fused'] * ms:.2f} ms")
    p = record["peak_bytes"]
    print(f"peak memory of a step: dense {p['dense'] / 2**20:.1f} MiB, MoE {p['MoE'] / 2**20:.1f} MiB "
          f"({record['peak_moe_over_dense']:.2f}x)")


if __name__ == "__main__":
    main()
