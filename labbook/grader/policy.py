"""The grader's static policy: what a solution's source may contain, checked on its syntax tree before any of it
runs. (Used by every chapter's exercises; chapter 00 explains the grader.)

A solution is the text of its cell. It may import only what its exercise allows (``torch`` and ``math`` by default),
and it may not reach around the exercise: no dynamic code (``exec``, ``eval``, ``compile``, ``__import__``), no
reflection (``getattr``, ``globals``, dunder or private attributes such as ``__code__`` or ``_C``, frame attributes
such as ``gi_frame``), no module reached through an attribute of an allowed one (``torch.os``, ``torch.sys``), none
of torch's doors to other code (``torch.utils``, ``torch.ops``, ``torch.jit``, ``torch.multiprocessing``, ...), no
assignment to an attribute of a module (patching ``torch.allclose``), and no attribute an exercise names as its
answer (``tensor_split`` for a batch split). Each refusal names the line and the rule in words.
"""
from __future__ import annotations

import ast
import contextlib
import types
from dataclasses import dataclass

# names that run or build code, or reach objects by name: never needed by an exercise
DYNAMIC = frozenset({"exec", "eval", "compile", "__import__", "importlib", "breakpoint"})
REFLECTION = frozenset({"getattr", "setattr", "delattr", "globals", "locals", "vars", "open", "input", "help",
                        "memoryview", "exit", "quit"})
FRAME_ATTRS = frozenset({"gi_frame", "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "tb_frame", "tb_next",
                         "f_back", "f_locals", "f_globals", "f_builtins", "f_code", "f_trace", "co_code",
                         "co_consts", "co_names", "mro", "with_traceback", "cell_contents"})
# torch's doors to code or processes outside the exercise (whatever module they are reached from)
TORCH_DOORS = frozenset({"ops", "library", "classes", "compile", "compiler", "load", "save", "hub", "jit", "fx",
                         "export", "package", "utils", "multiprocessing", "overrides", "cpp", "serialization",
                         "profiler", "onnx", "from_file"})
# torch submodules a solution may reach through ``torch.`` (plain maths and autograd)
SAFE_TORCH = frozenset({"torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.linalg", "torch.fft",
                        "torch.special", "torch.autograd", "torch.random", "torch.return_types", "torch.types",
                        "torch.masked", "torch.sparse", "torch.nested", "torch.func", "torch.cpu", "torch.cuda",
                        "torch.backends", "torch.amp", "torch.testing", "torch.version", "torch.torch_version"})
DUNDER_DEFS_ALLOWED = frozenset({"__init__", "__call__", "__len__", "__iter__", "__next__", "__getitem__",
                                 "__repr__"})

RULES = {
    "syntax": "the cell is not plain Python (IPython magics such as %time or !ls are not run by the grader)",
    "import": "imports outside the exercise's list",
    "dynamic-code": "running or building code at run time (exec, eval, compile, __import__)",
    "reflection": "reaching objects by name or opening files (getattr, globals, vars, open, ...)",
    "private": "private or dunder attributes (__code__, __class__, _C, ...) are not part of any exercise",
    "frames": "reading frames, code objects or tracebacks (gi_frame, f_back, tb_frame, ...)",
    "module-escape": "a module reached through an attribute of an allowed one (torch.os, torch.sys, ...)",
    "torch-door": "torch's doors to other code (torch.utils, torch.ops, torch.jit, torch.multiprocessing, ...)",
    "patching": "changing a module's attributes (torch.allclose = ...): the grader's copy of torch is not yours",
    "dunder-def": "defining special methods that change how the grader sees a value (__eq__, __torch_function__)",
    "exercise": "a function that IS the exercise's answer",
    "missing": "the solution cell must define the exercise's function with `def`",
}


@dataclass(frozen=True)
class Refusal:
    """One broken rule: the line (in the cell), the rule's id and what was found."""
    line: int
    rule: str
    found: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.found} -- rule '{self.rule}': {RULES[self.rule]}"


@dataclass(frozen=True)
class Policy:
    """What one exercise allows. ``imports``: the modules its solution may import (``import torch.nn.functional as
    F`` needs ``torch.nn.functional``); ``provided``: names given to the solution without an import (``torch``,
    ``nn``, ...: the chapter's imports); ``answers``: attribute or function names that are the answer (refused
    wherever they appear), ``answers_why`` says why in the student's words."""
    imports: frozenset = frozenset({"torch", "math"})
    provided: tuple = (("torch", "torch"), ("math", "math"))
    answers: frozenset = frozenset()
    answers_why: str = ""

    def allowed_module(self, name: str) -> bool:
        return name in self.imports or (name in SAFE_TORCH and "torch" in self.imports)


def _escapes(policy: Policy) -> dict:
    """Attribute names that lead, from any module the solution can reach (the allowed ones and every torch
    submodule, however deep: ``torch.functional.operator``, ``torch.cuda.graphs.gc``), to a module outside torch
    the solution may not use: ``{name: module it leads to}`` (``os``, ``sys``, ``operator``, ``gc``, ...).
    torch's own submodules are plain maths, except the doors (:data:`TORCH_DOORS`), refused by name."""
    import importlib
    import sys
    import warnings

    for name in sorted(policy.imports):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import torch

    def own(mod):                                          # x.t(), torch.random: torch's own names, not escapes
        return {n for n, v in vars(mod).items()
                if not (isinstance(v, types.ModuleType) and not v.__name__.startswith("torch"))}

    public = own(torch) | set(dir(torch.Tensor))
    found = {}
    reachable = [m for n, m in list(sys.modules.items())
                 if isinstance(m, types.ModuleType) and (n in policy.imports or n == "torch" or n.startswith("torch."))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                     # deprecated aliases warn when read
        for mod in reachable:
            for attr, value in list(vars(mod).items()):
                if (isinstance(value, types.ModuleType) and not value.__name__.startswith("torch")
                        and not policy.allowed_module(value.__name__) and attr not in public):
                    found.setdefault(attr, value.__name__)
    return found


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


class _Checker(ast.NodeVisitor):
    def __init__(self, policy: Policy):
        self.policy, self.found = policy, []
        self.escapes = _escapes(policy)
        self.module_names = {alias for alias, _ in policy.provided}

    def refuse(self, node, rule, found):
        self.found.append(Refusal(getattr(node, "lineno", 0), rule, found))

    # imports -------------------------------------------------------------------------------------------------
    def visit_Import(self, node):
        for alias in node.names:
            if not self.policy.allowed_module(alias.name):
                self.refuse(node, "import", f"`import {alias.name}` (this exercise allows: "
                            f"{', '.join(sorted(self.policy.imports))})")
            self.module_names.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node):
        base = "." * node.level + (node.module or "")
        for alias in node.names:
            if alias.name == "*":
                self.refuse(node, "import", f"`from {base} import *` (name what you import)")
                continue
            full = f"{base}.{alias.name}"
            if node.level or not (self.policy.allowed_module(base) or self.policy.allowed_module(full)):
                self.refuse(node, "import", f"`from {base} import {alias.name}` (this exercise allows: "
                            f"{', '.join(sorted(self.policy.imports))})")
            self._attr_name(node, alias.name)
            if self.policy.allowed_module(full):
                self.module_names.add(alias.asname or alias.name)

    # names and attributes --------------------------------------------------------------------------------------
    def visit_Name(self, node):
        if node.id in DYNAMIC:
            self.refuse(node, "dynamic-code", f"`{node.id}`")
        elif node.id in REFLECTION:
            self.refuse(node, "reflection", f"`{node.id}`")
        elif node.id.startswith("__"):
            self.refuse(node, "private", f"`{node.id}`")
        elif node.id in self.policy.answers:
            self.refuse(node, "exercise", f"`{node.id}` ({self.policy.answers_why})")

    def visit_Attribute(self, node):
        self._attr_name(node, node.attr)
        self.generic_visit(node)

    def _attr_name(self, node, attr):
        if attr.startswith("_"):
            self.refuse(node, "private", f"attribute `.{attr}`")
        elif attr in FRAME_ATTRS:
            self.refuse(node, "frames", f"attribute `.{attr}`")
        elif attr in self.policy.answers:
            self.refuse(node, "exercise", f"`.{attr}` ({self.policy.answers_why})")
        elif attr in TORCH_DOORS:
            self.refuse(node, "torch-door", f"attribute `.{attr}`")
        elif attr in self.escapes:
            self.refuse(node, "module-escape", f"attribute `.{attr}` (the module `{self.escapes[attr]}`)")

    # definitions and assignments --------------------------------------------------------------------------------
    def _def(self, node):
        if _is_dunder(node.name):
            if node.name not in DUNDER_DEFS_ALLOWED:
                self.refuse(node, "dunder-def", f"`def {node.name}`")
        elif node.name.startswith("__"):
            self.refuse(node, "private", f"`def {node.name}`")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _def

    def _targets(self, node, targets):
        """Refuse assigning to an attribute reached from a module (``torch.allclose = ...``); an index that
        mentions a module (``mask[torch.arange(n)] = 1``) writes into the solution's own tensor."""
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                self._targets(node, t.elts)
                continue
            if isinstance(t, ast.Starred):
                self._targets(node, [t.value])
                continue
            sub = t
            while isinstance(sub, (ast.Attribute, ast.Subscript)):
                if isinstance(sub, ast.Attribute) and _root_name(sub) in self.module_names:
                    self.refuse(node, "patching", f"assigning to `{ast.unparse(t)}`")
                    break
                sub = sub.value

    def visit_Assign(self, node):
        self._targets(node, node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        self._targets(node, [node.target])
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._targets(node, node.targets)
        self.generic_visit(node)


def check_source(source: str, function: str, policy: Policy) -> tuple:
    """``(module ast to run, refusals, notes)`` for a solution cell. The module keeps the cell's imports,
    definitions and assignments; top-level expressions (a demo call, a print) are left out, each with a note."""
    try:
        tree = ast.parse(source, "<solution>")
    except SyntaxError as exc:
        return None, [Refusal(exc.lineno or 0, "syntax", f"{exc.msg}: {(exc.text or '').strip()[:60]!r}")], []
    checker = _Checker(policy)
    checker.visit(tree)
    kept, notes = [], []
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr):
            if not (isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                notes.append(f"line {stmt.lineno}: `{ast.unparse(stmt)[:60]}` is not run by the grader "
                             "(a top-level expression)")
            continue
        kept.append(stmt)
    tree.body = kept
    if not any(isinstance(s, ast.FunctionDef) and s.name == function for s in kept):
        checker.found.append(Refusal(1, "missing", f"no top-level `def {function}(...)` in the cell"))
    return tree, sorted(checker.found, key=lambda r: r.line), notes
