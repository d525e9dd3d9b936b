"""The package's shape (issue 25: one concept, one place), checked on the files on disk.

* The import graph of ``labutils`` (module level and inside functions) has no cycle and no arrow up the layers:
  foundation < MoE core < its wings (the fastmoe face, the modern wing) < DeepSpeed wing < models/training;
  ``labutils`` never imports ``labbook`` (the book's machinery, chapter 08's ``perf`` included, which may import
  anything of ``labutils``).
* No public name is defined twice under ``labutils/`` (the fastmoe face's fastmoe-named adapters excepted), and no
  public module of either package declares (``__all__``, a ``# noqa: F401`` re-export) a name another defines: one
  address per name (issue 39), the faces excepted (``labutils.moe``, ``labutils.ds``, fastmoe's names on its face).
* No module over 300 lines and no class over 150, in ``labutils`` and ``labbook``; ``labutils`` smaller than the
  9,222 lines it had when the issue was filed.
* Each coursework copy of ``tools/coursework_copies.py`` (helper, + MoE core, + DeepSpeed wing), copied alone into an
  empty project, imports every module it holds and runs what it is for.
"""
from __future__ import annotations

import ast
import graphlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import coursework_copies  # noqa: E402

PACKAGES = ("labutils", "labbook")
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_PACKAGE_LINES = 300, 150, 9_222
# fastmoe's names (fmoe.functions), kept with fastmoe's signatures as thin adapters over the core's definitions
FACE = "labutils/moe/fastmoe/api.py"
FACE_NAMES = {"count_by_gate", "MOEScatter", "MOEGather", "AllGather", "limit_by_capacity"}


def _files(package: str) -> list:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def import_graph(package: str = "labutils") -> dict:
    """module -> the package modules it imports (module level and inside functions)."""
    paths = {_module(p): p for p in _files(package)}
    graph = {}
    for name, path in paths.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
                target = ".".join(p for p in (base, node.module) if p)
                cands = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            deps |= {c for c in cands if c.split(".")[0] in PACKAGES and c != name}
        graph[name] = deps
    return graph


def layer(module: str) -> int:
    short = module.removeprefix("labutils.")
    if module.startswith("labbook"):
        return 9
    for prefix, rank in (("models", 6), ("train", 6), ("ds", 5), ("moe.fastmoe", 4),
                         ("moe.modern", 4), ("moe", 3)):
        if short == prefix or short.startswith(prefix + "."):
            return rank
    return 1  # foundation: launch, workers, collectives, compare, presets, plots, params, notebook tools, ...


def layering_problems(graph: dict) -> list:
    shims = {m for m in graph if m.endswith(".entry")}  # the one shim file: forwards an old path, resolved lazily
    inner = {m: {d for d in deps if (d in graph or d.startswith("labbook")) and d != "labutils"}
             for m, deps in graph.items() if m not in shims}
    graphlib.TopologicalSorter(inner).prepare()  # raises CycleError naming the cycle
    return sorted(f"{m} -> {d}" for m, deps in inner.items() for d in deps
                  if layer(d) > layer(m) or (d.startswith("labbook") and m.startswith("labutils")))


def test_no_import_cycles_and_no_import_climbs_up():
    problems = layering_problems(import_graph("labutils"))
    assert not problems, "imports that climb back up a layer:\n" + "\n".join(problems)
    book = import_graph("labbook")
    assert any(d.startswith("labutils") for deps in book.values() for d in deps)  # the checker sees labbook's arrows


def test_the_layering_check_catches_a_climb_and_a_cycle():
    graph = import_graph("labutils")
    assert layering_problems({**graph, "labutils.moe.gates": graph["labutils.moe.gates"] | {"labutils.ds.gating"}})
    assert layering_problems({**graph, "labutils.compare": {"labbook.toys"}})
    with pytest.raises(graphlib.CycleError):
        layering_problems({**graph, "labutils.compare": {"labutils.params"}, "labutils.params": {"labutils.compare"}})


def public_definitions(paths) -> dict:
    """name -> files defining it at top level (def, class, assignment), for modules not named ``_private``."""
    found: dict = {}
    for path in paths:
        if path.name.startswith("_") and path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    getattr(d, "id", getattr(d, "attr", None)) == "overload" for d in node.decorator_list):
                names = []  # a typing.overload stub: the one definition is the undecorated def after it
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                names = []
            for name in names:
                if not name.startswith("_"):
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def duplicated_names(found: dict) -> dict:
    return {name: where for name, where in found.items()
            if len(where) > 1 and not (name in FACE_NAMES and FACE in where and len(where) == 2)}


def test_no_public_name_is_defined_twice():
    twice = duplicated_names(public_definitions(_files("labutils")))
    assert not twice, f"public names defined in more than one place: {twice}"


def test_the_duplicate_name_check_catches_a_second_definition():
    found = public_definitions(_files("labutils"))
    assert "launch" in found and "count_by_gate" in found
    once = {name: where for name, where in found.items() if len(where) == 1}
    planted = {**once, "launch": found["launch"] + ["labutils/params.py"]}
    assert duplicated_names(once) == {} and duplicated_names(planted) == {"launch": planted["launch"]}
    face_and_two = {"count_by_gate": [FACE, "labutils/moe/functions.py", "labutils/moe/capacity.py"]}
    assert duplicated_names(face_and_two) == face_and_two  # the allow-list covers the face's one adapter only


# The faces: a wing's package naming its public API (``labutils.moe``, as fastmoe's ``fmoe`` does; ``labutils.ds``)
# and fastmoe's own names on the fastmoe face. Every other name is imported from the module that defines it.
FACES = {"labutils/moe/__init__.py", "labutils/ds/__init__.py"}
FACE_REEXPORTS = {"Slice", "mark_module_parallel_comm"}  # fmoe.functions' / fmoe.layers' names, on FACE


def second_addresses(paths, root=ROOT) -> list:
    """``module.name -> defining module`` for each name a public module declares (in ``__all__``, or imported with
    ``# noqa: F401``) while another public module of the packages defines it: a second address."""
    public = {_module_at(p, root) for p in paths if not any(part.startswith("_") for part in
                                                             _module_at(p, root).split("."))}
    found = []
    for path in paths:
        name, rel = _module_at(path, root), str(path.relative_to(root))
        if name not in public or rel in FACES:
            continue
        text = path.read_text()
        tree, lines = ast.parse(text), text.splitlines()
        declared = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                declared |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom):
                continue
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(p for p in (base, node.module) if p)
            noqa = "noqa: F401" in "\n".join(lines[node.lineno - 1:node.end_lineno])
            for alias in node.names:
                shown = alias.asname or alias.name
                if (source not in public or f"{source}.{alias.name}" in public or shown.startswith("_")
                        or (rel == FACE and shown in FACE_NAMES | FACE_REEXPORTS)):
                    continue
                if noqa or shown in declared:
                    found.append(f"{name}.{shown} -> {source}.{alias.name}")
    return sorted(found)


def _module_at(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_every_public_name_has_one_address():
    twice = second_addresses(_files("labutils") + _files("labbook"))
    assert not twice, ("names declared again by a module that does not define them (import each from its module; a "
                       "0.x address goes through labutils._deprecate's table):\n" + "\n".join(twice))


def test_the_one_address_check_catches_a_re_export(tmp_path):
    pkg = tmp_path / "labbook" / "hub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from labbook.hub.part import work  # noqa: F401\n")
    (pkg / "part.py").write_text("def work():\n    pass\n")
    (pkg / "other.py").write_text("from .part import work\n\n__all__ = ['work']\n")
    (pkg / "user.py").write_text("from .part import work\n\n\ndef run():\n    return work()\n")  # a use
    paths = sorted(pkg.glob("*.py"))
    assert second_addresses(paths, root=tmp_path) == ["labbook.hub.other.work -> labbook.hub.part.work",
                                                      "labbook.hub.work -> labbook.hub.part.work"]


def oversized(paths, root=ROOT) -> list:
    big = []
    for path in paths:
        text, name = path.read_text(), path.relative_to(root)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{name}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    return big


def test_modules_and_classes_are_small():
    big = oversized(_files("labutils") + _files("labbook"))
    assert not big, f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class:\n" + "\n".join(big)


def test_the_size_check_catches_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("class A:\n" + "    x = 1\n" * 150)    # a 151-line class, 151 lines
    (tmp_path / "long.py").write_text("class A:\n" + "    x = 1\n" * 100 + "y = 2\n" * 200)
    assert oversized([tmp_path / "short.py", tmp_path / "long.py"], root=tmp_path) == [
        "short.py: class A 151 lines", "long.py: 301 lines"]


def test_the_copyable_package_is_smaller_than_when_the_issue_was_filed():
    total = sum(len(p.read_text().splitlines()) for p in _files("labutils"))
    assert total < MAX_PACKAGE_LINES, f"labutils has {total} lines, over the {MAX_PACKAGE_LINES} of issue 25"


# -- each coursework copy, alone ---------------------------------------------------------------------------

SMOKE = {
    "helper": """
        import torch, torch.distributed as dist
        import labutils
        from labutils import collectives

        def gathered(n):
            rows, sizes = collectives.all_gather_variable_dim(torch.full((n + dist.get_rank(),), 1.0 + dist.get_rank()))
            return rows.tolist(), list(sizes)

        assert labutils.launch(gathered, 2, 1, timeout=120) == [([1.0, 2.0, 2.0], [1, 2])] * 2
        assert labutils.count_params(torch.nn.Linear(4, 3)).total == 15
        fig = labutils.plot_losses({"a": [2.0, 1.0]})
        print("helper ok")
    """,
    "core": """
        import torch
        from labutils import data, models, train
        from labutils.moe import FMoETransformerMLP
        from labutils.moe.reference import reference_moe
        torch.manual_seed(0)
        layer = FMoETransformerMLP(num_expert=4, d_model=16, d_hidden=32, top_k=2)
        x = torch.randn(6, 16)                                             # (T, d)
        torch.manual_seed(1); y = layer(x)
        torch.manual_seed(1); torch.testing.assert_close(y, reference_moe(layer, x), rtol=1e-5, atol=1e-5)
        model = models.SeqRegressor(16, 2, lambda: models.make_ffn("fmoe", 16, 24, num_expert=4, top_k=2), n_layers=1)
        result = train.train(model, data.RandomPairs(4, 6, 16, seed=7), steps=3, progress=False, lr=1e-2)
        assert len(result.losses) == 3
        try:
            models.make_ffn("deepspeed", 16, 32, num_expert=4)
        except ImportError as exc:
            print("no ds wing:", exc)
        print("core ok")
    """,
    "deepspeed": """
        import torch
        from labutils.ds import gating
        from labutils.moe.capacity import deepspeed_capacity
        from deepspeed.moe.sharded_moe import _capacity
        for tokens, e, cf in ((25, 2, 1.2), (100, 4, 1.0), (7, 3, 0.5)):
            gates = torch.zeros(tokens, e)
            ours = deepspeed_capacity(tokens, e, cf, min_capacity=0)
            want = int(_capacity(gates, torch.tensor(cf), torch.tensor(0)))
            assert ours == want, (tokens, e, cf, ours, want)
        print("deepspeed ok")
    """,
}


@pytest.mark.dist
@pytest.mark.parametrize("copy", list(coursework_copies.COPIES))
def test_each_coursework_copy_runs_alone(tmp_path, copy):
    pkg = coursework_copies.make_copy(copy, tmp_path)
    held = coursework_copies.files(copy)
    assert (copy == "helper") == ("moe/__init__.py" not in held) and (copy == "deepspeed") == ("ds/gating.py" in held)
    modules = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in held if f != "__init__.py"]
    script = "import importlib\n" + "".join(f"importlib.import_module('labutils.{m}')\n" for m in modules)
    script += textwrap.dedent(SMOKE[copy])
    (tmp_path / "student.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LAB_", "JUPYTER"))}
    env.update(MPLBACKEND="agg", PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1")
    # the editable install of this repository must not supply what the copy lacks
    wrapper = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]\n"
               f"sys.path.insert(0, {str(tmp_path)!r})\n"
               "import runpy\nrunpy.run_path('student.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and f"{copy} ok" in out, out
    import labutils

    assert pkg.resolve() != pathlib.Path(labutils.__file__).resolve().parent
