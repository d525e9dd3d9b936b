"""Chapter 09's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

Library faults edit copies of ``labutils/moe/...`` and ``labbook/train_modern.py``; the parity cell's reference is
written from the stated formulas, so a bug in the layer's own helpers (a capacity, a loss) is not shared with it.
"""
from labbook.faults import Edit, Fault

SETUP, REF, REF_AUX, PARITY, ROUTE, BIAS_DEFS, BIAS, BOUND, ZLOSS, LEAK, GROUPED = (
    "ee970165", "a1c09e7f", "b2d09f3e", "e6eb5964", "997c5184", "c2c88b17", "04c7ad80", "e5a09c7b", "cc278a50",
    "68ea03eb", "030927cf")
POOLS, ACTIVE, TRAIN, ROWS, LIVE, LIVE2, PREFIX, RECORD, VERDICTS = (
    "85316491", "8b5246ab", "9e3c5199", "060cd098", "f6174ea9", "c3e09a5d", "d4f09b6c", "854ec5e1", "cbd8c132")

P = (SETUP, REF, REF_AUX, PARITY)            # section 8's parity check and the reference it needs
MATCH = "match the reference"
MODERN = "labutils/moe/modern/"
ROUTERS, LAYER, LOSSES = MODERN + "routers.py", MODERN + "layer.py", MODERN + "losses.py"
CAPACITY, AUX_FREE, BACKENDS = "labutils/moe/capacity.py", MODERN + "aux_free.py", "labutils/moe/backends.py"
RUNNER, REPORT = "labbook/train_modern.py", "labbook/reports/ch09.py"

FAULTS = [
    Fault("a knob of the presets left undocumented", check=SETUP, expect="every preset knob is described",
          library=(Edit(REPORT, '"lr": "Adam learning rate",', ""),), cells=(SETUP,)),
    # --- section 8: output, router loss and gradients against a reference written from the formulas ----------
    Fault("the router's weights are detached (no gradient reaches the router from the task)", check=PARITY,
          expect=MATCH, cells=P,
          library=(Edit(ROUTERS, "return idx, w.to(x.dtype), s", "return idx, w.detach().to(x.dtype), s"),)),
    Fault("the experts' input is detached (no gradient reaches x through the experts)", check=PARITY, expect=MATCH,
          library=(Edit(LAYER, "y = dispatch([x2], idx,", "y = dispatch([x2.detach()], idx,"),), cells=P),
    Fault("expert choice's capacity rounds down: floor(cf T / E)", check=PARITY, expect=MATCH,
          library=(Edit(CAPACITY, "min(num_tokens, math.ceil(num_tokens * capacity_factor / num_experts))",
                        "min(num_tokens, math.floor(num_tokens * capacity_factor / num_experts))"),), cells=P),
    Fault("token choice's capacity rounds down: floor(cf k T / E)", check=PARITY, expect=MATCH,
          library=(Edit(CAPACITY, "return math.ceil(capacity_factor * num_tokens * k / num_experts)",
                        "return math.floor(capacity_factor * num_tokens * k / num_experts)"),), cells=P),
    Fault("the balancing loss in top-1's form for top-2 (f = E/T counts: 2x too large)", check=PARITY, expect=MATCH,
          library=(Edit(LOSSES, "* (E / (k * L))", "* (E / L)"),), cells=P),
    Fault("the sequence-level loss computed over the whole batch (equal to the batch loss)", check=PARITY,
          expect=MATCH, library=(Edit(ROUTERS, 'balance_loss(s, idx, seq_len if self.balance == "sequence" else None)',
                                      "balance_loss(s, idx, None)"),), cells=P),
    Fault("the z-loss squares the mean logsumexp instead of averaging the squares", check=PARITY, expect=MATCH,
          library=(Edit(LOSSES, "dim=-1).pow(2).mean()", "dim=-1).mean().pow(2)"),), cells=P),
    Fault("first and second choices dropped in token order (no first-choice priority)", check=PARITY, expect=MATCH,
          library=(Edit(LAYER, "keep = position_in_expert(idx, E) < capacity",
                        "keep = (position_in_expert(idx.reshape(-1, 1), E) < capacity).reshape(idx.shape)"),),
          cells=P),
    # --- the other check cells ----------------------------------------------------------------------------------
    Fault("route_scale applied before route_norm (the weights sum to 1)", check=ROUTE,
          expect="the k weights sum to route_scale",
          library=(Edit(ROUTERS, "        if self.route_norm:\n            w = w / (w.sum(-1, keepdim=True) + 1e-20)\n"
                                 "        w = w * self.route_scale\n",
                        "        w = w * self.route_scale\n        if self.route_norm:\n"
                        "            w = w / (w.sum(-1, keepdim=True) + 1e-20)\n"),), cells=(SETUP, ROUTE)),
    Fault("the aux-free bias moves toward the busiest expert (sign flipped)", check=BIAS,
          expect="busiest expert below half the tokens",
          library=(Edit(AUX_FREE, "torch.sign(counts.mean() - counts)", "torch.sign(counts - counts.mean())"),),
          cells=(SETUP, BIAS_DEFS, BIAS)),
    Fault("the aux-free bias update is never written back (the bias never moves)", check=BIAS,
          expect="busiest expert below half the tokens",
          library=(Edit(AUX_FREE, "bias.copy_(bias_update(bias, counts, rate, center))",
                        "bias = bias_update(bias, counts, rate, center)"),), cells=(SETUP, BIAS_DEFS, BIAS)),
    Fault("the balancing loss 2x too large, seen on a perfectly balanced batch", check=BOUND,
          expect="balancing loss of a perfectly balanced batch = 1",
          library=(Edit(LOSSES, "* (E / (k * L))", "* (E / L)"),), cells=(SETUP, BIAS_DEFS, BIAS, BOUND)),
    Fault("zero_grad() after backward(): the z-loss never moves the router", check=ZLOSS,
          expect="the z-loss shrinks the router logits",
          edits=(Edit(ZLOSS, "    opt.zero_grad()\n    r.get_loss().backward()\n",
                      "    r.get_loss().backward()\n    opt.zero_grad()\n"),), cells=(SETUP, ZLOSS)),
    Fault("softmax router scores taken over the tokens, not the experts (dropless leaks)", check=LEAK,
          expect="no earlier output changes",
          library=(Edit(ROUTERS, "else torch.softmax(logits, dim=-1)", "else torch.softmax(logits, dim=0)"),),
          cells=(SETUP, LEAK)),
    Fault("expert choice's capacity rounds down, seen by the capacity check", check=LEAK, expect="ceil(93.75)",
          library=(Edit(CAPACITY, "min(num_tokens, math.ceil(num_tokens * capacity_factor / num_experts))",
                        "min(num_tokens, math.floor(num_tokens * capacity_factor / num_experts))"),),
          cells=(SETUP, LEAK)),
    Fault("the grouped GEMM's row offsets in reverse expert order", check=GROUPED, expect="grouped GEMM",
          library=(Edit(BACKENDS, "offs = torch.cumsum(counts.to(device=x.device), 0)",
                        "offs = torch.cumsum(counts.flip(0).to(device=x.device), 0)"),), cells=(SETUP, GROUPED)),
    Fault("the shared expert added on top of 8 routed ones", check=POOLS, expect="32d²",
          library=(Edit(RUNNER, "ModernMoE(d, 2 * d, 7, 1, n_shared=1,", "ModernMoE(d, 2 * d, 8, 1, n_shared=1,"),),
          cells=(SETUP, POOLS)),
    Fault("fine-grained experts a quarter as wide as they should be", check=POOLS, expect="32d²",
          library=(Edit(RUNNER, "ModernMoE(d, d // 2, 32, 8,", "ModernMoE(d, d // 4, 32, 8,"),), cells=(SETUP, POOLS)),
    Fault("expert choice at c = 1 under the name c = 2 (half the active parameters)", check=ACTIVE,
          expect="expert choice, c=2: equal active expert parameters",
          library=(Edit(RUNNER, 'routing="expert", capacity_factor=2.0,', 'routing="expert", capacity_factor=1.0,'),),
          cells=(SETUP, POOLS, ACTIVE)),
    Fault("the z-loss variant trained without its z-loss", check=LIVE,
          expect="z-loss lowers the router's logsumexp",
          library=(Edit(RUNNER, 'balance="batch", z_coef=1e-3,', 'balance="batch",'),),
          cells=(SETUP, POOLS, TRAIN, ROWS, LIVE)),
    Fault("the aux-free bias hook removed before training (the bias never moves)", check=LIVE2,
          expect="the aux-free bias moved in training",
          library=(Edit(RUNNER, "        hook = attach_bias_update(opt, model, allow_none=True)\n",
                        "        hook = attach_bias_update(opt, model, allow_none=True)\n        hook.remove()\n"),
                   Edit(RUNNER, "        hook.remove()\n        val = torch.tensor", "        val = torch.tensor")),
          cells=(SETUP, POOLS, TRAIN, LIVE2)),
    Fault("the prefix evaluation scores one full forward (it sees the future too)", check=PREFIX,
          expect="catches expert choice using the future",
          library=(Edit(RUNNER, "logits = model(inputs[:, :t + 1])[:, -1:]", "logits = model(inputs)[:, t:t + 1]"),),
          cells=(SETUP, POOLS, PREFIX)),
    Fault("the prefix evaluation averages over the batch size, not the positions", check=PREFIX,
          expect="reproduces the full forward of causal models",
          library=(Edit(RUNNER, "    return total / inputs.shape[1]", "    return total / inputs.shape[0]"),),
          cells=(SETUP, POOLS, PREFIX)),
    Fault("a causality tolerance 100x too loose", check=PREFIX, expect="catches expert choice using the future",
          library=(Edit(RUNNER, "CAUSAL_TOL = 1e-4  #", "CAUSAL_TOL = 1e-2  #"),), cells=(SETUP, POOLS, PREFIX)),
    Fault("the full preset changed since the record was made (a stale record)", check=RECORD,
          expect="the record is of this code's full preset",
          library=(Edit(RUNNER, "steps=1000, eval_every=250,", "steps=2000, eval_every=250,"),),
          cells=(SETUP, POOLS, RECORD)),
    Fault("the verdicts against dense not corrected for nine comparisons", check=VERDICTS, expect="Holm-corrected",
          library=(Edit(RUNNER, 'verdict=c.verdict if adjusted[n] < c.alpha else "inconclusive")',
                        "verdict=c.verdict)"),),
          cells=(SETUP, POOLS, PREFIX, RECORD, VERDICTS)),
    Fault("Bonferroni in place of Holm (every p times m)", check=VERDICTS, expect="Holm-corrected",
          library=(Edit(RUNNER, "running = max(running, min(1.0, (m - i) * p))", "running = min(1.0, m * p)"),),
          cells=(SETUP, POOLS, PREFIX, RECORD, VERDICTS)),
]
