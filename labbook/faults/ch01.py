"""Chapter 01's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

Cell 30 (``54b15f5d``, the comparison with real fastmoe) checks only where CUDA and fastmoe are importable; on a
CPU machine it prints why it skips, so it has no fault here.
"""
from labbook.faults import Edit, Fault

SETUP, LAYER, BATCH, COUNT, STEPS, FUSED, BUFFER_COUNTER, BUFFERS = (
    "08278de5", "a8458121", "b4f10c34", "cb299e4f", "e3d510e4", "0af8d210", "14333266", "fb678ae7")
GATES, SWITCH_LOSS, DROPS, GSHARD, PARITY = "5f15ee6f", "c848d3a3", "0a0776dc", "b7d3e9c4", "80f00382"
AS_FMOE, PROGRAM, PROGRAM_CHECK, BROKEN, EP, EP_REF = (
    "3f766a9b", "8235289a", "080d7e39", "e3f618ab", "d55889b7", "c5e8a2d6")
SOLUTION, GRADER_CONTROL = "bda41485", "48278094"
LOSS_SOLUTION, HARNESS, TRAIN, TRAIN_CHECK = "783dd587", "38ec567e", "effc78e3", "c7c3b9a7"

FUNCTIONS, CAPACITY = "labutils/moe/functions.py", "labutils/moe/capacity.py"
UP_TO_COUNT = (SETUP, LAYER, BATCH, COUNT)
TO_GATES = (SETUP, LAYER, BATCH, GATES)
PROGRAM_CELLS = (SETUP, AS_FMOE, PROGRAM)

FAULTS = [
    Fault("count_by_gate sorts with an unstable argsort", check=COUNT, expect="pos is the loop's order",
          library=(Edit(FUNCTIONS, "pos = torch.argsort(key, stable=True)", "pos = torch.argsort(key)"),),
          cells=UP_TO_COUNT),
    Fault("count_by_gate slices the bins off by one (the drop bin kept, expert 0 lost)", check=COUNT,
          expect="are the loop's",
          library=(Edit(FUNCTIONS, "counts = bincount(key, tot_expert + 1)[:tot_expert]",
                        "counts = bincount(key, tot_expert + 1)[1:]"),),
          cells=UP_TO_COUNT),
    Fault("gather reads the rows through pos instead of its inverse", check=STEPS,
          expect="the six steps by hand give exactly layer(x)",
          library=(Edit(FUNCTIONS, "            return y_sorted.index_select(0, inv)",
                        "            return y_sorted.index_select(0, pos)"),),
          cells=(*UP_TO_COUNT, STEPS)),
    Fault("gather_combine caches its inverse permutation by (T, k), so a new pos reuses a stale one", check=FUSED,
          expect="negative control: the same check with the rows read in the wrong order",
          library=(Edit(FUNCTIONS, "class MOEGatherCombine(torch.autograd.Function):",
                        "_INV_CACHE: dict = {}  # inverse permutations by (T, k), computed once\n\n\n"
                        "class MOEGatherCombine(torch.autograd.Function):"),
                   Edit(FUNCTIONS,
                        "inv = torch.empty_like(pos).index_copy_(0, pos, torch.arange(T * k, device=pos.device))",
                        "inv = _INV_CACHE.setdefault((T, k), torch.empty_like(pos).index_copy_(0, pos, "
                        "torch.arange(T * k, device=pos.device)))")),
          cells=(*UP_TO_COUNT, STEPS, FUSED)),
    Fault("gather_combine keeps a private copy of the sorted rows for backward", check=BUFFERS,
          expect="fused: fewer (T*k, d) buffers made and none kept for backward",
          library=(Edit(FUNCTIONS, "ctx.save_for_backward(y_sorted, pos, score)",
                        "ctx.save_for_backward(y_sorted.clone(), pos, score)"),),
          cells=(*UP_TO_COUNT, STEPS, FUSED, BUFFER_COUNTER, BUFFERS)),
    Fault("SwitchGate's loss divides the summed probability by all T tokens, not the kept ones", check=SWITCH_LOSS,
          expect="is fastmoe's after-drop formula by hand",
          library=(Edit("labutils/moe/capacity_gates.py", "(frac * probs.sum(0) / kept.numel())",
                        "(frac * probs.mean(0))"),),
          cells=(*TO_GATES, SWITCH_LOSS)),
    Fault("drop_over_capacity visits the choices token by token (token-major), not first choices first",
          check=DROPS, expect="first choices in token order, then second choices",
          library=(Edit(CAPACITY, "flat = gate_idx.t().reshape(-1)", "flat = gate_idx.reshape(-1)"),
                   Edit(CAPACITY, "return rank.reshape(gate_idx.shape[1], -1).t()",
                        "return rank.reshape(gate_idx.shape)")),
          cells=(SETUP, DROPS)),
    Fault("GShardGate's capacity floors f*T instead of taking its ceiling", check=GSHARD,
          expect="GShardGate (train, f = 1.1)",
          library=(Edit(CAPACITY, "return math.ceil(factor * num_tokens) * top_k // tot_expert",
                        "return math.floor(factor * num_tokens) * top_k // tot_expert"),),
          cells=(SETUP, GSHARD)),
    Fault("GShardGate's capacity rounds the division by E up instead of down", check=GSHARD,
          expect="GShardGate (eval, f = 1.2)",
          library=(Edit(CAPACITY, "return math.ceil(factor * num_tokens) * top_k // tot_expert",
                        "return -(-math.ceil(factor * num_tokens) * top_k // tot_expert)"),),
          cells=(SETUP, GSHARD)),
    Fault("scatter's backward copies instead of adding: a token chosen twice gets one choice's gradient",
          check=PARITY, expect="NaiveGate: output, input grad",
          library=(Edit(FUNCTIONS, "return grad_x.index_add_(0, rows, grad), None",
                        "return grad_x.index_copy_(0, rows, grad), None"),),
          cells=(*TO_GATES, PARITY)),
    Fault("gather_combine forgets the gate scores when choices were dropped", check=PARITY,
          expect="GShardGate: output, input grad",
          library=(Edit(FUNCTIONS, "weighted = y_sorted * score.reshape(-1).index_select(0, pos)[:, None]",
                        "weighted = y_sorted * 1.0"),),
          cells=(*TO_GATES, PARITY)),
    Fault("the fastmoe program zeroes the gradients after backward, before the step", check=PROGRAM,
          expect="the fastmoe program should train",
          edits=(Edit(PROGRAM, "    opt.zero_grad()\n    loss.backward()\n",
                      "    loss.backward()\n    opt.zero_grad()\n"),),
          cells=PROGRAM_CELLS),
    Fault("the program check forgets ff.eval(): dropout stays on", check=PROGRAM_CHECK,
          expect="fastmoe program vs per-token reference",
          edits=(Edit(PROGRAM_CHECK, "ff.eval()\n", ""),),
          cells=(*PROGRAM_CELLS, PROGRAM_CHECK)),
    Fault("_fmoe_general_global_forward returns the expert-sorted rows, not choice order", check=PROGRAM_CHECK,
          expect="_fmoe_general_global_forward + bmm vs the layer",
          library=(Edit("labutils/moe/fastmoe/api.py",
                        "    return tree_map(lambda t: MOEGather.apply(t, pos, lec, gec, out_batch_size, "
                        "world_size), x)",
                        "    return x"),),
          cells=(*PROGRAM_CELLS, PROGRAM_CHECK)),
    Fault("run_experts calls FMoE.expert_fn, so a subclass's expert_fn is never used", check=BROKEN,
          expect="the block raised nothing",
          library=(Edit("labutils/moe/layers.py", "y = self.expert_fn(x, counts)",
                        "y = FMoE.expert_fn(self, x, counts)"),),
          cells=(*PROGRAM_CELLS, PROGRAM_CHECK, BROKEN)),
    Fault("DistributedGroupedDataParallel broadcasts every parameter: rank 1's experts become rank 0's", check=EP,
          expect="rank 1: gate = rank 0's drawn gate, experts = its own drawn experts",
          library=(Edit("labutils/data_parallel.py",
                        "        for tag, params in self._by_comm(need_grad=False).items():\n"
                        "            _broadcast_flat([p.data for p in params], self.comms[tag])",
                        "        _broadcast_flat([p.data for p in self.module.parameters()], self.comms[\"world\"])"),),
          cells=(SETUP, AS_FMOE, EP, EP_REF)),
    Fault("the all-to-all's backward averages over the ranks: expert gradients halved", check=EP_REF,
          expect="expert grads = sum over both ranks' tokens",
          library=(Edit("labutils/collectives.py", "        return grad_in, None, None, None",
                        "        return grad_in / dist.get_world_size(ctx.group), None, None, None"),),
          cells=(SETUP, AS_FMOE, EP, EP_REF)),
    # (the grader runs in its own isolated process from the installed labbook, so a fault in labbook/checkers
    # cannot be injected through a copy; this one is in the chapter's control itself)
    Fault("the grader's negative control forgets source=, so it grades the reader's own (correct) layer",
          check=GRADER_CONTROL, expect="negative control: the grader on Switch's scores",
          edits=(Edit(GRADER_CONTROL, 'grade("my_moe_forward", source=SWITCH_SCORES)', 'grade("my_moe_forward")'),),
          cells=(SETUP, SOLUTION, GRADER_CONTROL)),
    Fault("section 8's layer says it has no loss, so training never adds the Switch loss it computes",
          check=TRAIN_CHECK, expect="balancing loss: loss below the zero-output control",
          library=(Edit("labbook/checkers/ch01.py", "self.has_loss, self.loss, self.loads = True,",
                        "self.has_loss, self.loss, self.loads = False,"),),
          cells=(SETUP, SOLUTION, LOSS_SOLUTION, HARNESS, TRAIN, TRAIN_CHECK)),
]
