"""Chapter 03's faults: each names the check cell that must catch it. (See ``labbook.faults``.)"""
from labbook.faults import Edit, Fault

SETUP, BLOCK, COUNT, ROWS, COUNTS = "3d4ecedf", "2e3d4d6b", "9e79f2de", "a9357147", "6c673147"
TRAIN, FELL, STATS, CONTROLS = "84d5fecd", "2833f35a", "de9d8d5e", "bf42dc93"
BALANCE, RUNDEF, GRAD, RUNS, VERDICT, CAPACITY = ("19db49f0", "b015f02c", "b5a1c0df", "78a37ae9", "b3adcb25",
                                                  "d4c0eeaf")
RESUME = "382c2bd8"

SECTION5 = (SETUP, BALANCE, RUNDEF, RUNS)   # the definitions and the fifteen runs the section's checks read

FAULTS = [
    # cell 4: the block against its own parts, ln1 and ln2 made to differ
    Fault("the block swaps its two norms (ln2 before attention, ln1 before the feed-forward)", check=BLOCK,
          expect="x + attn(ln1(x)), then + ffn(ln2(.))",
          library=(Edit("labutils/models.py",
                        "        x = x + self.attn(self.ln1(x))     # (B, T, d)\n"
                        "        return x + self.ffn(self.ln2(x))   # (B, T, d)",
                        "        x = x + self.attn(self.ln2(x))     # (B, T, d)\n"
                        "        return x + self.ffn(self.ln1(x))   # (B, T, d)"),),
          cells=(SETUP, BLOCK)),
    Fault("the block drops the residual around its feed-forward", check=BLOCK,
          expect="x + attn(ln1(x)), then + ffn(ln2(.))",
          library=(Edit("labutils/models.py", "        return x + self.ffn(self.ln2(x))   # (B, T, d)",
                        "        return self.ffn(self.ln2(x))   # (B, T, d)"),),
          cells=(SETUP, BLOCK)),
    # cell 12: the counts against nn.MultiheadAttention and numel
    Fault("the attention's output projection has no bias", check=COUNTS, expect="nn.MultiheadAttention's parameters",
          library=(Edit("labutils/models.py", "        self.out = nn.Linear(d_model, d_model, bias=bias)",
                        "        self.out = nn.Linear(d_model, d_model, bias=False)"),),
          cells=(SETUP, COUNT, ROWS, COUNTS)),
    Fault("count_params files expert parameters under 'other'", check=COUNTS, expect="experts: count_params",
          library=(Edit("labutils/params.py", '            return "moe experts"', '            return "other"'),),
          cells=(SETUP, COUNT, ROWS, COUNTS)),
    Fault("the 5 d^2 attention hypothesis is built with biases", check=COUNTS, expect="rounds to the book's 5.24M",
          library=(Edit("labutils/models.py", '"5d2": dict(attn_bias=False, attn_extra_proj=True)',
                        '"5d2": dict(attn_bias=True, attn_extra_proj=True)'),),
          cells=(SETUP, COUNT, ROWS, COUNTS)),
    # cell 18: the loss falls, and no further than the floor
    Fault("the trainer never calls optimizer.step()", check=FELL, expect="the loss fell by at least 40%",
          library=(Edit("labutils/train.py", "        optimizer.step()\n    return task_value, aux_value",
                        "    return task_value, aux_value"),),
          cells=(SETUP, TRAIN, FELL)),
    # cell 20: the trained model predicts the mean, not the targets
    Fault("the random targets leak a little of the input (y = 0.1 x + noise)", check=STATS, expect="learned the mean",
          library=(Edit("labutils/data.py", "        y = torch.randn(self.shape, generator=self.gen)  # (B, T, d)",
                        "        y = 0.1 * x + 0.995 * torch.randn(self.shape, generator=self.gen)  # (B, T, d)"),),
          cells=(SETUP, TRAIN, FELL, STATS)),
    # cell 22: the negative controls of that check
    Fault("the 'learned the mean' check tests the output variance only", check=CONTROLS,
          expect="small outputs that follow the targets",
          edits=(Edit(STATS, "var < 0.2 and abs(c) < 0.05, f\"output", "var < 0.2, f\"output"),),
          cells=(SETUP, TRAIN, STATS, CONTROLS)),
    # cell 27: the balancing loss has a gradient path to the router
    Fault("GShardGate stores its balancing loss detached", check=GRAD, expect="gradient(alpha",
          library=(Edit("labutils/moe/capacity_gates.py",
                        "            self.set_loss((c_e * m_e).mean() * self.num_expert ** 2)",
                        "            self.set_loss(((c_e * m_e).mean() * self.num_expert ** 2).detach())"),),
          cells=(SETUP, BALANCE, RUNDEF, GRAD)),
    Fault("the trainer adds the aux loss as a number (detached)", check=GRAD, expect="gradient(alpha",
          library=(Edit("labutils/train.py", "    loss = task + aux_coef * aux",
                        "    loss = task + aux_coef * aux.detach()"),),
          cells=(SETUP, BALANCE, RUNDEF, GRAD)),
    Fault("GShardGate's balancing loss is E * mean(c m), not E^2 * mean(c m)", check=GRAD, expect="gradient(alpha",
          library=(Edit("labutils/moe/capacity_gates.py",
                        "            self.set_loss((c_e * m_e).mean() * self.num_expert ** 2)",
                        "            self.set_loss((c_e * m_e).mean() * self.num_expert)"),),
          cells=(SETUP, BALANCE, RUNDEF, GRAD)),
    Fault("section 5's runs ignore their aux coefficient (the trainer's default for all)", check=GRAD,
          expect="gradient(alpha",
          edits=(Edit(RUNDEF, "steps=steps, lr=3e-3, aux_coef=coef,", "steps=steps, lr=3e-3,"),),
          cells=(SETUP, BALANCE, RUNDEF, GRAD)),
    # cell 29: the full preset's record is section 5's
    Fault("the 'full' record was written by the tiny preset", check=VERDICT, expect="the full-preset record",
          library=(Edit("benchmarks/results/balance_cut_vs_loss_full.json", '"preset": "full"', '"preset": "tiny"'),),
          cells=(*SECTION5, VERDICT)),
    # cell 35: the cut, against the stated capacity computed by hand, and the demand recorder
    Fault("fastmoe's GShard capacity is one slot too large", check=CAPACITY,
          expect="the gate's capacity is the stated formula's",
          library=(Edit("labutils/moe/capacity.py", "    return math.ceil(factor * num_tokens) * top_k // tot_expert\n",
                        "    return math.ceil(factor * num_tokens) * top_k // tot_expert + 1\n"),),
          cells=(*SECTION5, CAPACITY)),
    Fault("the capacity cut keeps one choice beyond the capacity", check=CAPACITY, expect="every expert keeps <=",
          library=(Edit("labutils/moe/capacity.py", "(rank < room)", "(rank <= room)"),),
          cells=(*SECTION5, CAPACITY)),
    Fault("the demand recorder counts first choices only", check=CAPACITY, expect="recorded demand = the load",
          edits=(Edit(BALANCE, "logits.detach().topk(self.k, dim=-1)", "logits.detach().topk(1, dim=-1)"),),
          cells=(*SECTION5, CAPACITY)),
    # cell 40: resume
    Fault("a checkpoint's RNG state is not restored on resume", check=RESUME, expect="resume reproduces",
          library=(Edit("labutils/checkpoint.py",
                        '    data.load_state_dict(state["data"])\n    _set_rng_state(state["rng"])',
                        '    data.load_state_dict(state["data"])'),),
          cells=(SETUP, RESUME)),
]
