"""Measuring speed and memory: for chapter 08 and ``benchmarks/`` only. (Chapter 08.)

* :mod:`labutils.perf.timing`: THE clock (:func:`~labutils.perf.timing.clock`), interleaved timing, matmul
  throughput, peak memory, ``machine_info`` and ``save_result`` for every benchmark record.
* :mod:`labutils.perf.dispatch`: every dispatch design of an MoE layer on identical weights.
* :mod:`labutils.perf.sweep`: one problem, every design side by side; the core's profiled time breakdown.
* :mod:`labutils.perf.layer_bench`: the chapter-01 layer's speed table (the core against a dense MLP, DeepSpeed,
  ...), taught in chapter 08 since it moved there from chapter 01.

A coursework copy may delete this folder: nothing outside it imports it.
"""
