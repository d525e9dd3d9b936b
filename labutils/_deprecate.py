"""Every deprecated name and module path of the package, in ONE table, and the one way each is forwarded.

:data:`DEPRECATED` maps an old dotted path (relative to the top package, so a renamed copy ``mylab/`` keeps its
shims) to the new path(s), the version that deprecated it and the version that removes it. Three kinds:

* ``"module"``: a moved module. :func:`register` puts each old path into ``sys.modules`` when the package is
  imported, as a small module whose every name forwards (:func:`moved_module`) to the new module with a
  warning; no file is left at the old path (``entry.py`` stays a file: ``python -m labutils.entry`` needs one).
  A moved package has a row for itself and one for each of its modules (``perf``, ``perf.timing``, ...).
* ``"name"``: a renamed function or class, made at its old place with :func:`deprecated`::

      aux_loss = deprecated("aux_loss", _read_and_clear_aux_loss)  # labutils/models.py; versions from the table

* ``"call"``: an old way of calling a function that still exists (its new form is the function itself).
* ``"moved"``: a name's second address (issue 39: one address per name), a re-export (``labbook.toys`` of its
  sections' workers, ``labutils.train`` of the checkpoint functions). Its module calls :func:`forward_moved`:
  ``module.name`` warns and gives the object at its one address (the module's own code reads its globals).

Every warning is a :class:`LabDeprecationWarning` (a ``DeprecationWarning``): the test suite turns the
package's own into errors (``pyproject.toml``) while other libraries' stay ignored. The policy
(CHANGELOG.md): a public name is never deleted in a minor release; it becomes a shim listed here and under
"Deprecated", and goes no earlier than its ``removed_in`` version.
"""
from __future__ import annotations

import functools
import importlib
import re
import sys
import types
import warnings
from typing import NamedTuple

_VERSION = re.compile(r"^\d+(\.\d+){1,2}$")
_TOP = __name__.rpartition(".")[0]  # this package's own name: labutils, a renamed mylab, or vendor.labutils


class LabDeprecationWarning(DeprecationWarning):
    """A deprecated name or path of this package was used (an error in its tests; see pyproject.toml)."""


class Shim(NamedTuple):
    kind: str            # "module", "name", "call" or "moved"
    new: tuple           # new dotted path(s), relative to the top package, tried in order
    since: str           # the version that deprecated it
    removed_in: str      # the version that may remove it


def _moved(*new: str) -> Shim:
    return Shim("module", new, "0.2.0", "1.0.0")


def _moved_names(old: str, new: str, names: str, kind: str = "moved") -> dict:
    """Rows deprecated in 0.3.0, one per space-separated name: ``old.name`` -> ``new.name`` (``"moved"``: a name's
    second address; ``"module"``: a moved module, ``old`` empty for one at the top of the package)."""
    return {f"{old}.{n}".lstrip("."): Shim(kind, (f"{new}.{n}",), "0.3.0", "1.0.0") for n in names.split()}


DEPRECATED = {
    # the 0.1.0 module paths (the 0.2.0 layout)
    "launch": _moved("launcher"),
    "entry": _moved("torchrun"),
    "dist": _moved("collectives"),
    "parallel": _moved("data_parallel"),
    "comm": _moved("moe.traffic"),
    "ds_gating": _moved("ds.gating"),
    "roofline": _moved("labbook.perf.timing", "labbook.perf.sweep", "labbook.perf.breakdown"),
    "dispatch": _moved("labbook.perf.dispatch"),
    "transformer": _moved("models"),
    "envreport": _moved("nbtools"),
    "moe.parallel": _moved("moe.expert_parallel"),
    "moe.bench": _moved("labbook.perf.layer_bench", "labbook.perf.verdicts"),
    # the launch wing (issue 39): launch's modules moved into the package `launcher` (launcher.py its __init__)
    **_moved_names("", "launcher", "_run _worker _watch _procs _launchdir _failures backend", "module"),
    # renamed functions
    "models.aux_loss": Shim("name", ("moe.gates.collect_aux_loss",), "0.2.0", "1.0.0"),
    # old calls: limit_by_capacity(gate_idx, tot_expert, capacity) is drop_over_capacity's result
    "moe.capacity.limit_by_capacity": Shim("call", ("moe.capacity.drop_over_capacity",), "0.3.0", "1.0.0"),
    # the book's machinery left the package for the `labbook` package (0.3.0); absolute targets, needs the repo
    "toys": Shim("module", ("labbook.toys",), "0.3.0", "1.0.0"),
    "exercises": Shim("module", ("labbook.exercises",), "0.3.0", "1.0.0"),
    "check_exercise": Shim("name", ("labbook.exercises.check_exercise",), "0.3.0", "1.0.0"),
    # chapter 08's timing catalogue too (issue 39): the package, and each module (`labutils.perf.timing` ...)
    "perf": Shim("module", ("labbook.perf",), "0.3.0", "1.0.0"),
    **_moved_names("perf", "labbook.perf", "timing problem dispatch real_layers sweep breakdown layer_bench verdicts",
                   "module"),
    # deprecated in 0.2.0 and wrongly removed in 0.3.0 (the policy: never before removed_in): restored here
    "perf.layer_bench.bench_clock": Shim("name", ("labbook.perf.timing.clock",), "0.2.0", "1.0.0"),
    "perf.layer_bench.machine_info": Shim("name", ("labbook.perf.timing.machine_info",), "0.2.0", "1.0.0"),
    # one address per name (issue 39): a name is imported from the module that defines it; its second address,
    # a re-export, forwards with a warning. The copyable package's (paths relative to it) ...
    **_moved_names("collectives", "agreement", "CollectiveMismatch require_process_group"),
    **_moved_names("train", "checkpoint", "CheckpointError CheckpointSaveError check_writable load_checkpoint "
                                          "restore save_checkpoint"),
    **_moved_names("launcher", "launcher.backend", "default_backend"),
    **_moved_names("moe.capacity_gates", "moe.capacity", "limit_by_capacity drop_over_capacity position_in_expert "
                                                          "exchange_counts"),
    **_moved_names("moe.expert_parallel", "moe.capacity", "exchange_counts"),
    **_moved_names("moe.modern.expert_choice", "moe.capacity", "expert_capacity"),
    **_moved_names("moe.traffic", "moe.capacity", "deepspeed_capacity deepspeed_dropless_capacity"),
    **_moved_names("moe.fastmoe.api", "collectives", "slice_sizes"),  # fastmoe's own names stay on its face
    **_moved_names("moe.fastmoe.api", "moe.layers", "DP_COMM"),
    **_moved_names("ds.runtime", "nbtools", "quiet"),  # `labutils.ds.quiet`, the wing's face, stays
    **_moved_names("ds.gating", "moe.capacity", "exact_capacity"),
    "ds.gating.ds_capacity": Shim("moved", ("moe.capacity.deepspeed_capacity",), "0.3.0", "1.0.0"),
    # ... and the book's (absolute): the hubs that re-exported their sections' names, the grader, the catalogue
    **_moved_names("labbook.toys", "labbook.toys.ch02_deepspeed", "capacity_pitfall distinct_experts ep_layers "
                                                                  "ep_parity expert"),
    **_moved_names("labbook.toys", "labbook.toys.ch07_costs", "COST_MODES collective_bytes cost_setup cost_step "
                                                              "dp_costs local_bytes memory_per_rank ring_minimum"),
    **_moved_names("labbook.toys", "labbook.toys.ch07_ddp", "ATOL RTOL Net batch_rows data_parallel_checks "
                   "ddp_controls ddp_run plain_params replicate_checks replicate_device_id_error replicate_device_ids "
                   "replicate_each_layer replicate_fsdp2 replicate_ignored_fc1 replicate_state_dicts "
                   "replicate_trains slices_partition step_model train_side_by_side"),
    **_moved_names("labbook.toys", "labbook.toys.ch07_ep_groups", "broadcast_checks fmoe_block lab_fmoe_check "
                                                                  "moe_ep_groups replica_gap"),
    **_moved_names("labbook.toys", "labbook.toys.ch07_fsdp", "FSDP_CASES BatchDim1 SimpleMLP cpu_offload_error "
                   "fsdp_case fsdp_vs_ddp gloo_features shard_each_linear shard_table solo_mesh train_step"),
    **_moved_names("labbook.toys", "labbook.toys.ch07_moe", "Expert TinyMoE as_rank_names ep_copy grads_of "
                   "moe_checks moe_grouped moe_naive_ddp moe_native moe_setup moe_train_parity norm_rel"),
    **_moved_names("labbook.lm_study", "labbook.lm_study.config", "ABLATIONS LOAD_WINDOWS MAIN PRESETS StudyConfig "
                   "Variant build data_limited epochs measured_train_flops optimizer train_flops_per_token variants"),
    **_moved_names("labbook.lm_study", "labbook.lm_study.data_checks", "file_coverage shared_windows window_coverage"),
    **_moved_names("labbook.lm_study", "labbook.lm_study.plots", "busiest_over_mean load_shares plot_ablations "
                                                                 "plot_layer_load plot_study"),
    **_moved_names("labbook.lm_study", "labbook.lm_study.runner", "TrainClock corpus_for heldout_loss run_one "
                                                                  "run_study training_text"),
    **_moved_names("labbook.lm_study", "labbook.lm_study.summary", "Curve ablation_comparisons ablation_lines curves "
                   "loss_at seed_bootstrap steps_to_reach summarize target_met target_verdict verdict_lines"),
    **_moved_names("labbook.grader", "labbook.grader.catalog", "ENTRIES entry"),  # `grade` is the package's face
    **_moved_names("moe.modern.experts", "moe.backends", "grouped_mm_available grouped_matmul loop_matmul"),
    "moe.modern.experts.IMPLS": Shim("moved", ("moe.backends.EXPERT_BACKENDS",), "0.3.0", "1.0.0"),
    **_moved_names("labbook.perf.dispatch", "labbook.perf.problem", "Problem DispatchOut make_problem route "
                                                                    "expert_mlp fwd_bwd"),
    **_moved_names("labbook.perf.dispatch", "labbook.perf.real_layers", "core CoreMoE DeepSpeedMoE fastmoe "
                                                                        "per_expert_tensors"),
}
BOOK = "labbook"  # a target in this package is absolute: the book's own package, never part of a copy


def _version(text: str, what: str) -> tuple:
    if not isinstance(text, str) or not _VERSION.match(text):
        raise ValueError(f"{what} must be a version like '0.2.0', got {text!r}")
    return tuple(int(part) for part in text.split("."))


def lookup(name: str) -> Shim | None:
    """The table's entry for ``name``: a dotted path of :data:`DEPRECATED`, or the last part of exactly one."""
    if name in DEPRECATED:
        return DEPRECATED[name]
    found = [shim for path, shim in DEPRECATED.items()
             if shim.kind in ("name", "call") and path.rsplit(".", 1)[-1] == name]
    return found[0] if len(found) == 1 else None


def deprecated(alias_name: str, new_callable, since: str | None = None, removed_in: str | None = None):
    """Return ``alias_name``: calls ``new_callable`` and emits a :class:`LabDeprecationWarning` naming it.

    ``since`` / ``removed_in`` default to :data:`DEPRECATED`'s entry for ``alias_name`` (given, they must agree
    with it); a name outside the table needs ``since``. The warning points at the caller's line. Works for
    functions and classes (calling a deprecated class alias builds an instance of the new class).
    """
    if not callable(new_callable):
        raise TypeError(f"new_callable must be callable, got {new_callable!r}")
    if not alias_name.isidentifier():
        raise ValueError(f"alias_name must be an identifier, got {alias_name!r}")
    entry = lookup(alias_name)
    if entry is not None:
        if (since or entry.since, removed_in or entry.removed_in) != (entry.since, entry.removed_in):
            raise ValueError(f"{alias_name}: since={since}, removed_in={removed_in} disagree with the table in "
                             f"{__name__} ({entry.since}, {entry.removed_in})")
        since, removed_in = entry.since, entry.removed_in
    if since is None:
        raise ValueError(f"{alias_name} is not in {__name__}.DEPRECATED: add it there (or give since=)")
    if removed_in is not None and _version(removed_in, "removed_in") <= _version(since, "since"):
        raise ValueError(f"removed_in={removed_in} must be later than since={since}")
    _version(since, "since")
    new_name = f"{new_callable.__module__}.{new_callable.__qualname__}"
    message = (f"{alias_name} is deprecated since labutils {since}"
               + (f" and will be removed in {removed_in}" if removed_in else "")
               + f"; use {new_name} instead")

    @functools.wraps(new_callable, updated=())  # not a class's __dict__
    def alias(*args, **kwargs):
        warnings.warn(message, LabDeprecationWarning, stacklevel=2)
        return new_callable(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = alias_name
    alias.__doc__ = f"Deprecated: {message}.\n\n{new_callable.__doc__ or ''}".rstrip()
    # PEP 702's marker, read by type checkers and IDEs
    alias.__deprecated__ = message  # pyright: ignore[reportAttributeAccessIssue]
    return alias


def moved_module(old: str, *new: str):
    """The ``__getattr__`` of a moved module ``old`` (a full dotted name): ``old.name`` forwards to ``new.name``
    with a warning. ``new`` (relative to the top package, tried in order: a module split in two) defaults to
    the table's entry; the versions always come from it. :func:`register` makes one for every moved path of
    the table; ``labutils/entry.py`` is the one shim file (``__getattr__ = moved_module(__name__)``). A moved
    package's moved module (``old.timing``, a row of its own) is that module's shim, which warns when used."""
    rel = old.removeprefix(f"{_TOP}.")
    entry = DEPRECATED[rel]
    targets = [_target(n) for n in (new or entry.new)]

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        inner = DEPRECATED.get(f"{rel}.{name}")
        if inner is not None and inner.kind == "module" and f"{old}.{name}" in sys.modules:
            return sys.modules[f"{old}.{name}"]  # the moved module's own shim (register made it)
        if inner is not None and inner.kind == "name":  # a name the moved module no longer has under that name
            module_name, _, attr = _target(inner.new[0]).rpartition(".")
            return deprecated(name, getattr(importlib.import_module(module_name), attr))
        for target in targets:
            module = importlib.import_module(target)
            moved = DEPRECATED.get(f"{_relative(target)}.{name}")
            if moved is not None and moved.kind == "moved":  # a second address there too: straight to the one
                warnings.warn(f"{old} moved to {target} in labutils {entry.since} (the old path goes in "
                              f"{entry.removed_in}): use {_target(moved.new[0])}", LabDeprecationWarning,
                              stacklevel=2)
                return _resolve(moved.new[0])
            if hasattr(module, name):
                warnings.warn(f"{old} moved to {target} in labutils {entry.since} (the old path goes in "
                              f"{entry.removed_in}): use {target}.{name}", LabDeprecationWarning, stacklevel=2)
                return getattr(module, name)
        raise AttributeError(f"module {old!r} (moved to {' and '.join(targets)}) has no attribute {name!r}")

    return __getattr__


def _target(path: str) -> str:
    """A table path as an importable name: relative to this package, or absolute in the book's package."""
    return path if path.split(".")[0] == BOOK else f"{_TOP}.{path}"


def _relative(module: str) -> str:
    """A module's name as the table writes it: relative to this package, or absolute in the book's package."""
    return module.removeprefix(f"{_TOP}.")


def _resolve(path: str):
    """The object at a table path ``module.name``."""
    module, _, attr = _target(path).rpartition(".")
    return getattr(importlib.import_module(module), attr)


class _Forwarding(types.ModuleType):
    """The class of a module some of whose names moved (``"moved"`` rows, :func:`forward_moved`): ``module.name``
    and ``from module import name`` warn and give the object at its one address. Only reads from outside come
    here: the module's own functions read their globals directly."""

    def __getattribute__(self, name: str):
        if name[:1] != "_":
            old = f"{_relative(types.ModuleType.__getattribute__(self, '__name__'))}.{name}"
            shim = DEPRECATED.get(old)
            if shim is not None and shim.kind == "moved":
                warnings.warn(f"{_target(old)} is deprecated since labutils {shim.since} and will be removed in "
                              f"{shim.removed_in}; use {_target(shim.new[0])} (one address per name)",
                              LabDeprecationWarning, stacklevel=2)
                return _resolve(shim.new[0])
        return super().__getattribute__(name)

    def __reduce__(self):  # by reference, as cloudpickle ships a plain module (a launch worker's globals)
        return importlib.import_module, (self.__name__,)


def forward_moved(module: str) -> None:
    """Make module ``module`` (its ``__name__``; it calls this once) forward the names the table says moved away
    from it (``"moved"`` rows under its path), with a :class:`LabDeprecationWarning` each time one is read."""
    rel = _relative(module)
    if not any(path.rpartition(".")[0] == rel and shim.kind == "moved" for path, shim in DEPRECATED.items()):
        raise ValueError(f"{module}: no name of it is a 'moved' row of {__name__}.DEPRECATED")
    sys.modules[module].__class__ = _Forwarding


def forward_name(name: str):
    """The top package's deprecated name ``name`` (a ``"name"`` entry whose target is elsewhere), made with
    :func:`deprecated` from its target; a moved module's shim (``import labutils.perf.timing`` binds
    ``labutils``, whose ``perf`` is then the shim); None when ``name`` is neither."""
    shim = DEPRECATED.get(name)
    if shim is not None and shim.kind == "module":
        return sys.modules.get(f"{_TOP}.{name}")
    if shim is None or shim.kind != "name":
        return None
    module, _, attr = _target(shim.new[0]).rpartition(".")
    return deprecated(name, getattr(importlib.import_module(module), attr))


def register(top: str) -> None:
    """Put every moved module path of package ``top`` into ``sys.modules`` (idempotent; ``entry`` is a file)."""
    for old, shim in DEPRECATED.items():
        name = f"{top}.{old}"
        if shim.kind != "module" or old == "entry" or name in sys.modules:
            continue
        module = types.ModuleType(name, f"Deprecated since {shim.since}: moved to {' and '.join(shim.new)} "
                                        f"(goes in {shim.removed_in}).")
        module.__getattr__ = moved_module(name)  # pyright: ignore[reportAttributeAccessIssue]
        if any(path.startswith(f"{old}.") for path in DEPRECATED):  # a moved package: its modules are shims too
            module.__path__ = []
        sys.modules[name] = module
