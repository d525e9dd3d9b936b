"""Measuring speed and memory: for chapter 08 and ``benchmarks/`` only. (Chapter 08.)

* :mod:`labbook.perf.timing`: THE clock (:func:`~labbook.perf.timing.clock`), interleaved timing, matmul
  throughput, peak memory, ``machine_info`` and ``save_result`` for every benchmark record.
* :mod:`labbook.perf.problem`: the problem every design solves (weights, routing logits), the shared routing,
  one training step.
* :mod:`labbook.perf.dispatch`: the catalogue, every dispatch design of an MoE layer on identical weights (the
  loop, padded, grouped and einsum designs written there); :mod:`labbook.perf.real_layers`: the designs that
  are whole layers (the lab's core, DeepSpeed's MoE, real fastmoe).
* :mod:`labbook.perf.sweep`: one problem, every design side by side, each checked against the naive loop.
* :mod:`labbook.perf.breakdown`: where the core's time goes (profiled into routing, dispatch, experts, combine).
* :mod:`labbook.perf.layer_bench`: the chapter-01 layer's speed table (the core against a dense MLP, DeepSpeed,
  ...), its grouped and loop rows built from the dispatch designs; taught in chapter 08.
* :mod:`labbook.perf.verdicts`: paired speed-ups, ahead / tie / behind, a live run against its record.
* :mod:`labbook.perf.step_phases`: a training step's phases and the cuts tried on MoE's tax, from their records.
* :mod:`labbook.perf.plots`: chapter 08's figures (ratio curves, roofline, memory, profiled phases, all-to-all).

The book's machinery, in no coursework copy: it was ``labutils.perf`` until 0.3.0, whose paths forward here with a
warning until 1.0.0 (``labutils._deprecate``).
"""
