"""``labutils`` copied alone into someone else's project (issue 9: coursework-ready).

* Static: no module of the package imports ``notebooks``/``tests``/``tools``/``benchmarks``; at module level
  (class bodies included, function bodies not) it imports only torch, matplotlib, cloudpickle, numpy, the
  standard library and itself; DeepSpeed and fastmoe are imported inside functions only.
* In a subprocess: ``labutils/`` alone is copied into a temporary project, the working directory is that
  project, the repository is not on ``sys.path``, the editable install of the lab is switched off, and
  ``deepspeed`` and ``fmoe`` are hidden as if not installed (a ``sitecustomize`` on ``PYTHONPATH`` wraps
  every import finder, so ``import deepspeed`` raises ``ModuleNotFoundError``; launch workers inherit it).
  There the copy imports with every submodule, launches 2 workers, runs a tiny FMoE forward against the
  brute-force reference, counts parameters on the meta device and saves a plot; every DeepSpeed / fastmoe
  feature raises an ImportError that says how to get the package.
* Versions: ``labutils.__version__`` is the newest release in CHANGELOG.md, every ``labutils.*`` name the
  CHANGELOG lists (outside "Removed") still resolves, and ``labutils._deprecate.deprecated`` makes warning
  aliases for renamed functions.
"""
from __future__ import annotations

import ast
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "labutils"
MODULE_LEVEL_OK = {"torch", "matplotlib", "cloudpickle", "numpy", "labutils"} | set(sys.stdlib_module_names)
OPTIONAL = {"deepspeed", "fmoe"}
NEVER = {"notebooks", "tests", "tools", "benchmarks", "conftest", "launch_helpers", "labbook"}


# -- static: what the package imports -------------------------------------------------------------------

def _imports(tree: ast.AST, in_function: bool = False):
    """Yield ``(node, top-level module or None for relative, level, in_function)`` for every import."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name.split(".")[0], 0, in_function
        elif isinstance(node, ast.ImportFrom):
            yield node, (node.module or "").split(".")[0] or None, node.level, in_function
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _imports(node, inner)


def _package_files():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 10, files
    return files


def test_imports_only_allowed_modules():
    problems = []
    for path in _package_files():
        rel = path.relative_to(ROOT)
        depth = len(path.relative_to(PKG).parts) - 1  # 0 for labutils/x.py, 1 for labutils/moe/x.py
        for node, top, level, in_function in _imports(ast.parse(path.read_text(), str(path))):
            where = f"{rel}:{node.lineno}"
            if level:
                if level > depth + 1:
                    problems.append(f"{where}: relative import leaves the package")
                continue
            if top in NEVER:
                problems.append(f"{where}: imports {top!r} (labutils must work without the repository)")
            elif top in OPTIONAL and not in_function:
                problems.append(f"{where}: imports optional {top!r} at module level (import it inside a function)")
            elif top not in MODULE_LEVEL_OK | OPTIONAL:
                problems.append(f"{where}: imports {top!r}, not a declared dependency (torch, matplotlib, "
                                f"cloudpickle; numpy; deepspeed/fmoe optional)")
    assert not problems, "\n".join(problems)


def test_static_check_catches_violations():
    """The walker above sees module-level imports inside class bodies and try blocks, not inside functions."""
    src = textwrap.dedent("""
        import os
        try:
            import deepspeed
        except ImportError:
            pass
        class A:
            from notebooks import x
        def f():
            import fmoe
            from . import sibling
    """)
    found = [(top, level, fn) for _, top, level, fn in _imports(ast.parse(src))]
    assert found == [("os", 0, False), ("deepspeed", 0, False), ("notebooks", 0, False),
                     ("fmoe", 0, True), (None, 1, True)], found


# -- dynamic: the copy, with the optional packages hidden --------------------------------------------------

SITECUSTOMIZE = '''
"""Make deepspeed and fmoe look uninstalled and switch off the lab's editable install of labutils."""
import sys

HIDDEN = {"deepspeed", "fmoe", "notebooks", "tests"}


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path if "labutils" not in getattr(f, "__module__", "")]
'''

SMOKE = '''
import importlib, os, pathlib, pkgutil, sys

PROJECT = pathlib.Path(__file__).resolve().parent
REPO = pathlib.Path(sys.argv[1]).resolve()
assert all(pathlib.Path(p or ".").resolve() != REPO for p in sys.path), sys.path
for name in ("deepspeed", "fmoe"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(f"{name} is not hidden")

import labutils

assert pathlib.Path(labutils.__file__).resolve() == PROJECT / "labutils" / "__init__.py", labutils.__file__
assert labutils.__version__ == sys.argv[2], (labutils.__version__, sys.argv[2])
modules = [m.name for m in pkgutil.walk_packages(labutils.__path__, "labutils.")]
for name in modules:
    mod = importlib.import_module(name)
    assert pathlib.Path(mod.__file__).resolve().is_relative_to(PROJECT), (name, mod.__file__)
for name in labutils.__all__:
    getattr(labutils, name)
assert not {"deepspeed", "fmoe"} & set(sys.modules), "importing labutils imported an optional package"
print(f"imported {len(modules)} submodules from the copy")

import torch
import torch.distributed as dist


def ranks():
    return dist.get_rank(), dist.get_world_size()


assert labutils.launch(ranks, 2, timeout=120) == [(0, 2), (1, 2)]
print("launch: 2 workers ok")

from labutils.moe import FMoETransformerMLP
from labutils.moe.reference import reference_moe

torch.manual_seed(0)
layer = FMoETransformerMLP(num_expert=4, d_model=16, d_hidden=32, top_k=2)
x = torch.randn(6, 16)                                   # (T, d)
torch.manual_seed(1)
y = layer(x)
torch.manual_seed(1)
labutils.assert_close("FMoE vs reference", y, reference_moe(layer, x), rtol=1e-5, atol=1e-5)
print("FMoE forward matches the reference")

with torch.device("meta"):
    big = FMoETransformerMLP(num_expert=8, d_model=64, d_hidden=128, top_k=2)
counts = labutils.count_params(big)
assert counts["moe experts"] == 8 * (64 * 128 + 128 + 128 * 64 + 64), counts
print("count_params ok:", counts.total)

fig = labutils.plot_losses({"a": [3.0, 2.0, 1.5], "b": [3.0, 2.5, 2.0]})
fig.savefig(PROJECT / "loss.png")
assert (PROJECT / "loss.png").stat().st_size > 1000
print("plot saved")

from labutils import ds, optional
from labutils import models as transformer

assert not optional.available("deepspeed") and not optional.available("fmoe")
DS = ("deepspeed", "pip install deepspeed")
FM = ("fmoe", "github.com/laekov/fastmoe")
features = {
    "optional.require('deepspeed')": (lambda: optional.require("deepspeed"), DS),
    "ds.import_deepspeed()": (ds.import_deepspeed, DS),
    "ds.init_deepspeed()": (ds.init_deepspeed, DS),
    "ds.build_ops()": (lambda: ds.build_ops(verbose=False), DS),
    "transformer.make_ffn('deepspeed')": (lambda: transformer.make_ffn("deepspeed", 16, 32, num_expert=4), DS),
    "optional.require('fmoe')": (lambda: optional.require("fmoe"), FM),
    "transformer.make_ffn('fastmoe')": (lambda: transformer.make_ffn("fastmoe", 16, 32, num_expert=4), FM),
}
for what, (call, needles) in features.items():
    try:
        call()
    except ImportError as exc:
        missing = [n for n in needles if n not in str(exc)]
        assert not missing, f"{what}: the ImportError does not say {missing}: {exc}"
    else:
        raise AssertionError(f"{what} ran without {needles[0]}")
print(f"{len(features)} optional features give a clear ImportError")
print("COURSEWORK OK")
'''


def test_copy_works_alone_without_optional_packages(tmp_path):
    project, hide = tmp_path / "coursework", tmp_path / "hide"
    shutil.copytree(PKG, project / "labutils", ignore=shutil.ignore_patterns("__pycache__"))
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (project / "smoke.py").write_text(SMOKE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LAB_", "JUPYTER"))}
    env.update(PYTHONPATH=str(hide), MPLBACKEND="agg", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "smoke.py", str(ROOT), _newest_release()], cwd=project, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "COURSEWORK OK" in proc.stdout, proc.stdout + proc.stderr


# -- versions: deprecate, do not delete ---------------------------------------------------------------------

def _newest_release() -> str:
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert released, "CHANGELOG.md lists no release"
    return released[0]


def test_version_matches_the_changelog():
    import labutils

    assert _newest_release() == labutils.__version__, (_newest_release(), labutils.__version__)


def _changelog_names() -> set:
    """Every ``labutils.x.y`` the CHANGELOG lists, except under "Removed" headings, and except a name that a
    "Removed" bullet of any release starts with (deprecated in one release, removed in a later one)."""
    names, gone, removed = set(), set(), False
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if line.startswith("### "):
            removed = line.strip() == "### Removed"
        elif line.startswith("## "):
            removed = False
        elif removed:
            gone.update(re.findall(r"^- `(labutils(?:\.\w+)+)`", line))
        else:
            names |= set(re.findall(r"`(labutils(?:\.\w+)+)", line))
    return names - gone


def test_every_public_name_in_the_changelog_still_resolves(recwarn):
    """Names released in a version keep working in later ones (as deprecated aliases if renamed: their warnings
    are recorded here, not raised)."""
    names = _changelog_names()
    assert len(names) > 30, names
    missing = []
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"public names listed in CHANGELOG.md no longer exist: {missing}"


def _new(x, scale=2):
    """Double ``x`` (the new name)."""
    return x * scale


class _NewThing:
    def __init__(self, value):
        self.value = value


def test_deprecated_alias_warns_and_forwards():
    from labutils._deprecate import deprecated

    old = deprecated("old_double", _new, since="0.2.0", removed_in="1.0.0")
    with pytest.warns(DeprecationWarning) as record:
        assert old(3, scale=5) == 15
    msg = str(record[0].message)
    assert msg == ("old_double is deprecated since labutils 0.2.0 and will be removed in 1.0.0; "
                   f"use {__name__}._new instead")
    assert record[0].filename == __file__  # points at the caller, not at _deprecate.py
    assert old.__name__ == "old_double" and old.__wrapped__ is _new and "Double" in old.__doc__
    assert old.__deprecated__ == msg

    Thing = deprecated("Thing", _NewThing, since="0.2.0")
    with pytest.warns(DeprecationWarning, match=r"^Thing is deprecated since labutils 0\.2\.0; use .*_NewThing"):
        assert isinstance(Thing(4), _NewThing) and Thing.__name__ == "Thing"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises(DeprecationWarning):
            old(1)


def test_deprecated_rejects_bad_arguments():
    from labutils._deprecate import deprecated

    with pytest.raises(ValueError, match="must be later"):
        deprecated("a", _new, since="0.3.0", removed_in="0.2.0")
    with pytest.raises(ValueError, match="version like"):
        deprecated("a", _new, since="soon")
    with pytest.raises(ValueError, match="identifier"):
        deprecated("not a name", _new, since="0.2.0")
    with pytest.raises(TypeError, match="callable"):
        deprecated("a", 42, since="0.2.0")


# -- the 0.2.0 layout: old import paths still work, with a warning ------------------------------------------

MOVED = {  # old module -> (new module, a public name to follow through the shim)
    "labutils.launch": ("labutils.launcher", "worker_info"),
    "labutils.entry": ("labutils.torchrun", "init_from_env"),
    "labutils.dist": ("labutils.collectives", "all_to_all"),
    "labutils.parallel": ("labutils.data_parallel", "GroupedDataParallel"),
    "labutils.moe.parallel": ("labutils.moe.expert_parallel", "exchange_and_run"),
    "labutils.comm": ("labutils.moe.traffic", "token_matrix"),
    "labutils.ds_gating": ("labutils.ds.gating", "top1_routing"),
    "labutils.roofline": ("labbook.perf.timing", "matmul_gflops"),
    "labutils.dispatch": ("labbook.perf.dispatch", "loop_moe"),
    "labutils.moe.bench": ("labbook.perf.layer_bench", "bench_shape"),
    "labutils.perf.timing": ("labbook.perf.timing", "machine_info"),   # the 0.3.0 move to labbook (issue 39)
    "labutils.perf.dispatch": ("labbook.perf.dispatch", "loop_moe"),
    "labutils.transformer": ("labutils.models", "CharLM"),
    "labutils.envreport": ("labutils.nbtools", "env_report"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_import_paths_forward_with_a_warning(old):
    new, name = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(new)}.*1\.0\.0"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = importlib.import_module(old).not_a_name


def test_roofline_split_in_two_still_forwards_both_halves():
    import labbook.perf.breakdown as breakdown
    import labbook.perf.sweep as sweep

    with pytest.warns(DeprecationWarning, match="labbook.perf.sweep"):
        from labutils.roofline import measure_point
    with pytest.warns(DeprecationWarning, match="labbook.perf.breakdown"):
        from labutils.roofline import core_breakdown
    assert measure_point is sweep.measure_point and core_breakdown is breakdown.core_breakdown


def test_launch_is_the_function_and_old_entry_module_still_runs():
    import labutils

    assert callable(labutils.launch) and labutils.launch.__module__ == "labutils.launcher"
    import labutils.launch as same  # the 0.1.0 module path must not shadow the function

    assert same is labutils.launch or callable(same)
    out = subprocess.run([sys.executable, "-m", "labutils.entry", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "module:function" in out.stdout, out.stderr


def test_developing_layout_table_lists_every_module():
    """DEVELOPING.md's layout table names every module on disk, and nothing that is not there (a package's
    ``__init__.py`` may be listed, when it holds code: the launch wing's; ``chNN`` stands for every chapter's file)."""
    text = (ROOT / "DEVELOPING.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"`((?:labutils|labbook)/[\w/]+\.py)`", table)) - {"labutils/__init__.py"}
    every = {str(p.relative_to(ROOT)) for p in _package_files() + sorted((ROOT / "labbook").rglob("*.py"))
             if "__pycache__" not in p.parts}
    on_disk = {p for p in every if not p.endswith("/__init__.py")}
    patterns = {r: re.compile(re.escape(r).replace("NN", r"\d\d") + "$") for r in rows if "NN" in r}
    listed = {p for p in every if p in rows or any(pat.match(p) for pat in patterns.values())}
    assert on_disk - listed == set(), f"modules missing from DEVELOPING.md's layout table: {on_disk - listed}"
    missing = {r for r in rows if r not in every and not (r in patterns and any(map(patterns[r].match, every)))}
    assert missing == set(), f"DEVELOPING.md lists modules that do not exist: {missing}"
