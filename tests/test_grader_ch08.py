"""Red team for chapter 08's exercises (combine_index_add, time_pair, einsum_overhead): the book's solutions and
two honest variants each pass; the library, torch's own timer or FLOP counter, pasted code, harnesses that time the
wrong thing, answers without a gradient path or of the wrong dtype, and wrong FLOP counts fail, each naming the rule
it broke where one applies."""
import pytest
from redteam import fails, passes, pasted, solution

from labbook.checkers import ch08


def test_the_books_solutions_pass():
    for name, line in (("combine_index_add", "all 11 cases match (3 visible, 8 hidden)"),
                       ("time_pair", "all 5 cases match (2 visible, 3 hidden)"),
                       ("einsum_overhead", "all 11 cases match (3 visible, 8 hidden)")):
        assert line in passes(name, solution(name)).text()


@pytest.mark.parametrize("name, src", [
    ("combine_index_add", """
    def combine_index_add(y_sorted, pos, score):
        T, k = score.shape
        out = torch.zeros(T * k, y_sorted.shape[1], dtype=y_sorted.dtype)
        out = out.index_copy(0, pos, y_sorted * score.reshape(-1)[pos, None].to(y_sorted.dtype))
        return out.view(T, k, -1).sum(1)                        # (T, d)
    """),
    ("combine_index_add", """
    def combine_index_add(y_sorted, pos, score):
        T, k = score.shape
        w = score.reshape(-1).gather(0, pos).to(y_sorted.dtype)
        onehot = torch.zeros(T, pos.numel(), dtype=y_sorted.dtype)
        onehot[pos // k, torch.arange(pos.numel())] = 1.0      # (T, N): which token each row belongs to
        return onehot @ (y_sorted * w[:, None])
    """),
    ("time_pair", """
    def time_pair(step_a, step_b, make_input, reps):
        out = {"a": [], "b": []}
        for r in range(reps):
            for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
                step = step_a if key == "a" else step_b
                x = make_input()
                t0 = time.process_time()
                loss = step(x).sum()
                loss.backward()
                out[key].append(time.process_time() - t0)
        return out
    """),
    ("time_pair", """
    def time_pair(step_a, step_b, make_input, reps):
        def once(step):
            x = make_input()
            t0 = time.perf_counter()
            step(x).sum().backward()
            return time.perf_counter() - t0
        a, b = [], []
        for _ in range(reps):
            a.append(once(step_a))
            b.append(once(step_b))
        return {"a": a, "b": b}
    """),
    ("einsum_overhead", """
    def einsum_overhead(T, E, C, d, h, k):
        one_einsum = 2 * T * E * C * d                      # multiply-adds of tec,td->ecd (or tec,ecd->td), x2 FLOPs
        step = 3 * 2 * one_einsum                           # two einsums, forward + two gradients each
        experts = 3 * (2 * T * k * d * h) * 2               # two linears, forward + two gradients each
        return step / experts
    """),
    ("einsum_overhead", """
    import math

    def einsum_overhead(T, E, C, d, h, k):
        return torch.tensor(math.prod([T, E, C, d]) * 12 / (12 * T * k * d * h), dtype=torch.float64)
    """),
], ids=["combine-index_copy-sum", "combine-onehot-matmul", "timing-process-time-alternating",
        "timing-perf-counter", "einsum-spelled-out", "einsum-prod"])
def test_honest_variants_pass(name, src):
    passes(name, src)


@pytest.mark.parametrize("name, src, rule", [
    ("combine_index_add", "from labutils.moe.functions import MOEGatherCombine\n"
                          "def combine_index_add(y, p, s):\n    return y", "import"),
    ("combine_index_add", "import mylab\ndef combine_index_add(y, p, s):\n    return y", "import"),
    ("combine_index_add", """
    def combine_index_add(y_sorted, pos, score):            # computed without a gradient path
        with torch.no_grad():
            T, k = score.shape
            w = score.reshape(-1)[pos].unsqueeze(1)
            return y_sorted.new_zeros(T, y_sorted.shape[1]).index_add(0, pos // k, y_sorted * w)
    """, "exercise"),
    ("combine_index_add", """
    def combine_index_add(y_sorted, pos, score):            # float64 out for float32 rows
        T, k = score.shape
        w = score.reshape(-1)[pos].unsqueeze(1).double()
        return torch.zeros(T, y_sorted.shape[1], dtype=torch.float64).index_add(0, pos // k, y_sorted.double() * w)
    """, "exercise"),
    ("time_pair", "def time_pair(a, b, make, reps):\n    return torch.utils.benchmark.Timer", "torch-door"),
    ("time_pair", "from timeit import timeit\ndef time_pair(a, b, make, reps):\n    return {}", "import"),
    ("time_pair", "from labbook.perf.timing import bench\ndef time_pair(a, b, make, reps):\n    return {}",
     "import"),
    ("einsum_overhead", "def einsum_overhead(T, E, C, d, h, k):\n"
                        "    return torch.utils.flop_counter.FlopCounterMode", "torch-door"),
    ("einsum_overhead", "from torch.utils.flop_counter import FlopCounterMode\n"
                        "def einsum_overhead(T, E, C, d, h, k):\n    return 1.0", "import"),
], ids=["labutils-combine", "renamed-copy", "no-grad", "wrong-dtype", "torch-Timer", "timeit", "labbook-perf",
        "flop-counter", "flop-counter-import"])
def test_shortcuts_fail_naming_the_rule(name, src, rule):
    fails(name, src, rule)


@pytest.mark.parametrize("src", [
    """
    def time_pair(step_a, step_b, make_input, reps):         # forwards only: B's extra cost is in its backward
        out = {"a": [], "b": []}
        for _ in range(reps):
            for key, step in (("a", step_a), ("b", step_b)):
                x = make_input()
                t0 = time.thread_time()
                step(x)
                out[key].append(time.thread_time() - t0)
        return out
    """,
    """
    def time_pair(step_a, step_b, make_input, reps):         # all of A, then all of B: not interleaved
        out = {"a": [], "b": []}
        for key, step in (("a", step_a), ("b", step_b)):
            for _ in range(reps):
                x = make_input()
                t0 = time.thread_time()
                step(x).sum().backward()
                out[key].append(time.thread_time() - t0)
        return out
    """,
    """
    def time_pair(step_a, step_b, make_input, reps):         # made-up numbers, no step run
        return {"a": [1.0] * reps, "b": [2.0] * reps}
    """,
    """
    def time_pair(step_a, step_b, make_input, reps):         # the clock read before the step, never after
        out = {"a": [], "b": []}
        for _ in range(reps):
            for key, step in (("a", step_a), ("b", step_b)):
                t0 = time.thread_time()
                step(make_input()).sum().backward()
                out[key].append(t0)
        return out
    """,
], ids=["forwards-only", "not-interleaved", "made-up", "clock-not-read"])
def test_harnesses_that_time_the_wrong_thing_fail(src):
    fails("time_pair", src)


@pytest.mark.parametrize("src", [
    "def einsum_overhead(T, E, C, d, h, k):\n    return 2 * 2 * T * E * C * d / (12 * T * k * d * h)",  # fwd only
    "def einsum_overhead(T, E, C, d, h, k):\n    return 3 * 2 * T * E * C * d / (12 * T * k * d * h)",  # one einsum
    "def einsum_overhead(T, E, C, d, h, k):\n    return 2 * E * C / (k * h)",                         # twice over
    "def einsum_overhead(T, E, C, d, h, k):\n    return E * C / h",                                   # k forgotten
], ids=["einsums-forward-only", "one-einsum", "twice", "k-forgotten"])
def test_wrong_flop_counts_fail(src):
    fails("einsum_overhead", src)


def test_pasted_reference_code_is_refused():
    fails("combine_index_add", pasted(ch08.combine_reference, "combine_index_add", "0"), says="rule '")
    fails("einsum_overhead", pasted(ch08.einsum_overhead_reference, "einsum_overhead", "0"), says="rule '")
