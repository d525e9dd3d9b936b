"""Chapter 02's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

Issue 38's items for this chapter (the issue's cell numbers): a drop rate over tokens instead of routes (cells 11,
16/17, 30), top-1's ``l_aux`` written in top-2's form (the new E = 5 cell after 30), the dispatch picture's slots
reversed (cell 4), identical experts under "eval output is random" (cell 25), and ``floor`` for ``ceil`` in
DeepSpeed's capacity (cells 11, 16) and ``ceil`` for ``floor`` in GShard's (the new T = 50 cell after 36).
"""
from labbook.faults import Edit, Fault

SETUP, START, PICTURE, IDEM, GATE, EVALCF, SWEEP = (
    "5ad33f2d", "7c1287cc", "96034bf5", "1abd714d", "80019807", "59fc4f87", "c2e46bdf")
RTS, NOISE, RSAMPLE, EVALRAND, COUNTS = "01bdd2ae", "d2a1efca", "b266e6c4", "84597d58", "6916a4c0"
SRC, EXACT, EXACT5, FORMS, LAYER, FASTMOE, ROUNDING, RANDOM = (
    "12d772e9", "867735c1", "e5a1b2c3", "0a70e29d", "04c1eb02", "81f2b299", "c4f8a2d6", "73cbb57e")
PYRAMID, PRNET, TRAIN, EPRUN, EPCHECK, SMALL, GUARD, APPB = (
    "a67908c7", "ca5f37d4", "4b34fcbf", "d99b4a1c", "f83a395d", "662e1c3e", "0830a592", "645a5857")

GATING, CAPACITY, RUNTIME = "labutils/ds/gating.py", "labutils/moe/capacity.py", "labutils/ds/runtime.py"
DROP_OVER_TOKENS = Edit(GATING, "self.kept_counts.sum().item() / max(int(self.exp_counts.sum()), 1)",
                        "self.kept_counts.sum().item() / max(self.indices.shape[1], 1)")

FAULTS = [
    # -- section 1: the [E, C, d] picture --------------------------------------------------------------------
    Fault("the dispatch picture draws every expert's slots in reverse order", check=PICTURE,
          expect="the picture shows exactly the slots",
          library=(Edit("labbook/diagrams.py", "c = int(loc[j, t])", "c = capacity - 1 - int(loc[j, t])"),),
          cells=(SETUP, START, PICTURE)),
    Fault("the hook records the experts' output instead of their input", check=PICTURE,
          expect="the experts received x at exactly those slots",
          edits=(Edit(START, "register_forward_pre_hook(lambda mod, args: received.append(args[0].detach()))",
                      "register_forward_hook(lambda mod, args, out: received.append(out.detach()))"),),
          cells=(SETUP, START, PICTURE)),
    # -- section 2: starting DeepSpeed -------------------------------------------------------------------------
    Fault("init_deepspeed's second call reports the group it made itself as adopted", check=IDEM,
          expect="init_deepspeed is idempotent",
          library=(Edit(RUNTIME, "    if not ds_comm.is_initialized():\n"
                                 "        adopted = _ADOPTED = dist.is_available() and dist.is_initialized()\n",
                        "    adopted = _ADOPTED = dist.is_available() and dist.is_initialized()\n"
                        "    if not ds_comm.is_initialized():\n"),),
          cells=(SETUP, START, IDEM)),
    # -- section 4: the capacity and the drop rate ---------------------------------------------------------------
    Fault("Routing.drop_rate divides by the tokens, not the routes (k=2 prints -93.8%)", check=GATE,
          expect="= dropped / routes counted one by one", library=(DROP_OVER_TOKENS,),
          cells=(SETUP, START, GATE)),
    Fault("the capacity formula written with floor (integer division) instead of ceil", check=GATE,
          expect="C = max(ceil(cf·k·S/E), 4)",
          edits=(Edit(GATE, "formula = max(math.ceil(k * n / E), 4)", "formula = max(k * n // E, 4)"),),
          cells=(SETUP, START, GATE)),
    # -- section 5: train vs eval factor ---------------------------------------------------------------------------
    Fault("the gate is never switched to eval, so 'eval' runs with the training factor", check=EVALCF,
          expect="eval uses factor 2.0",
          edits=(Edit(EVALCF, "    getattr(gate, mode)()\n", "    gate.train()\n"),),
          cells=(SETUP, START, GATE, EVALCF)),
    # -- section 6: the drop-rate sweep (and its plot, cell 17, and the summary) -----------------------------------
    Fault("deepspeed_capacity rounds down (floor) instead of up: visible at the fractional cf = 1.1", check=SWEEP,
          expect="the dropped routes are exactly sum_e max(0, exp_counts_e - C)",
          library=(Edit(CAPACITY, "capacity = torch.ceil((num_tokens / num_experts) * factor)",
                        "capacity = torch.floor((num_tokens / num_experts) * factor)"),),
          cells=(SETUP, START, GATE, SWEEP)),
    Fault("the sweep's drop rate is dropped routes / tokens (k=2 plots 150%)", check=SWEEP,
          expect="every drop rate printed = dropped / routes counted one by one",
          edits=(Edit(SWEEP, "curves[k] = [r.drop_rate for r in rs]",
                      "curves[k] = [int((r.indices < 0).sum()) / len(xs) for r in rs]"),),
          cells=(SETUP, START, GATE, SWEEP)),
    # -- sections 7-9: which tokens, noise, eval randomness ---------------------------------------------------------
    Fault("the second RTS call is re-seeded like the first, so RTS looks deterministic", check=RTS,
          expect="RTS keeps a different random subset per call",
          edits=(Edit(RTS, "rts_a = kept_by(gate)\nrts_b", "rts_a = kept_by(gate)\ntorch.manual_seed(10)\nrts_b"),),
          cells=(SETUP, START, GATE, RTS)),
    Fault("the noisy gate is left in training mode for the eval column", check=NOISE,
          expect="RSample changes top-1 routing in training, never in eval",
          edits=(Edit(NOISE, "make_gate(k, noisy_gate_policy=policy).train(train)",
                      "make_gate(k, noisy_gate_policy=policy)"),), cells=(SETUP, START, GATE, NOISE)),
    Fault("the clean probabilities are taken from a router of another seed", check=RSAMPLE,
          expect="RSample weight = clean softmax prob",
          edits=(Edit(RSAMPLE, "probs = torch.softmax(make_gate(1).wg(x).float(), 1)",
                      "probs = torch.softmax(make_gate(1, seed=1).wg(x).float(), 1)"),),
          cells=(SETUP, START, GATE, RSAMPLE)),
    Fault("distinct_experts re-seeds per tensor, so every expert is the same (eval differs by 6e-8 only)",
          check=EVALRAND, expect="sampling=True: eval output is random",
          library=(Edit("labbook/toys/ch02_deepspeed.py",
                        "    g = torch.Generator().manual_seed(seed)\n    with torch.no_grad():\n"
                        "        for p in moe.deepspeed_moe.experts.parameters():\n",
                        "    with torch.no_grad():\n        for p in moe.deepspeed_moe.experts.parameters():\n"
                        "            g = torch.Generator().manual_seed(seed)\n"),),
          cells=(SETUP, START, GATE, EVALRAND)),
    # -- section 10: exp_counts and l_aux ---------------------------------------------------------------------------
    Fault("the collapsing router is fed the unshifted tokens", check=COUNTS, expect="l_aux ~ 1 when balanced",
          edits=(Edit(COUNTS, '("collapsing router", collapsed, x + 3 * u)', '("collapsing router", collapsed, x)'),),
          cells=(SETUP, START, GATE, COUNTS)),
    # -- section 11: the re-derivation, bit for bit --------------------------------------------------------------------
    Fault("top2_routing numbers 2nd choices' slots from 0, not after every 1st choice", check=EXACT,
          expect="cases bit-exact",
          library=(Edit(GATING, "slot2 = _slots(chosen2) + chosen1.sum(0, keepdim=True)", "slot2 = _slots(chosen2)"),),
          cells=(SETUP, START, SRC, EXACT)),
    Fault("Routing.drop_rate over tokens: cell 30's printed rates are checked too", check=EXACT,
          expect="every drop rate printed = dropped / routes counted one by one", library=(DROP_OVER_TOKENS,),
          cells=(SETUP, START, SRC, EXACT)),
    Fault("top1_routing writes l_aux in top-2's form mean(m·f)·E·E (equal for E = 4, not for E = 5)",
          check=EXACT5, expect="E=5: C = ceil(k·S/E)",
          library=(Edit(GATING, "l_aux = torch.sum(probs.mean(0) * chosen.float().mean(0)) * E\n",
                        "l_aux = torch.mean(probs.mean(0) * chosen.float().mean(0)) * E * E\n"),),
          cells=(SETUP, START, SRC, EXACT, EXACT5)),
    Fault("the batched top-2 form is written as top-1's sum(m·f)·E", check=FORMS,
          expect="the batched forms equal DeepSpeed's",
          edits=(Edit(FORMS, "return mf.sum(1) * n_e, mf.mean(1) * n_e * n_e",
                      "return mf.sum(1) * n_e, mf.sum(1) * n_e"),),
          cells=(SETUP, START, SRC, EXACT, FORMS)),
    Fault("moe_output adds the expert outputs without their combine weights", check=LAYER, expect="MoE forward ==",
          library=(Edit(GATING, "out.index_add(0, token, w * experts[e](x[token]))",
                        "out.index_add(0, token, experts[e](x[token]))"),),
          cells=(SETUP, START, GATE, SRC, LAYER)),
    # -- DeepSpeed vs FastMoE ---------------------------------------------------------------------------------------
    Fault("position_in_expert orders token-major (a token's 2nd choice before the next token's 1st)", check=FASTMOE,
          expect="top-2: identical expert choices and drops",
          library=(Edit(CAPACITY, "flat = gate_idx.t().reshape(-1)", "flat = gate_idx.reshape(-1)"),
                   Edit(CAPACITY, "return rank.reshape(gate_idx.shape[1], -1).t()",
                        "return rank.reshape(gate_idx.shape)")),
          cells=(SETUP, START, GATE, FASTMOE)),
    Fault("fastmoe_gshard_capacity rounds up like DeepSpeed (invisible where cf·S·k/E is whole)", check=ROUNDING,
          expect="GShardGate rounds down",
          library=(Edit(CAPACITY, "return math.ceil(factor * num_tokens) * top_k // tot_expert",
                        "return math.ceil(math.ceil(factor * num_tokens) * top_k / tot_expert)"),),
          cells=(SETUP, START, GATE, FASTMOE, ROUNDING)),
    Fault("GShardGate's random routing only in training", check=RANDOM, expect="random_routing=True: eval is random",
          library=(Edit("labutils/moe/capacity_gates.py", "        if self.random_routing:\n",
                        "        if self.random_routing and self.training:\n"),),
          cells=(SETUP, START, GATE, FASTMOE, RANDOM)),
    # -- sections 12-13: PR-MoE, training ---------------------------------------------------------------------------
    Fault("the pyramid written the book's way round (more experts in the first layers)", check=PYRAMID,
          expect="more in deeper layers",
          edits=(Edit(PYRAMID, "pyramid = [E // 2, E // 2, E, E]", "pyramid = [E, E, E // 2, E // 2]"),),
          cells=(SETUP, START, GATE, PYRAMID)),
    Fault("the training loop calls engine.backward but never engine.step", check=TRAIN, expect="loss at least halves",
          edits=(Edit(TRAIN, "    engine.step()\n", ""),), cells=(SETUP, START, PRNET, TRAIN)),
    # -- sections 14-15: expert parallelism and its pitfalls -----------------------------------------------------------
    Fault("shard_for_rank deals the experts round-robin instead of in blocks", check=EPCHECK,
          expect="ep_size=2 output == ep_size=1 output",
          library=(Edit(RUNTIME, "rank * local + int(j)", "int(j) * local + rank"),),
          cells=(SETUP, START, EPRUN, EPCHECK)),
    Fault("the tiny batch has 4 tokens, so min_capacity = 4 is met", check=SMALL, expect="top-1 refuses",
          edits=(Edit(SMALL, "tiny_batch = torch.randn(3, D)", "tiny_batch = torch.randn(4, D)"),),
          cells=(SETUP, START, GATE, SMALL)),
    Fault("the capacity guard raises even when the ranks agree", check=GUARD, expect="the guard turns the mismatch",
          library=(Edit(RUNTIME, "if len(set(caps)) > 1:", "if len(set(caps)) >= 1:"),),
          cells=(SETUP, START, GUARD)),
    # -- appendix B --------------------------------------------------------------------------------------------------
    Fault("deepspeed_capacity computes in float64 (S=100, E=4, cf=1.2: 30, the gate says 31)", check=APPB,
          expect="the real gate: S=100, E=4, cf=1.2",
          library=(Edit(CAPACITY, "factor = torch.tensor(capacity_factor * k)",
                        "factor = torch.tensor(capacity_factor * k, dtype=torch.float64)"),),
          cells=(SETUP, START, APPB)),
]
