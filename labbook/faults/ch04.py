"""Chapter 04's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

DeepSpeed itself lives outside the repository copy a fault edits, so a fault in DeepSpeed's gate (a release that
behaves differently from 0.19.8) is injected where the chapter imports it: ``labutils.ds.import_deepspeed``
recompiles ``deepspeed.moe.sharded_moe.top2gating`` from its own source with the edit applied (:func:`in_deepspeed`).
"""
from labbook.faults import Edit, Fault

SETUP, BLOCK, COUNTS, ENGINE, EPOCHS, FELL = "304142af", "ce5f2313", "6dcb17b8", "d3e333ae", "e0767714", "fd919917"
MORE, FLOOR = "c199e451", "45b0f878"
GATE, CAPACITY, SLOTS, WEIGHTS, BOTH, L_AUX, REACH = ("57e9d4e5", "ef09a3c0", "5107a0d2", "5107a0d3", "8b8a53df",
                                                      "d73f6e30", "5107a0d5")

TRAINED = (SETUP, BLOCK, ENGINE)          # the model, trained for section 3's epochs
SECTION4 = (*TRAINED, GATE)               # and the gate's view of one batch


def in_deepspeed(*replacements) -> Edit:
    """An edit to labutils/ds/runtime.py that makes the chapter's DeepSpeed run ``top2gating`` with each
    ``(old, new)`` text replaced in its source (each must occur exactly once there)."""
    patch = (
        "    import inspect\n"
        "    from deepspeed.moe import sharded_moe\n"
        "    if not getattr(sharded_moe, '_lab_fault', False):\n"
        "        source = inspect.getsource(sharded_moe.top2gating)\n"
        f"        for old, new in {list(replacements)!r}:\n"
        "            assert source.count(old) == 1, f'the fault no longer matches DeepSpeed: {old!r}'\n"
        "            source = source.replace(old, new)\n"
        "        exec(compile(source, sharded_moe.__file__, 'exec'), sharded_moe.__dict__)\n"
        "        sharded_moe._lab_fault = True\n"
    )
    return Edit("labutils/ds/runtime.py", "    return deepspeed\n", patch + "    return deepspeed\n")


FAULTS = [
    # the block recomputed by hand, ln1 and ln2 made to differ for the check
    Fault("the block swaps its two norms (ln2 before attention, ln1 before the feed-forward)", check=BLOCK,
          expect="recomputed by hand",
          library=(Edit("labutils/models.py",
                        "        x = x + self.attn(self.ln1(x))     # (B, T, d)\n"
                        "        return x + self.ffn(self.ln2(x))   # (B, T, d)",
                        "        x = x + self.attn(self.ln2(x))     # (B, T, d)\n"
                        "        return x + self.ffn(self.ln1(x))   # (B, T, d)"),),
          cells=(SETUP, BLOCK)),
    Fault("the adapter returns DeepSpeed's output twice as large (out + out)", check=BLOCK, expect="recomputed by hand",
          library=(Edit("labutils/models.py", "        return out  # (..., d)",
                        "        return out + out  # (..., d)"),),
          cells=(SETUP, BLOCK)),
    # the parameter counts
    Fault("the attention's output projection has no bias", check=COUNTS, expect="attention = 4 d^2 + 4 d",
          library=(Edit("labutils/models.py", "        self.out = nn.Linear(d_model, d_model, bias=bias)",
                        "        self.out = nn.Linear(d_model, d_model, bias=False)"),),
          cells=(SETUP, BLOCK, COUNTS)),
    # the epoch losses fall
    Fault("the trainer's engine path never calls engine.step()", check=FELL, expect="falls every epoch",
          library=(Edit("labutils/train.py", "        model.backward(loss)\n        model.step()\n",
                        "        model.backward(loss)\n"),),
          cells=(*TRAINED, EPOCHS, FELL)),
    # the held-out loss stays at the floor
    Fault("the held-out samples are the first 64 training samples", check=FLOOR, expect="held-out samples: loss",
          edits=(Edit(ENGINE, "held_x, held_y = (torch.randn(64, cfg.seq, cfg.hidden, generator=g) for _ in range(2))",
                      "held_x, held_y = data_x[:64], data_y[:64]"),),
          cells=(SETUP, BLOCK, COUNTS, ENGINE, EPOCHS, FELL, MORE, FLOOR)),
    # the capacity and the dropped count
    Fault("DeepSpeed's top-2 capacity forgets k (factor, not factor * 2)", check=CAPACITY,
          expect="capacity = max(ceil(factor * 2 * S / E), 4)",
          library=(in_deepspeed(("torch.tensor(capacity_factor * 2)", "torch.tensor(capacity_factor)")),),
          cells=(*SECTION4, CAPACITY)),
    Fault("the adapter never lets DeepSpeed drop a choice (drop_tokens=False)", check=CAPACITY,
          expect="capacity = max(ceil(factor * 2 * S / E), 4)",
          library=(Edit("labutils/models.py", "drop_tokens=drop_tokens, **moe_kwargs)",
                        "drop_tokens=False, **moe_kwargs)"),),
          cells=(*SECTION4, CAPACITY)),
    # the slot-order cell: first choices take slots first
    Fault("DeepSpeed's gate gives second choices the slots first", check=SLOTS, expect="first choices take slots first",
          library=(in_deepspeed(("    locations2 += torch.sum(mask1, dim=0, keepdim=True)\n",
                                 "    locations1 += torch.sum(mask2, dim=0, keepdim=True)\n")),),
          cells=(*SECTION4, CAPACITY, SLOTS)),
    # the weights cell: renormalised over the surviving choices
    Fault("DeepSpeed's gate keeps the raw probabilities (no renormalising)", check=WEIGHTS, expect="sum to 1",
          library=(in_deepspeed(("    gates1_s /= denom_s\n    gates2_s /= denom_s\n", "")),),
          cells=(*SECTION4, CAPACITY, SLOTS, WEIGHTS)),
    # the both-choices cell: a token that loses both choices (gate_view, defined in the gate cell, sets the factor)
    Fault("gate_view never sets the capacity factor it is given", check=BOTH,
          expect="at capacity factor 0.5 some tokens lose both choices",
          edits=(Edit(GATE, "    gate.capacity_factor = cf\n", ""),),
          cells=(*SECTION4, BOTH)),
    # l_aux against the stated formula, on the training batch and on routers whose first choices are cut
    Fault("DeepSpeed computes l_aux after the capacity cut", check=L_AUX, expect="on 5 more routers",
          library=(in_deepspeed(
              ("    me = torch.mean(gates, dim=0)\n    ce = torch.mean(mask1.float(), dim=0)\n"
               "    l_aux = torch.mean(me * ce) * num_experts * num_experts\n", ""),
              ("    # Store the capacity location for each token\n",
               "    me = torch.mean(gates, dim=0)\n    ce = torch.mean(mask1.float(), dim=0)\n"
               "    l_aux = torch.mean(me * ce) * num_experts * num_experts\n"
               "    # Store the capacity location for each token\n")),),
          cells=(*SECTION4, L_AUX)),
    Fault("DeepSpeed's l_aux counts both choices", check=L_AUX, expect="first choices only",
          library=(in_deepspeed(("    ce = torch.mean(mask1.float(), dim=0)\n",
                                 "    ce = torch.mean((mask1 + mask2).float(), dim=0)\n")),),
          cells=(*SECTION4, L_AUX)),
    # the new cell: l_aux reaches the loss with AUX_COEF
    Fault("the adapter hands the trainer l_aux detached", check=REACH, expect="gradient(AUX_COEF)",
          library=(Edit("labutils/models.py", "        loss = self.l_aux\n        if clear:",
                        "        loss = self.l_aux.detach()\n        if clear:"),),
          cells=(*SECTION4, L_AUX, REACH)),
    Fault("the trainer's engine path backpropagates the task loss only", check=REACH, expect="gradient(AUX_COEF)",
          library=(Edit("labutils/train.py", "        model.backward(loss)\n", "        model.backward(task)\n"),),
          cells=(*SECTION4, L_AUX, REACH)),
    Fault("the trainer halves the aux coefficient", check=REACH, expect="gradient(AUX_COEF)",
          library=(Edit("labutils/train.py", "    loss = task + aux_coef * aux",
                        "    loss = task + aux_coef / 2 * aux"),),
          cells=(*SECTION4, L_AUX, REACH)),
]
