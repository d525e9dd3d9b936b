"""The modern wing of the MoE core (chapter 09): what MoE layers added after fastmoe, built on the core's steps.

``routers`` (``TopKRouter``: softmax or sigmoid scores, route scaling, selection-only bias), ``losses`` (balance and
z losses), ``aux_free`` (bias-based balancing), ``expert_choice``, ``experts`` (``RoutedExperts`` on stacked
weights), ``shared`` (always-on experts), ``layer`` (``ModernMoE``) and ``reference`` (the token-by-token brute
force every chapter 09 parity check compares with).
"""
