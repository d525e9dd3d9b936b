"""Every chapter's exercise checkers, one module per chapter (``ch01.check_my_moe_forward(fn)``), built on
:func:`labbook.exercises.check_exercise`: hidden cases, a guard against calling the book's own code, DeepSpeed or
fastmoe, references independent of the function under test. ``tests/test_exercise_cheats_chNN.py`` proves each
checker fails the shortcuts a student could take."""
