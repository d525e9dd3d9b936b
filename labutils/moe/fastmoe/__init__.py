"""The fastmoe face (chapter 01): fastmoe's functional names and signatures (``api``: ``count_by_gate`` ->
``(pos, lec, gec)``, ``MOEScatter``, ``prepare_forward``, ...) as a thin layer over the core's steps, and ``compat``,
the comparison with real fastmoe when it imports (CUDA)."""
