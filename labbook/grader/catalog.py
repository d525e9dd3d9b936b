"""Every exercise of the book, as the grader knows it before any case exists: its chapter, the function the solution
cell defines, what the solution may import and use (:class:`labbook.grader.policy.Policy`), how the sandbox calls
it (the adapter) and how long a case may take. The cases, the hidden-case generator and the reference live in the
chapter's checker module (``labbook.checkers.chNN.CASES``), which only the grading parent imports.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labbook.grader.policy import Policy

STANDARD = Policy(imports=frozenset({"torch", "math", "torch.nn", "torch.nn.functional"}),
                  provided=(("torch", "torch"), ("math", "math"), ("nn", "torch.nn"), ("F", "torch.nn.functional")))
NO_LAYERS = Policy(imports=frozenset({"torch", "math"}), provided=(("torch", "torch"), ("math", "math")),
                   answers=frozenset({"nn", "Linear", "LazyLinear", "Module", "parameters", "named_parameters",
                                      "state_dict", "empty", "empty_like", "empty_strided"}),
                   answers_why="build no layer and count nothing: write the formula")
SPLITS = Policy(imports=STANDARD.imports, provided=STANDARD.provided,
                answers=frozenset({"chunk", "unsafe_chunk", "tensor_split", "hsplit", "vsplit", "dsplit",
                                   "array_split"}),
                answers_why="these implement the uneven-split rule the exercise asks you to write")
COLLECTIVES = Policy(imports=frozenset({"torch", "math", "torch.distributed"}),
                     provided=(("torch", "torch"), ("math", "math"), ("dist", "torch.distributed")))
TIMING = Policy(imports=frozenset({"torch", "math", "time"}),
                provided=(("torch", "torch"), ("math", "math"), ("time", "time")),
                answers=frozenset({"Timer", "benchmark", "timeit"}), answers_why="write the timing loop yourself")
COUNTING = Policy(imports=STANDARD.imports, provided=STANDARD.provided,
                  answers=frozenset({"FlopCounterMode", "flop_counter"}),
                  answers_why="count the FLOPs from the shapes yourself")


@dataclass(frozen=True)
class Entry:
    """One exercise: ``function`` defined in chapter ``chapter``'s solution cell."""
    function: str
    chapter: str
    policy: Policy = STANDARD
    adapter: str = "call"            # call | gradients | timing | distributed (labbook.grader.adapters)
    case_timeout_s: float = 20.0
    load_timeout_s: float = 30.0
    tags: tuple = field(default=())


ENTRIES = {e.function: e for e in [
    Entry("gather_values", "00", COLLECTIVES, adapter="distributed", case_timeout_s=60.0),
    Entry("linear_params", "00", NO_LAYERS),
    Entry("my_moe_forward", "01"),
    Entry("my_switch_loss", "01"),
    Entry("my_count_by_gate", "01"),
    Entry("my_topk_gate", "01"),
    Entry("my_drop_over_capacity", "01"),
    Entry("my_capacity", "02"),
    Entry("my_top1_l_aux", "02"),
    Entry("my_dispatch", "02"),
    Entry("moe_layer_params", "03", NO_LAYERS),
    Entry("ds_capacity", "04"),
    Entry("top2_l_aux", "04"),
    Entry("balance_entropy", "05"),
    Entry("my_steps_to_reach", "05"),
    Entry("all_gather_backward", "06"),
    Entry("my_local_order", "06"),
    Entry("ds_dispatch_bytes", "06"),
    Entry("shard_batch", "07", SPLITS),
    Entry("grouped_reduce", "07"),
    Entry("combine_index_add", "08", adapter="gradients"),
    Entry("time_pair", "08", TIMING, adapter="timing", case_timeout_s=60.0),
    Entry("einsum_overhead", "08", COUNTING),
    Entry("my_bias_update", "09"),
    Entry("my_expert_choice", "09"),
]}


def entry(name: str) -> Entry:
    """The exercise called ``name`` (the function its solution cell defines); a clear error for any other name."""
    if not isinstance(name, str) or name not in ENTRIES:
        raise ValueError(f"exercise={name!r}: not an exercise of the book; the exercises are "
                         f"{', '.join(sorted(ENTRIES))}")
    return ENTRIES[name]


def by_chapter(chapter: str) -> list:
    """The exercises of chapter ``chapter`` ("00".."09"), in the book's order."""
    return [e for e in ENTRIES.values() if e.chapter == chapter]
