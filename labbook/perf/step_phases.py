"""A training step's phases and the cuts tried on MoE's tax, read from their records. (Taught in chapter 08.)

``benchmarks/train_step.py`` times each phase of a training step inside real steps (``phases_s``), and
``benchmarks/step_cuts.py`` times each cut tried on the MoE layer against its plain form. Here:

* :data:`GROUPS` and :func:`grouped`: the phases a reader compares, each group's forward + backward in ms;
* :func:`phase_sums_hold`: the record held to itself (the named phases add up to the totals they claim);
* :func:`cut_calls` and :func:`adopted_cuts_pay`: every cut labutils adopted, by the chapter's one speed rule.
"""
from __future__ import annotations

from .verdicts import speed_call

__all__ = ["GROUPS", "UNNAMED", "grouped", "phase_sums_hold", "cut_calls", "adopted_cuts_pay"]

GROUPS = {  # what a reader compares: each group's forward + backward
    "rest of the model": ("rest fwd", "rest bwd"),
    "experts / FFN": ("experts fwd", "experts bwd", "FFN (fc1, GELU, fc2) fwd", "FFN (fc1, GELU, fc2) bwd"),
    "router, top-k, aux loss": ("router fwd", "top-k fwd", "aux loss fwd", "router bwd", "top-k bwd", "aux loss bwd"),
    "dispatch (sort/count, gather, combine)": ("sort/count fwd", "scatter (gather rows) fwd", "combine fwd",
                                               "sort/count bwd", "scatter (gather rows) bwd", "combine bwd"),
    "optimizer (Adam)": ("optimizer (Adam)",),
}
UNNAMED = "backward bookkeeping (unnamed)"


def grouped(phases: dict) -> dict:
    """``{group: ms}`` of one model's ``phases_s``, and :data:`UNNAMED`: the forward, backward and Adam totals less
    every named group."""
    ms = {g: 1e3 * sum(phases.get(k, 0.0) for k in keys) for g, keys in GROUPS.items()}
    named = 1e3 * (phases["forward total"] + phases["backward total"] + phases["optimizer (Adam)"])
    ms[UNNAMED] = named - sum(ms.values())
    return ms


def phase_sums_hold(phases: dict, tol: float = 0.05) -> bool:
    """The named forward phases add up to the forward total, and forward + backward + Adam to the instrumented
    step, each within ``tol`` of the total (a record with a phase left out fails)."""
    fwd = sum(v for k, v in phases.items() if k.endswith(" fwd"))
    named = phases["forward total"] + phases["backward total"] + phases["optimizer (Adam)"]
    return (abs(fwd - phases["forward total"]) <= tol * phases["forward total"]
            and abs(named - phases["instrumented step"]) <= tol * phases["instrumented step"])


def cut_calls(record: dict, margin: float = 0.0) -> dict:
    """Each adopted cut's plain / cut time per round, by the chapter's one rule (:func:`speed_call` against 1.0):
    above 1, the cut is faster. ``{cut: speed_call dict}``."""
    return {n: speed_call([p / c for p, c in zip(r["seconds"]["plain"], r["seconds"]["cut"])], 1.0, margin=margin)
            for n, r in record["cuts"].items() if r["adopted"]}


def adopted_cuts_pay(record: dict) -> bool:
    """Every cut labutils adopted was faster than the plain form in the record (95% CI of plain / cut above 1)."""
    return all(v["call"] == "ahead" for v in cut_calls(record).values())
