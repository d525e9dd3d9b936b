"""Red team for chapter 08's exercises (combine_index_add, time_pair, einsum_overhead): the book's solutions and
honest variants pass (a harness on the wall clock among them); the library, its renamed copy, torch's own timer or
FLOP counter, pasted library or checker code, answers without a gradient path or of the wrong dtype, harnesses that
time forwards only, never interleave, make their numbers up or never read the clock, lookup tables and wrong FLOP
counts fail, each naming the rule it broke where one applies."""
import pytest
from redteam import fails, passes, pasted, renamed_copy, solution

from labbook.checkers import ch08
from labbook.perf import timing
from labutils.moe import functions

COMBINE, TIMING, EINSUM = "combine_index_add", "time_pair", "einsum_overhead"


def combine(ret, w="score", token="pos // k", pre=""):
    """A combine_index_add whose weights come from ``w``, rows go to ``token``, returning ``ret`` (of ``out``);
    ``pre``: a line before the ``def`` (a decorator)."""
    return (f"{pre}def combine_index_add(y_sorted, pos, score):\n"
            "    T, k = score.shape\n"
            f"    w = {w}.reshape(-1)[pos].unsqueeze(1).to(y_sorted.dtype)\n"
            f"    out = y_sorted.new_zeros(T, y_sorted.shape[1]).index_add(0, {token}, y_sorted * w)\n"
            f"    return {ret}\n")


INTERLEAVED = 'for _ in range(reps):\n        for key, step in (("a", step_a), ("b", step_b)):'
TIMED = "t0 = time.thread_time(); step(make_input()).sum().backward(); out[key].append(time.thread_time() - t0)"


def harness(body=TIMED, loops=INTERLEAVED):
    """A time_pair running ``body`` (one line) inside ``loops`` (two nested loops binding ``key`` and ``step``)."""
    return ('def time_pair(step_a, step_b, make_input, reps):\n    out = {"a": [], "b": []}\n'
            f"    {loops}\n            {body}\n    return out\n")


@pytest.mark.parametrize("name, line", [(COMBINE, "all 11 cases match (3 visible, 8 hidden)"),
                                        (TIMING, "all 5 cases match (2 visible, 3 hidden)"),
                                        (EINSUM, "all 11 cases match (3 visible, 8 hidden)")])
def test_the_books_solutions_pass(name, line):
    assert line in passes(name, solution(name)).text()


@pytest.mark.parametrize("name, src", [
    (COMBINE, """
    def combine_index_add(y_sorted, pos, score):
        T, k = score.shape
        out = torch.zeros(T * k, y_sorted.shape[1], dtype=y_sorted.dtype)
        out = out.index_copy(0, pos, y_sorted * score.reshape(-1)[pos, None].to(y_sorted.dtype))
        return out.view(T, k, -1).sum(1)                        # (T, d)
    """),
    (COMBINE, """
    def combine_index_add(y_sorted, pos, score):
        T, k = score.shape
        w = score.reshape(-1).gather(0, pos).to(y_sorted.dtype)
        onehot = torch.zeros(T, pos.numel(), dtype=y_sorted.dtype)
        onehot[pos // k, torch.arange(pos.numel())] = 1.0      # (T, N): which token each row belongs to
        return onehot @ (y_sorted * w[:, None])
    """),
    (TIMING, """
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
    (TIMING, """
    import time

    def time_pair(step_a, step_b, make_input, reps):
        steps = {"a": step_a, "b": step_b}
        for step in steps.values():                             # one warm-up round, not recorded
            step(make_input()).sum().backward()
        times = {key: [] for key in steps}
        for _ in range(reps):
            for key, step in steps.items():
                x = make_input()
                t0 = time.thread_time_ns()
                step(x).sum().backward()
                times[key].append((time.thread_time_ns() - t0) / 1e9)
        return times
    """),
    (EINSUM, """
    def einsum_overhead(T, E, C, d, h, k):
        one_einsum = 2 * T * E * C * d                      # multiply-adds of tec,td->ecd (or tec,ecd->td), x2 FLOPs
        step = 3 * 2 * one_einsum                           # two einsums, forward + two gradients each
        experts = 3 * (2 * T * k * d * h) * 2               # two linears, forward + two gradients each
        return step / experts
    """),
    (EINSUM, """
    import math

    def einsum_overhead(T, E, C, d, h, k):
        return torch.tensor(math.prod([T, E, C, d]) * 12 / (12 * T * k * d * h), dtype=torch.float64)
    """),
    (EINSUM, "def einsum_overhead(T, E, C, d, h, k):\n    return E * C / (k * h)      # T and d cancel\n"),
    (COMBINE, combine("out")),
    (TIMING, harness()),
], ids=["combine-index_copy-sum", "combine-onehot-matmul", "timing-process-time-alternating",
        "timing-warm-up-ns", "einsum-spelled-out", "einsum-prod", "einsum-cancelled",
        "combine-template", "timing-template"])
def test_honest_variants_pass(name, src):
    passes(name, src)


@pytest.fixture(scope="module")
def copy_on_disk(tmp_path_factory):
    return renamed_copy(str(tmp_path_factory.mktemp("coursework")))


def test_the_renamed_copy_is_an_import(copy_on_disk):
    assert copy_on_disk.is_dir()                              # on disk, and still refused
    fails(COMBINE, "from mylab.moe.functions import gather_combine\n\ndef combine_index_add(y, p, s):\n"
                   "    return gather_combine(y, p, s)\n", "import")


@pytest.mark.parametrize("name, src, rule", [
    (COMBINE, "from labutils.moe.functions import gather_combine\n"
              "def combine_index_add(y, p, s):\n    return gather_combine(y, p, s)", "import"),
    (COMBINE, "from labutils.moe.functions import MOEGatherCombine\n"
              "def combine_index_add(y, p, s):\n    return MOEGatherCombine.apply(y, p, s)", "import"),
    (COMBINE, "from labutils.moe import combine, gather\n"
              "def combine_index_add(y, p, s):\n    return combine(gather(y, p, s.numel()), s)", "import"),
    (COMBINE, combine("out", pre="@torch.no_grad()\n"), "exercise"),                          # no gradient path
    (COMBINE, combine("out.detach()"), "exercise"),                                               # detached
    (COMBINE, combine("out", w="score.detach()"), "exercise"),                                    # scores detached
    (COMBINE, combine("out.double()"), "exercise"),                                               # float64 out
    (COMBINE, combine("out", token="pos.floor_divide_(k)"), "read-only-inputs"),                  # pos overwritten
    (TIMING, "def time_pair(a, b, make, reps):\n    return torch.utils.benchmark.Timer", "torch-door"),
    (TIMING, "from torch.utils.benchmark import Timer\ndef time_pair(a, b, make, reps):\n    return {}", "import"),
    (TIMING, "def time_pair(a, b, make, reps):\n    return Timer(stmt='a(make())').timeit(reps)", "exercise"),
    (TIMING, "from timeit import timeit\ndef time_pair(a, b, make, reps):\n    return {}", "import"),
    (TIMING, "from labbook.perf.timing import bench\ndef time_pair(a, b, make, reps):\n    return {}", "import"),
    (TIMING, "from labutils.perf import timing\ndef time_pair(a, b, make, reps):\n    return {}", "import"),
    (EINSUM, "def einsum_overhead(T, E, C, d, h, k):\n"
             "    return torch.utils.flop_counter.FlopCounterMode", "torch-door"),
    (EINSUM, "from torch.utils.flop_counter import FlopCounterMode\n"
             "def einsum_overhead(T, E, C, d, h, k):\n    return 1.0", "import"),
    (EINSUM, "from labbook.perf import dispatch\ndef einsum_overhead(T, E, C, d, h, k):\n    return 1.0", "import"),
    (EINSUM, "from labutils.perf import dispatch\ndef einsum_overhead(T, E, C, d, h, k):\n    return 1.0", "import"),
], ids=["gather_combine", "MOEGatherCombine", "gather+combine", "no-grad", "detached", "score-detached",
        "wrong-dtype", "pos-written", "torch-Timer", "Timer-import", "Timer-name", "timeit", "labbook-perf",
        "labutils-perf", "flop-counter", "flop-counter-import", "labbook-dispatch", "labutils-dispatch"])
def test_shortcuts_fail_naming_the_rule(name, src, rule):
    fails(name, src, rule)


@pytest.mark.parametrize("name, fn, call, rules", [
    (COMBINE, ch08.combine_reference, "combine_reference(*args, args[0])[0]", ("identity",)),
    (COMBINE, functions.gather_combine, "gather_combine(*args)", ("identity", "private")),
    (TIMING, timing.bench, "bench({'a': lambda: args[0](args[2]()).sum().backward()}, reps=args[3])",
     ("identity", "private")),
    (EINSUM, ch08.einsum_overhead_reference, "einsum_overhead_reference(*args)", ("import",)),
], ids=["combine-reference", "gather_combine", "bench", "einsum-reference"])
def test_pasted_library_and_checker_code_is_refused(name, fn, call, rules):
    """By identity (the library's code by the policy first where it reads a dunder); the einsum reference imports
    the FLOP counter."""
    text = fails(name, pasted(fn, name, call)).text()
    assert any(f"rule '{r}'" in text for r in rules), text


@pytest.mark.parametrize("src", [
    harness("t0 = time.thread_time(); step(make_input()); out[key].append(time.thread_time() - t0)"),
    harness("t0 = time.thread_time(); y = step(make_input()); out[key].append(time.thread_time() - t0); "
            "y.sum().backward()"),
    harness(loops='for key, step in (("a", step_a), ("b", step_b)):\n        for _ in range(reps):'),
    "def time_pair(step_a, step_b, make_input, reps):\n    return {'a': [1.0] * reps, 'b': [2.0] * reps}",
    harness("t0 = time.thread_time(); step(make_input()).sum().backward(); out[key].append(t0)"),
], ids=["forwards-only", "backward-untimed", "not-interleaved", "made-up", "clock-not-read"])
def test_harnesses_that_time_the_wrong_thing_fail(src):
    """Forwards only (B's extra cost is in its backward), the backward run untimed, all of A then all of B, made-up
    numbers without a step run, the clock read before the step and never after."""
    fails(TIMING, src)


MADE_UP_AFTER_RUNNING = """
def time_pair(step_a, step_b, make_input, reps):             # runs both steps as asked, then makes numbers up
    for _ in range(reps):
        for step in (step_a, step_b):
            step(make_input()).sum().backward()
    return {"a": [1.0] * reps, "b": [2.0] * reps}
"""


@pytest.mark.parametrize("seed", range(6))
def test_made_up_numbers_fail_even_when_the_steps_ran(seed):
    """The call log is right; the timings are 1 s and 2 s for steps that cost milliseconds."""
    fails(TIMING, MADE_UP_AFTER_RUNNING, seed=seed)


def test_a_harness_cannot_read_the_steps_costs():
    """The steps' costs are in their closures: reached by names built from strings, through a module torch holds."""
    fails(TIMING, """
    def time_pair(step_a, step_b, make_input, reps):
        get = torch.functional.operator.attrgetter
        def cost(step):
            Step = get("__clo" + "sure__")(step)[0].cell_contents
            return sum(c.cell_contents for f in ("forward", "backward") for c in get(f + ".__clo" + "sure__")(Step)
                       if type(c.cell_contents) is float)
        for _ in range(reps):
            for step in (step_a, step_b):
                step(make_input()).sum().backward()
        return {"a": [cost(step_a)] * reps, "b": [cost(step_b)] * reps}
    """, "module-escape")


def test_the_flop_counter_is_out_of_reach_at_run_time():
    fails(EINSUM, """
    def einsum_overhead(T, E, C, d, h, k):
        Counter = torch.functional.operator.attrgetter("utils.flop_" + "counter.FlopCounter" + "Mode")(torch)
        fc = Counter(display=False)
        with torch.device("meta"), fc:
            y = torch.einsum("tec,td->ecd", torch.empty(T, E, C, requires_grad=True), torch.empty(T, d))
            y.backward(torch.empty_like(y))
        return 2 * fc.get_total_flops() / (12 * T * k * d * h)
    """)


@pytest.mark.parametrize("src", [
    "def einsum_overhead(T, E, C, d, h, k):\n    return 2 * 2 * T * E * C * d / (12 * T * k * d * h)",  # fwd only
    "def einsum_overhead(T, E, C, d, h, k):\n    return 3 * 2 * T * E * C * d / (12 * T * k * d * h)",  # one einsum
    "def einsum_overhead(T, E, C, d, h, k):\n    return 2 * E * C / (k * h)",                         # twice over
    "def einsum_overhead(T, E, C, d, h, k):\n    return E * C / h",                                   # k forgotten
    f"TABLE = {dict((c, float(ch08.einsum_overhead_reference(*c))) for c in ch08.EINSUM_VISIBLE)!r}\n"
    "def einsum_overhead(T, E, C, d, h, k):\n    return TABLE[(T, E, C, d, h, k)]",                # lookup table
], ids=["einsums-forward-only", "one-einsum", "twice", "k-forgotten", "lookup-table"])
def test_wrong_flop_counts_fail(src):
    fails(EINSUM, src)


@pytest.mark.parametrize("src", [
    combine("out", w="torch.ones_like(score)"),                                      # the scores ignored
    combine("out", token="pos % T"),                                                 # rows to token pos % T
    "TABLE = " + repr({str(c[1].tolist()): ch08.combine_reference(*c)[0].tolist() for c in ch08._combine_visible()})
    + "\ndef combine_index_add(y_sorted, pos, score):                # a lookup table, with a gradient path\n"
    "    return torch.tensor(TABLE[str(pos.tolist())], dtype=y_sorted.dtype) + 0 * y_sorted.sum() + 0 * score.sum()",
], ids=["scores-ignored", "wrong-token", "lookup-table"])
def test_wrong_combines_fail(src):
    fails(COMBINE, src)
