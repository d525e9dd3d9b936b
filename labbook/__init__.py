"""labbook: the MoE Lab Book's own machinery, built on ``labutils``: what the chapters need and a student's
coursework copy does not. The exercise grader (``grader``: grading out of the student's process), each chapter's
exercise cases (``checkers/chNN``) and the solution markers (``exercises``), the toy models and worker functions
chapters 02 and 07 show (``toys/``, one module per section), the studies: chapter 05's
(``lm_study/``) and chapter 09's runner (``train_modern``), which share one preset type, model builder, job runner
and verdict (``study``); diagrams drawn from real routings (``diagrams``), chapter 06's expert-parallel bugs
(``ep_bugs``) and token-exchange designs (``token_exchange``). It imports ``labutils`` by name; nothing in
``labutils`` imports it.
"""
