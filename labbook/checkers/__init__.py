"""Every chapter's exercise cases, one module per chapter, for the grader (:mod:`labbook.grader`): ``CASES`` maps an
exercise's name to a factory of its :class:`labbook.grader.answers.Cases` (visible cases, the hidden-case generator,
a reference independent of the function under test, the tolerance). Only the grading parent imports these modules:
the sandbox running a solution never holds a reference or a hidden case. ``tests/test_grader_chNN.py`` proves each
exercise fails the shortcuts a student could take."""
