"""Red team for chapter 08's exercise checkers (labbook/checkers/ch08.py): the honest solution passes, every
shortcut fails. Exercise 1: the combine as one index_add (and its timing harness); exercise 2: the one-hot einsums'
FLOP overhead."""
import json
import pathlib
import time

import pytest
import torch
from cheats import must_fail, must_pass

from labbook.checkers import ch08
from labutils.moe import combine, gather, gather_combine
from labutils.moe.functions import MOEGatherCombine

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "08_performance.ipynb"


# ---- exercise 1: combine_index_add ----------------------------------------------------------------------------
def combine_index_add(y_sorted, pos, score):
    T, k = score.shape
    w = score.reshape(-1)[pos].unsqueeze(1).to(y_sorted.dtype)             # (N, 1)
    token = torch.div(pos, k, rounding_mode="floor")                        # (N,)
    return y_sorted.new_zeros(T, y_sorted.shape[1]).index_add(0, token, y_sorted * w)


def test_combine_honest_passes():
    must_pass(ch08.check_combine_index_add, combine_index_add)


_VISIBLE = {}


def _remember_visible():
    gen = torch.Generator().manual_seed(8)
    for T, E, k, d, drop in ch08.COMBINE_VISIBLE:
        y, pos, score, g = ch08._combine_case(T, E, k, d, gen, drop)
        _VISIBLE[(tuple(y.shape), tuple(pos.tolist()))] = ch08.combine_reference(y, pos, score, g)[0]


def _table(y_sorted, pos, score):
    if not _VISIBLE:
        _remember_visible()
    out = _VISIBLE[(tuple(y_sorted.shape), tuple(pos.tolist()))]
    return out + 0 * y_sorted.sum() + 0 * score.sum()                       # keeps a gradient path


@pytest.mark.parametrize("cheat", [
    lambda y, pos, s: gather_combine(y, pos, s),                                    # the library's fused combine
    lambda y, pos, s: MOEGatherCombine.apply(y, pos, s),                            # its autograd Function
    lambda y, pos, s: combine(gather(y, pos, s.numel()), s),                        # sibling: gather + combine
    _table,                                                                          # lookup table of visible cases
    lambda y, pos, s: combine_index_add(y.detach(), pos, s.detach()),               # no gradient path
    lambda y, pos, s: combine_index_add(y.double(), pos, s.double()),               # float64 output
    lambda y, pos, s: combine_index_add(y, pos, s.detach()),                        # no gradient to the scores
    lambda y, pos, s: combine_index_add(y, pos, torch.ones_like(s)),               # scores ignored
    lambda y, pos, s: y.new_zeros(s.shape[0], y.shape[1]).index_add(0, pos % s.shape[0], y),  # wrong token map
], ids=["gather_combine", "MOEGatherCombine", "gather+combine", "lookup-table", "detached", "float64",
        "no-score-grad", "scores-ignored", "wrong-token"])
def test_combine_cheats_fail(cheat):
    must_fail(ch08.check_combine_index_add, cheat)


# ---- exercise 1, timing half: time_pair ----------------------------------------------------------------------
def time_pair(step_a, step_b, make_input, reps):
    times = {"a": [], "b": []}
    for _ in range(reps):
        for key, step in (("a", step_a), ("b", step_b)):
            x = make_input()
            t0 = time.thread_time()
            step(x).sum().backward()
            times[key].append(time.thread_time() - t0)
    return times


def test_time_pair_honest_passes():
    must_pass(ch08.check_time_pair, time_pair)


def _bench_cheat(step_a, step_b, make_input, reps):
    from labutils.perf.timing import bench
    t = bench({"a": lambda: step_a(make_input()).sum().backward(),
               "b": lambda: step_b(make_input()).sum().backward()}, reps=reps, warmup=0)
    return {"a": t["a"], "b": t["b"]}


def _forward_only(step_a, step_b, make_input, reps):
    times = {"a": [], "b": []}
    for _ in range(reps):
        for key, step in (("a", step_a), ("b", step_b)):
            x = make_input()
            t0 = time.thread_time()
            y = step(x)
            times[key].append(time.thread_time() - t0)
            y.sum().backward()
    return times


def _not_interleaved(step_a, step_b, make_input, reps):
    times = {"a": [], "b": []}
    for key, step in (("a", step_a), ("b", step_b)):
        for _ in range(reps):
            x = make_input()
            t0 = time.thread_time()
            step(x).sum().backward()
            times[key].append(time.thread_time() - t0)
    return times


def _made_up(step_a, step_b, make_input, reps):
    return {"a": [1.0] * reps, "b": [2.0] * reps}                          # the first visible case's ratio


def _timer_cheat(step_a, step_b, make_input, reps):
    from torch.utils.benchmark import Timer
    out = {}
    for key, step in (("a", step_a), ("b", step_b)):
        m = Timer("step(make_input()).sum().backward()", globals={"step": step, "make_input": make_input})
        out[key] = [m.timeit(1).mean for _ in range(reps)]
    return out


@pytest.mark.parametrize("cheat", [_bench_cheat, _timer_cheat, _made_up, _forward_only, _not_interleaved],
                         ids=["labutils-bench", "torch-Timer", "made-up-numbers", "forward-only", "not-interleaved"])
def test_time_pair_cheats_fail(cheat):
    must_fail(ch08.check_time_pair, cheat)


# ---- exercise 2: einsum_overhead ------------------------------------------------------------------------------
def einsum_overhead(T, E, C, d, h, k):
    return 2 * 3 * 2 * T * E * C * d / (12 * T * k * d * h)


def test_einsum_honest_passes():
    must_pass(ch08.check_einsum_overhead, einsum_overhead)


def _count_lab_einsum(T, E, C, d, h, k):
    from torch.utils.flop_counter import FlopCounterMode

    from labutils.perf import dispatch as D
    p = D.make_problem(T, d, h, E, k, limits=False)
    with FlopCounterMode(display=False) as fc:
        D.fwd_bwd(D.einsum, p)
    return fc.get_total_flops() / p.flops()


def _flop_counter(T, E, C, d, h, k):
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"), FlopCounterMode(display=False) as fc:
        m, x = torch.empty(T, E, C, requires_grad=True), torch.empty(T, d, requires_grad=True)
        y = torch.einsum("tec,td->ecd", m, x)
        y.backward(torch.empty_like(y))
    return 2 * fc.get_total_flops() / (12 * T * k * d * h)


_EIN_TABLE = {c: float(ch08.einsum_overhead_reference(*c)) for c in ch08.EINSUM_VISIBLE}


@pytest.mark.parametrize("cheat", [
    _count_lab_einsum,                                                         # the lab's einsum design, counted
    _flop_counter,                                                             # torch's FLOP counter itself
    lambda *c: _EIN_TABLE[c],                                                  # lookup table of visible cases
    lambda T, E, C, d, h, k: 2 * 2 * T * E * C * d / (12 * T * k * d * h),    # forward only
    lambda T, E, C, d, h, k: 3 * 2 * T * E * C * d / (12 * T * k * d * h),    # one einsum, not two
    lambda T, E, C, d, h, k: E * C / h,                                        # k forgotten
], ids=["lab-einsum-counted", "flop-counter", "lookup-table", "forward-only", "one-einsum", "k-forgotten"])
def test_einsum_cheats_fail(cheat):
    must_fail(ch08.check_einsum_overhead, cheat)


def test_the_chapter_gives_no_answer_away():
    """Notebook-global cheats: the checker cells only call the checkers (no reference, formula or case table
    defined in the notebook for a student to copy or read), and the solution cells are the ones tested here."""
    nb = json.loads(NOTEBOOK.read_text())
    checkers = ["".join(c["source"]) for c in nb["cells"] if "checker" in c.get("metadata", {}).get("tags", [])]
    assert len(checkers) >= 3, "chapter 08 has three exercise checker cells"
    for src in checkers:
        code = [line for line in src.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert all("ch08." in line or line.startswith(("from labbook", "import")) for line in code), src
        assert "def " not in src and "lambda" not in src and "E * C" not in src, src
