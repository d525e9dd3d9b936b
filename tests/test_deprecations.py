"""One shim mechanism: every deprecated name and path of labutils sits in ``labutils._deprecate.DEPRECATED`` with
its removal version, every shim reads it, and the lab's own deprecation warnings are errors in the tests."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import warnings

import pytest

import labutils
from labutils._deprecate import (
    DEPRECATED,
    LabDeprecationWarning,
    _target,
    _version,
    deprecated,
    forward_moved,
    lookup,
)

PKG = pathlib.Path(labutils.__file__).parent


def _resolve(path: str):
    """``labutils.<path>`` (``labbook.<path>`` for the book's package): the longest importable module prefix, then
    attributes."""
    parts = _target(path).split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_every_entry_has_versions_and_a_new_home():
    for old, shim in DEPRECATED.items():
        assert shim.kind in ("module", "name", "call", "moved"), old
        assert _version(shim.removed_in, "removed_in") > _version(shim.since, "since"), old
        for new in shim.new:
            assert _resolve(new) is not None, f"{old}: its new home {new} does not exist"


@pytest.mark.parametrize("old", sorted(k for k, s in DEPRECATED.items() if s.kind == "module"))
def test_moved_module_forwards_with_the_labs_warning(old):
    shim = DEPRECATED[old]
    new = importlib.import_module(_target(shim.new[0]))
    rel = new.__name__.removeprefix("labutils.")
    names = [n for n in sorted(vars(new)) if not n.startswith("_") and not isinstance(vars(new)[n], type(pathlib))
             and f"{rel}.{n}" not in DEPRECATED]  # a name it only imports has its own row (moved)
    if not names:  # a moved package with no names of its own (perf): each of its modules has a row, tested alone
        assert any(path.startswith(f"{old}.") for path in DEPRECATED), f"{old}: {new.__name__} has nothing to forward"
        return
    name = names[0]
    with pytest.warns(LabDeprecationWarning, match=rf"labutils\.{old} moved to .*{shim.removed_in}"):
        value = getattr(importlib.import_module(f"labutils.{old}"), name)
    assert value is getattr(new, name)


def test_a_moved_package_keeps_its_path_and_each_module_path():
    """``labutils.perf`` moved to ``labbook.perf`` in 0.3.0 (issue 39): no file is left at the old path, every module
    it had then has a row, and the old package path and each old module path still import; a name used
    through them is the new module's, with the lab's warning naming the new path."""
    import labbook.perf.dispatch as dispatch
    import labbook.perf.problem as problem
    import labbook.perf.sweep as sweep
    import labbook.perf.timing as timing

    assert not (PKG / "perf").exists()
    moved = {old.removeprefix("perf.") for old, shim in DEPRECATED.items()
             if old.startswith("perf.") and shim.kind == "module"}
    # the modules labutils.perf had when it moved (a module added to labbook.perf later never had an old path)
    assert moved == {"timing", "problem", "dispatch", "real_layers", "sweep", "breakdown", "layer_bench", "verdicts"}
    assert moved <= {p.stem for p in (PKG.parent / "labbook" / "perf").glob("*.py")}
    assert all(DEPRECATED[f"perf.{m}"].new == (f"labbook.perf.{m}",) for m in moved)
    moved_to = r"labutils\.perf\.dispatch moved to labbook\.perf\.dispatch in labutils 0\.3\.0 .*1\.0\.0"
    with pytest.warns(LabDeprecationWarning, match=moved_to):
        assert importlib.import_module("labutils.perf.dispatch").loop_moe is dispatch.loop_moe
    # a name the new module only re-exported (issue 39: one address per name) goes straight to its one address
    with pytest.warns(LabDeprecationWarning, match=moved_to + r".*use labbook\.perf\.problem\.make_problem"):
        assert importlib.import_module("labutils.perf.dispatch").make_problem is problem.make_problem
    with pytest.warns(LabDeprecationWarning, match=r"use labbook\.perf\.timing\.machine_info"):
        from labutils.perf.timing import machine_info
    assert machine_info is timing.machine_info
    # the package's shim; its modules are their own shims, which warn when used
    from labutils.perf import sweep as old_sweep

    from labutils import perf

    assert perf is labutils.perf and perf.sweep is old_sweep is importlib.import_module("labutils.perf.sweep")
    with pytest.warns(LabDeprecationWarning, match=r"labutils\.perf\.sweep moved to labbook\.perf\.sweep"):
        assert perf.sweep.measure_point is sweep.measure_point
    with pytest.raises(ModuleNotFoundError, match=r"labutils\.perf\.not_a_module"):
        importlib.import_module("labutils.perf.not_a_module")
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        _ = perf.not_a_name


MOVED = sorted(k for k, s in DEPRECATED.items() if s.kind == "moved")


@pytest.mark.parametrize("old", MOVED)
def test_a_second_address_forwards_to_the_one_address(old):
    """Issue 39, one address per name: ``old_module.name`` (a re-export) is no longer declared there (not in its
    ``__all__``) and reading it warns, naming the one address and the removal version, and gives the very object."""
    shim = DEPRECATED[old]
    module_name, _, name = _target(old).rpartition(".")
    module = importlib.import_module(module_name)
    new = _resolve(shim.new[0])
    assert name not in getattr(module, "__all__", ()), f"{module_name}.__all__ still declares {name}"
    assert _resolve(shim.new[0].rpartition(".")[0]).__name__ != module_name, f"{old} forwards to itself"
    with pytest.warns(LabDeprecationWarning, match=rf"^{re.escape(_target(old))} is deprecated since labutils "
                                                   rf"{shim.since} and will be removed in {shim.removed_in}; "
                                                   rf"use {re.escape(_target(shim.new[0]))}"):
        value = getattr(module, name)
    assert value is new


def test_a_second_address_forwards_through_from_import_and_an_old_module_path():
    """``from old import name`` warns too (the hubs ``labbook.toys`` / ``labbook.lm_study`` hold no names of their
    own now), a name a module uses itself stays in its globals without a warning, and a 0.1.0 module path
    (``labutils.launch``, moved to ``launcher``) goes straight to the one address with one warning."""
    import labbook.toys.ch07_ddp as ddp
    import labutils.checkpoint as checkpoint
    import labutils.launcher.backend as backend
    import labutils.train as train

    with pytest.warns(LabDeprecationWarning, match=r"labbook\.toys\.ddp_run .*use labbook\.toys\.ch07_ddp\.ddp_run"):
        from labbook.toys import ddp_run
    assert ddp_run is ddp.ddp_run
    assert vars(train)["restore"] is checkpoint.restore  # train's own import, read directly by its functions
    with pytest.warns(LabDeprecationWarning, match=r"use labutils\.checkpoint\.restore"):
        assert train.restore is checkpoint.restore
    with pytest.warns(LabDeprecationWarning) as record:
        assert importlib.import_module("labutils.launch").default_backend is backend.default_backend
    assert len(record) == 1 and "use labutils.launcher.backend.default_backend" in str(record[0].message)
    with pytest.raises(AttributeError):
        _ = importlib.import_module("labbook.toys").not_a_toy
    with pytest.raises(ValueError, match="no name of it is a 'moved' row"):
        forward_moved("labutils.params")


def test_a_forwarding_module_pickles_by_reference():
    """A notebook function that uses a forwarding module (``collectives``, ``train``) ships to launch's workers:
    cloudpickle sends the module by name, as it sends a plain module."""
    import pickle

    import cloudpickle

    import labutils.collectives as collectives

    def cell_function():
        return collectives.all_to_all

    assert type(collectives).__name__ == "_Forwarding"
    assert pickle.loads(cloudpickle.dumps(cell_function))() is collectives.all_to_all
    assert pickle.loads(pickle.dumps(collectives)) is collectives


def test_every_moved_row_has_a_forwarding_module():
    """Each module with a ``"moved"`` row calls ``forward_moved`` (its class says so once imported)."""
    modules = {_target(old).rpartition(".")[0] for old in MOVED}
    assert {"labbook.toys", "labbook.lm_study", "labutils.train"} <= modules
    for name in sorted(modules):
        assert type(importlib.import_module(name)).__name__ == "_Forwarding", f"{name} does not call forward_moved"


@pytest.mark.parametrize("old", sorted(k for k, s in DEPRECATED.items() if s.kind == "name"))
def test_renamed_name_is_an_alias_made_from_the_table(old):
    alias = _resolve(old)
    shim = DEPRECATED[old]
    assert f"since labutils {shim.since} and will be removed in {shim.removed_in}" in alias.__deprecated__


def test_every_deprecated_call_in_the_package_reads_the_table():
    """Every ``deprecated(name, fn)`` names an entry of the table (versions given must agree with it: checked
    when the alias is made), and no module but ``_deprecate`` warns with ``DeprecationWarning`` itself."""
    calls, own_warnings = [], []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_deprecate.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "deprecated":
                calls.append((path.relative_to(PKG), node))
            if isinstance(node, ast.Name) and node.id in ("DeprecationWarning", "FutureWarning"):
                own_warnings.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert calls, "no shim made with deprecated(): the scan is broken"
    for where, node in calls:
        name = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        assert name is not None and lookup(name) is not None, f"{where}:{node.lineno}: {name!r} is not in DEPRECATED"
    assert not own_warnings, f"deprecation warnings outside labutils._deprecate: {own_warnings}"


def test_the_labs_deprecations_are_errors_and_others_are_ignored():
    with pytest.raises(LabDeprecationWarning):
        warnings.warn("a labutils shim used without pytest.warns", LabDeprecationWarning, stacklevel=1)
    warnings.warn("another library's deprecation", DeprecationWarning, stacklevel=1)  # ignored: no error
    with pytest.deprecated_call():
        deprecated("old_name", len, since="0.2.0", removed_in="1.0.0")([1])


def test_versions_come_from_the_table_and_must_agree():
    alias = deprecated("aux_loss", len)
    assert "since labutils 0.2.0 and will be removed in 1.0.0" in alias.__deprecated__
    with pytest.raises(ValueError, match="disagree with the table"):
        deprecated("aux_loss", len, since="0.1.0")
    with pytest.raises(ValueError, match="not in labutils._deprecate.DEPRECATED"):
        deprecated("never_listed", len)


def test_the_names_removed_too_early_in_0_3_0_forward_again():
    """perf.layer_bench.bench_clock / machine_info were deprecated in 0.2.0 (removed_in 1.0.0) and deleted in
    0.3.0, against the policy: they forward again, with the warning naming their new place."""
    import labbook.perf.timing as timing

    old = importlib.import_module("labutils.perf.layer_bench")  # the module's shim warns when a name is used
    with pytest.warns(LabDeprecationWarning, match=r"bench_clock is deprecated since labutils 0\.2\.0 .*"
                                                  r"labbook\.perf\.timing\.clock"):
        assert old.bench_clock() is timing.clock()
    with pytest.warns(LabDeprecationWarning, match="use labbook.perf.timing.machine_info"):
        assert old.machine_info()["torch"] == timing.machine_info()["torch"]
