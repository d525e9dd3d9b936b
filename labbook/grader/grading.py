"""Grading one solution, from its source, in the grading parent. (Part of the grader; see :mod:`labbook.grader`.)

1. the static policy reads the cell's syntax tree (:mod:`~labbook.grader.policy`); a refusal names line and rule;
2. identity by content: the same code as a library or chapter function is refused (:mod:`~labbook.grader.identity`);
3. a sandboxed child is forked and loads the source (:mod:`~labbook.grader.sandbox`), before any case exists;
4. only then does the parent import the chapter's checker module, draw the hidden cases from a seed of its own,
   and compute each reference; the child gets each case's inputs as plain tensors, its answers come back as plain
   data and are compared here (:mod:`~labbook.grader.answers`).
"""
from __future__ import annotations

import dataclasses
import importlib
import random
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field

import torch

from labbook.grader import catalog, channel, identity, policy
from labbook.grader.answers import compare
from labbook.grader.process import Child


@dataclass
class Report:
    """What the grader says about one solution: ``passed``, a one-line ``reason`` when not, the ``lines`` a student
    sees (visible cases, the hidden count, the verdict), the hidden ``seed`` (None when no case ran)."""
    exercise: str
    chapter: str
    passed: bool
    reason: str = ""
    lines: list = field(default_factory=list)
    seed: int | None = None

    def text(self) -> str:
        return "\n".join(self.lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _refused(entry, reason: str, lines: list) -> Report:
    return Report(entry.function, entry.chapter, False, reason, lines + [f"❌ {entry.function}: {reason}"])


def _load_failure(entry, msg: dict) -> str:
    where = f" at line {msg['line']}" if msg.get("line") else ""
    hint = (" -- rule 'cell-alone': the grader runs your solution cell alone, without the notebook: define or "
            "import everything it uses in that cell" if msg.get("type") == "NameError" else "")
    return f"running your cell raised {msg.get('type')}{where}: {msg.get('message')}{hint}"


def _reply_problem(reply: dict) -> str | None:
    kind = reply.get("kind")
    if kind == "blank":
        return "not written yet (NotImplementedError)"
    if kind == "raised":
        where = f" at line {reply['line']} of your cell" if reply.get("line") else ""
        said = f"your function raised {reply['type']}{where}: {reply['message'][:200]}"
        if "grader policy" in reply["message"]:
            return said + " -- rule 'sandbox': the grader's process refuses this"
        if reply["type"] == "NameError":
            return said + " -- rule 'cell-alone': the grader runs your solution cell alone, without the notebook"
        return said
    if kind == "wrong":
        return f"{reply['message']} -- rule '{reply.get('rule', 'exercise')}'"
    if kind == "mutated":
        return ("your function changed its input in place -- rule 'read-only-inputs': copy an input before "
                "changing it")
    if kind != "answer":
        return f"unexpected reply {kind!r}"
    return None


def prepare(name: str, source: str) -> tuple:
    """``(entry, tree, refusal report or None, notes)``: the policy and identity checks, no process started."""
    entry = catalog.entry(name)
    if not isinstance(source, str):
        raise TypeError(f"source: the text of your solution cell (a str), got {type(source).__name__}")
    tree, refusals, notes = policy.check_source(source, entry.function, entry.policy)
    if refusals:
        lines = [f"refused before running: {r}" for r in refusals[:6]]
        return entry, None, _refused(entry, f"refused: {refusals[0]}", lines), notes
    same = identity.matches(compile(tree, "<solution>", "exec"))
    if same:
        fn, where = same[0]
        reason = (f"refused: `{fn}` is the same code as {where} (pasted library code, under any name) "
                  "-- rule 'identity': write it yourself")
        return entry, None, _refused(entry, reason, []), notes
    return entry, tree, None, notes


def grade(name: str, source: str, seed: int | None = None, n_hidden: int | None = None,
          case_timeout_s: float | None = None) -> Report:
    """Grade the solution ``source`` (the text of its cell) of exercise ``name`` (see :mod:`catalog`); ``seed`` and
    ``n_hidden`` fix the hidden cases, ``case_timeout_s`` replaces the exercise's time limit per case."""
    entry, tree, refused, notes = prepare(name, source)
    if refused is not None:
        return refused
    if case_timeout_s is not None:
        if not isinstance(case_timeout_s, (int, float)) or not 0 < case_timeout_s <= 3600:
            raise ValueError(f"case_timeout_s={case_timeout_s!r}: seconds, in (0, 3600]")
        entry = dataclasses.replace(entry, case_timeout_s=float(case_timeout_s))
    if n_hidden is not None and (not isinstance(n_hidden, int) or isinstance(n_hidden, bool) or n_hidden < 0):
        raise ValueError(f"n_hidden={n_hidden!r}: a number of hidden cases >= 0")
    seed = secrets.randbits(62) if seed is None else int(seed)
    if entry.adapter == "distributed":
        return _grade_distributed(entry, tree, seed, n_hidden, notes)
    child = Child(entry, tree)                                   # forked before any case exists
    try:
        try:
            ready = child.wait_reply(entry.load_timeout_s)
        except channel.Timeout:
            return _refused(entry, f"loading your cell took over {entry.load_timeout_s:.0f} s", notes)
        except EOFError:
            return _refused(entry, child.died() + " while loading your cell", notes + child.printed_lines())
        if ready.get("kind") != "ready":
            return _refused(entry, _load_failure(entry, ready), notes + child.printed_lines())
        cases = importlib.import_module(f"labbook.checkers.ch{entry.chapter}").CASES[entry.function]()
        drawn = _draw(cases, seed, n_hidden)
        return _run_cases(entry, cases, drawn, seed, notes, lambda args: child.ask(args, entry.case_timeout_s),
                          child)
    finally:
        child.stop()


def _draw(cases, seed: int, n_hidden: int | None) -> list:
    """``[(label, args, visible, want)]``: every case with its reference, computed before any answer exists."""
    gen = torch.Generator().manual_seed(seed)
    n = cases.n_hidden if n_hidden is None else n_hidden
    drawn = [(f"case {i}", tuple(c) if isinstance(c, tuple) else (c,), True) for i, c in enumerate(cases.visible)]
    if cases.hidden is not None:
        for i in range(n):
            c = cases.hidden(gen, i)
            drawn.append((f"hidden {i}", tuple(c) if isinstance(c, tuple) else (c,), False))
    return [(label, args, visible, cases.reference(*args)) for label, args, visible in drawn]


def _tolerance(cases, args) -> tuple:
    return cases.tolerance(*args) if cases.tolerance is not None else (cases.rtol, cases.atol)


def _judge(cases, label, args, reply, want) -> tuple:
    """(lines, ok) for one case's reply."""
    problem = _reply_problem(reply)
    if problem is not None:
        return [f"{label}: {problem}"], False
    got = reply["value"]
    if cases.reduce is not None:
        try:
            got = cases.reduce(got, args)
        except AssertionError as exc:
            return [f"{label}: {exc}"], False
    rtol, atol = _tolerance(cases, args)
    return compare(label, got, want, rtol, atol)


class _Tally:
    """The cases' lines as they come: visible cases printed, hidden ones counted, the failures named."""

    def __init__(self, notes: list):
        self.lines, self.failures, self.hidden_bad, self.hidden_n = list(notes), [], [], 0

    def add(self, label: str, visible: bool, case_lines: list, ok: bool) -> None:
        if visible:
            self.lines += case_lines
        else:
            self.hidden_n += 1
            if not ok:
                self.hidden_bad.append(case_lines[-1])
        if not ok:
            self.failures.append(label)

    def report(self, entry, total: int, seed: int, printed: list) -> Report:
        return _verdict(entry, self.lines, self.failures, self.hidden_bad, self.hidden_n, total, seed, printed)


def _run_cases(entry, cases, drawn, seed, notes, ask, child) -> Report:
    tally, stopped = _Tally(notes), None
    for label, args, visible, want in drawn:
        if stopped is None:
            try:
                case_lines, ok = _judge(cases, label, args, ask(args), want)
            except channel.Timeout:
                stopped = (f"{label}: no answer within {entry.case_timeout_s:g} s (an endless loop?) -- rule "
                           "'time-limit'; stopped")
                case_lines, ok = [stopped], False
                child.stop()
            except EOFError:
                stopped = f"{label}: {child.died()} -- rule 'crash'"
                case_lines, ok = [stopped], False
        else:
            case_lines, ok = [f"{label}: not run ({stopped.split(': ', 1)[1]})"], False
        tally.add(label, visible, case_lines, ok)
    return tally.report(entry, len(drawn), seed, child.printed_lines())


def _verdict(entry, lines, failures, hidden_bad, hidden_n, total, seed, printed) -> Report:
    name = entry.function
    if hidden_n:
        lines.append(f"{name}: {hidden_n - len(hidden_bad)} of {hidden_n} hidden cases match"
                     + (f"; first problem: {hidden_bad[0].strip()}" if hidden_bad else ""))
    lines += printed
    if failures:
        shown = ", ".join(failures[:6]) + (" ..." if len(failures) > 6 else "")
        reason = f"{len(failures)} of {total} cases wrong, missing or refused ({shown}); hidden seed {seed}"
        return Report(name, entry.chapter, False, reason, lines + [f"❌ {name}: {reason}"], seed)
    lines.append(f"✅ {name}: all {total} cases match ({total - hidden_n} visible, {hidden_n} hidden), "
                 "graded in a fresh sandboxed process")
    return Report(name, entry.chapter, True, "", lines, seed)


# --- distributed exercises: every rank a sandbox --------------------------------------------------------------

def _grade_distributed(entry, tree, seed: int, n_hidden: int | None, notes: list) -> Report:
    """Every case's ranks are forked up front (they know only their rank and world size); each rank's inputs are
    then drawn here from a generator no rank holds, and sent to that rank alone."""
    structure_rng = random.Random(seed)
    cases_mod = importlib.import_module(f"labbook.checkers.ch{entry.chapter}")
    shapes = cases_mod.STRUCTURE[entry.function]
    n = shapes["n_hidden"] if n_hidden is None else n_hidden
    structures = [(f"case {i}", s, True) for i, s in enumerate(shapes["visible"])]
    structures += [(f"hidden {i}", shapes["hidden"](structure_rng, i), False) for i in range(n)]
    tmp = tempfile.mkdtemp(prefix="lab-grade-")
    groups = []
    try:
        for j, (_, (world, *_rest), _) in enumerate(structures):
            groups.append([Child(entry, tree, dist_init=(f"{tmp}/store{j}", r, world)) for r in range(world)])
        for group in groups:                                      # every rank loads the cell and joins its group
            for rank, child in enumerate(group):
                try:
                    msg = child.wait_reply(entry.load_timeout_s)
                except (channel.Timeout, EOFError):
                    return _refused(entry, f"rank {rank} did not start (loading your cell or joining the group)",
                                    notes + child.printed_lines())
                if msg.get("kind") != "ready":
                    return _refused(entry, f"rank {rank}: " + _load_failure(entry, msg),
                                    notes + child.printed_lines())
        cases = cases_mod.CASES[entry.function]()
        gen = torch.Generator().manual_seed(secrets.randbits(62))  # no rank holds this seed
        tally, printed = _Tally(notes), []
        for (label, structure, visible), group in zip(structures, groups):
            per_rank = cases.inputs(gen, *structure)               # [rank][input]
            want = cases.reference(per_rank)                       # [rank][input]
            case_lines, ok = _run_ranks(entry, cases, label, group, per_rank, want)
            printed = printed or [p for c in group for p in c.printed_lines(4)]
            tally.add(label, visible, case_lines, ok)
        return tally.report(entry, len(structures), seed, printed)
    finally:
        for group in groups:
            for child in group:
                child.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _run_ranks(entry, cases, label, group, per_rank, want) -> tuple:
    for child, inputs in zip(group, per_rank):
        channel.send(child.to, {"kind": "case", "args": (list(inputs),)})
    lines, ok = [], True
    for rank, (child, expected) in enumerate(zip(group, want)):
        try:
            reply = child.wait_reply(entry.case_timeout_s)
        except channel.Timeout:
            return lines + [f"{label}: rank {rank} gave no answer within {entry.case_timeout_s:g} s "
                            "(stuck in a collective the other ranks did not call?) -- rule 'time-limit'"], False
        except EOFError:
            return lines + [f"{label}: rank {rank}: {child.died()} -- rule 'crash'"], False
        rank_lines, good = _judge(cases, f"{label} rank {rank}", (), reply, list(expected))
        lines += rank_lines if not good or rank == 0 else []
        ok &= good
    if ok and len(group) > 1:
        lines.append(f"{label}: every one of the {len(group)} ranks holds the same, right answer")
    return lines, ok
