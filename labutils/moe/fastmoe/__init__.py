"""The fastmoe face (chapter 01): fastmoe's functional names and signatures (``api``: ``count_by_gate`` ->
``(pos, lec, gec)``, ``MOEScatter``, ``prepare_forward``, ...) as a thin layer over the core's steps. The comparison
with real fastmoe (CUDA) is the book's: ``labbook.fastmoe_parity``."""
