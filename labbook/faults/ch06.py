"""Chapter 06's faults: each names the check cell that must catch it. (See ``labbook.faults``.)

The CUDA cell (``bac092dc``) has no fault here: it runs only with two GPUs or more, and the harness runs on CPU.
"""
from labbook.faults import Edit, Fault

SETUP, COLLECTIVES, GATHER_GRAD, ORDER, ROUTING, DRAWN = (
    "ec6d05da", "109502ae", "82869fa0", "7f365ca9", "f55c7538", "64d14da7")
PARITY_JOB, BOOK_JOB, TRAFFIC_JOB, EIGHT, PARITY, ZERO, BOOK = (
    "866a6989", "2d06b0ba", "cd775735", "499efcd3", "62e9f35f", "2738e345", "5976f80e")
MATRIX, WIRE, MINIMUMS, DS_GATE, DS_USE, DS_TEXT = (
    "121385c2", "99c48eb2", "afbac274", "10d1ca66", "506bcdd0", "41e9dc25")
EP_BUGS, BUG_JOB, ROUTER, LIVE, RECORD, VERDICTS = (
    "7ab88557", "8e8c033e", "fbcb11bc", "7ec94d1d", "8bf94eb4", "88b06b60")
MISTAKES, UNCAUGHT, DETAIL, PLAIN = "f2bf5df4", "c512e47f", "a4f175c0", "3abca883"

EP = "labutils/moe/expert_parallel.py"
TRAFFIC = "labutils/moe/traffic.py"
FAILURES = "labutils/launcher/_failures.py"
DISPATCH = "    x_recv = all_to_all(x_sorted, recv, send, group, check=False)"
EIGHT_CELLS = (SETUP, PARITY_JOB, BOOK_JOB, TRAFFIC_JOB, EIGHT)
WIRE_CELLS = (*EIGHT_CELLS, MATRIX, WIRE)
DS_CELLS = (*WIRE_CELLS, MINIMUMS, DS_GATE, DS_USE, DS_TEXT)


def _side_padding(how: str) -> tuple:
    """Library edits: ``to_experts`` ships 32 rows of zero padding per peer through a side channel ``how``."""
    helper = {
        "group": ("    g = dist.new_group(backend=\"gloo\")                  # a group of its own, gone after\n"
                  "    pad = x.new_zeros(32 * dist.get_world_size(), x.shape[-1])\n"
                  "    dist.all_to_all_single(torch.empty_like(pad), pad, group=g)\n"
                  "    dist.destroy_process_group(g)\n"),
        "third": ("    _pad_calls[0] += 1\n"
                  "    if _pad_calls[0] % 3 == 0:                           # every third call only\n"
                  "        pad = x.new_zeros(32 * dist.get_world_size(), x.shape[-1])\n"
                  "        dist.all_to_all_single(torch.empty_like(pad), pad)\n"),
        "store": ("    store = dist.distributed_c10d._get_default_store()  # the rendezvous store\n"
                  "    pad = x.new_zeros(32 * dist.get_world_size(), x.shape[-1])\n"
                  "    store.set(f\"pad{dist.get_rank()}\", pad.numpy().tobytes())\n"),
    }[how]
    return (Edit(EP, "def to_experts(", "_pad_calls = [0]\n\n\ndef _side_padding(x):\n" + helper
                 + "\n\ndef to_experts("),
            Edit(EP, DISPATCH, "    _side_padding(x_sorted)\n" + DISPATCH))


FAULTS = [
    # -- 1. collectives --------------------------------------------------------------------------------------
    Fault("all_gather_variable_dim keeps each rank's padding instead of its rows", check=COLLECTIVES,
          expect="every rank gathered the same concatenation",
          library=(Edit("labutils/collectives.py", "kept = [p.narrow(dim, 0, s)",
                        "kept = [p.narrow(dim, p.shape[dim] - s, s)"),),
          cells=(SETUP, COLLECTIVES)),
    # -- 2. the all-gather's gradient --------------------------------------------------------------------------
    Fault("AllGather's backward modes swapped (slice sums, sum slices)", check=GATHER_GRAD,
          expect="slice is right for replicated computation",
          library=(Edit("labutils/collectives.py", 'if ctx.grad == "sum":', 'if ctx.grad == "slice":'),),
          cells=(SETUP, GATHER_GRAD)),
    # -- 3. local order, routing record --------------------------------------------------------------------------
    Fault("local_order groups by expert but takes the sources in reverse", check=ORDER,
          expect="in FastMoE's order",
          library=(Edit(EP, "torch.argsort(expert * world + src, stable=True)",
                        "torch.argsort(expert * world + (world - 1 - src), stable=True)"),),
          cells=(SETUP, ORDER)),
    Fault("exchange_and_run records the rows it received as the rows it sent", check=DRAWN,
          expect="the exchange's record names the rows",
          library=(Edit(EP, "_record(layer, send, recv, x_sorted)", "_record(layer, recv, send, x_sorted)"),),
          cells=(SETUP, ROUTING, DRAWN)),
    # -- 4. eight workers: the book's asserts, parity, an empty rank, tolerances ------------------------------------
    Fault("from_experts returns the rows without undoing the local order", check=EIGHT,
          expect="output is not the same",
          library=(Edit(EP, "y_local.index_select(0, torch.argsort(perm))", "y_local.index_select(0, perm)"),),
          cells=EIGHT_CELLS),
    Fault("the all-to-all's backward averages over the ranks instead of routing the gradient back", check=PARITY,
          expect="DIFFERENT",                # the comparison table: the last lines of the error
          library=(Edit("labutils/collectives.py", "        return grad_in, None, None, None",
                        "        return grad_in / dist.get_world_size(ctx.group), None, None, None"),),
          cells=(*EIGHT_CELLS, PARITY)),
    Fault("a rank with no tokens of its own returns zeros for the rows other ranks sent it", check=ZERO,
          expect="DIFFERENT",                # the comparison table: the last lines of the error
          library=(Edit(EP, "y_local = run(x_local, fwd_expert_count)",
                        "y_local = run(x_local, fwd_expert_count) * bool(x_sorted.shape[0])"),),
          cells=(SETUP, PARITY_JOB, ZERO)),
    Fault("the book check's backward divides by the local output size, not the global one", check=BOOK,
          expect="distributed equals local far inside the book's tolerances",
          edits=(Edit(BOOK_JOB, "(out.sum() / local_out.numel()).backward()", "(out.sum() / out.numel()).backward()"),),
          cells=(*EIGHT_CELLS, BOOK)),
    # -- 4. the wire (issue 38: a side group, every third call, the store) ------------------------------------------
    Fault("padding sent on a process group made and destroyed inside the exchange", check=WIRE,
          expect="B through the rendezvous store", library=_side_padding("group"), cells=WIRE_CELLS),
    Fault("padding sent on every third exchange only (a minimum over repeats hides it)", check=WIRE,
          expect="B beyond the fixed cost, the routed rows need", library=_side_padding("third"), cells=WIRE_CELLS),
    Fault("padding sent through the rendezvous store", check=WIRE,
          expect="B through the rendezvous store", library=_side_padding("store"), cells=WIRE_CELLS),
    Fault("the deduplicated minimum counts every remote choice (no second trips: '0 of 682')", check=MINIMUMS,
          expect="second trips, as a loop over every token's choices counts them",
          library=(Edit(TRAFFIC, "out[r] += len({g // num_expert for g in row if g >= 0} - {r})",
                        "out[r] += len([g // num_expert for g in row if g >= 0 and g // num_expert != r])"),),
          cells=(*WIRE_CELLS, MINIMUMS)),
    # -- DeepSpeed's buffers ----------------------------------------------------------------------------------------
    Fault("DeepSpeed's capacity formula leaves out top-k's factor k", check=DS_GATE,
          expect="the lab's formulas agree with DeepSpeed's gate",
          library=(Edit("labutils/moe/capacity.py", "factor = torch.tensor(capacity_factor * k)",
                        "factor = torch.tensor(capacity_factor)"),),
          cells=DS_CELLS[:-2]),
    Fault("capacity_use counts the rows under capacity as negative drops", check=DS_USE,
          expect="the figure's drops are the rows DeepSpeed's own gate dropped",
          library=(Edit(TRAFFIC, '"dropped": (counts - kept).sum(0)', '"dropped": (counts - capacity).sum(0)'),),
          cells=DS_CELLS[:-1]),
    Fault("capacity_use's padding clamps the wrong way ('padding 0 slots')", check=DS_TEXT,
          expect="the padded slots the text reports",
          library=(Edit(TRAFFIC, '"padding": (capacity - kept).sum(0)',
                        '"padding": (capacity - kept).clamp_max(0).sum(0)'),),
          cells=DS_CELLS),
    # -- 5. gradient bugs -------------------------------------------------------------------------------------------
    Fault("the correct synchronisation sums expert gradients over the EP ranks (the 2x bug)", check=BUG_JOB,
          expect="the correct synchronisation passes the gradient check",
          library=(Edit("labbook/ep_bugs.py", 'expert_scale="sum" if bug == "experts x EP" else "mean")',
                        'expert_scale="sum")'),),
          cells=(SETUP, EP_BUGS, BUG_JOB)),
    Fault("'router unreduced' zeroes the router's gradient instead of keeping the local one", check=ROUTER,
          expect="a missing router reduction shrinks as the batch grows",
          library=(Edit("labbook/ep_bugs.py", "            g.copy_(s)", "            g.zero_()"),),
          cells=(SETUP, BUG_JOB, ROUTER)),           # the batch sizes are measured in bug_job's EP = 2 launch
    # -- 6. three ways to move tokens ---------------------------------------------------------------------------------
    Fault("every design's training step runs the forward twice (its bytes grow, its gradients do not)", check=LIVE,
          expect="each design sent its rows plus",
          library=(Edit("labbook/token_exchange.py", "    y = part(x)\n", "    part(x)\n    y = part(x)\n"),),
          cells=(SETUP, LIVE)),
    Fault("a stale record from a run whose fastmoe gradients were wrong", check=VERDICTS,
          expect="every recorded design equalled one process",
          library=(Edit("benchmarks/results/token_exchange.json", '"param grads": 1.0674273580991424e-07',
                        '"param grads": 1.0674273580991424e-03'),),
          cells=(SETUP, LIVE, RECORD, VERDICTS)),
    # -- 7. ranks that disagree ----------------------------------------------------------------------------------------
    Fault("assign_layer_ids numbers the layers in reverse module order", check=MISTAKES,
          expect="the messages name the field and each rank's value",
          library=(Edit(EP, "    for _, module in model.named_modules():",
                        "    for _, module in reversed(list(model.named_modules())):"),),
          cells=(SETUP, MISTAKES)),
    Fault("launch's error names only the first failing rank", check=UNCAUGHT,
          expect="both ranks raised ExpertParallelMismatch",
          library=(Edit(FAILURES, "        if others:", "        if False:"),),
          cells=(SETUP, MISTAKES, UNCAUGHT)),
    Fault("the debug setting misspelt (INFO instead of DETAIL)", check=DETAIL,
          expect="DETAIL names the mismatched collectives",
          edits=(Edit(DETAIL, '{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}', '{"TORCH_DISTRIBUTED_DEBUG": "INFO"}'),),
          cells=(SETUP, MISTAKES, UNCAUGHT, DETAIL)),     # UNCAUGHT defines launch_error
    Fault("a launch that times out reports empty stacks", check=PLAIN,
          expect="shows rank 0 waiting in the agreement check",
          library=(Edit(FAILURES, "stacks[rank] = _read(path).strip() if",
                        "stacks[rank] = _read(path).strip()[:0] if"),),
          cells=(SETUP, MISTAKES, UNCAUGHT, PLAIN)),
]
