"""Chapter 05's study: MoE against dense on real text at equal active parameters, over seeds. (Chapter 05.)

Three models differ only in their feed-forward (:func:`variants`):

* ``dense``: an MLP of hidden width ``4 d``;
* ``MoE``: ``E`` experts of width ``4 d / k``, top-``k`` noisy gating: the same active parameters per token
  as ``dense`` (plus the router), ``E / k`` times its feed-forward parameters;
* ``dense-wide``: one MLP of width ``4 d E / k``, MoE's total parameters and ``E / k`` times the compute.

``dense-wide`` is the regime check: if it does not beat ``dense`` clearly, the runs are data- or step-limited
and no amount of extra parameters (MoE's included) can show. Ablations change one MoE knob at a time, on every
seed; ``E=k=2`` is a gated dense model (every token through both experts: MoE's FLOPs, dense's parameters), and
:func:`data_limited` is the same study on a small slice of the training text, seen for several epochs.

:func:`run_study` trains every (model, seed), optionally on several processes; :func:`summarize` reduces the
record to verdicts, every one a test from :mod:`labutils.stats`; :func:`verdict_lines` writes the summary text
*from those numbers*. ``benchmarks/moe_vs_dense.py`` records the ``full`` preset; the chapter runs ``tiny`` and
shows the recorded ``full`` run. Each run's batch order and initialisation come from its seed. The checks the
chapter makes of the setup live here too: FLOPs measured by ``FlopCounterMode`` (:func:`measured_train_flops`),
the split inspected on the data (:func:`shared_windows`), repeats of drawing windows with replacement
(:func:`window_coverage`), the training clock without evaluations (:class:`TrainClock`).

One module per part, each name imported from its module (``from labbook.lm_study.summary import summarize``; the
0.3 hub's ``labbook.lm_study.summarize`` warns until 1.0.0): ``config`` (the preset, the models, FLOPs),
``data_checks`` (the split and the windows), ``runner`` (the runs), ``summary`` (the verdicts), ``plots``. The
preset type, the model builder, the jobs side by side and the comparison against a reference arm are
:mod:`labbook.study`'s, shared with chapter 09's runner.
"""
from labutils._deprecate import forward_moved

forward_moved(__name__)
