"""labutils: the MoE Lab Book's helper package.

Copy this folder into your own project, under any name: it needs only torch (matplotlib for plots,
cloudpickle for ``launch``, each imported only when used, with a ``pip install`` hint when missing).
DeepSpeed and fastmoe are optional and imported only by the features that use them; a copy may delete
``ds/`` (DeepSpeed). Chapter 08's timing catalogue is the book's ``labbook.perf``. The layout, one idea per module:

| module | what | chapter |
|---|---|---|
| ``launcher/`` | ``launch``: a notebook cell's workers, the zygote and ranks (by file path), the backend choice | 00 |
| ``torchrun`` | the same functions under torchrun (``python -m labutils.torchrun mod:fn``) | 00 |
| ``presets``, ``compare``, ``plotting``, ``params`` | presets, parity checks, plots, parameter counts | 00 |
| ``nbtools``, ``optional`` | env report, seeding, ``show_source``, ``quiet``; optional imports, install hints | 00 |
| ``moe/`` | the MoE core; ``moe/fastmoe/`` fastmoe's face; ``moe/modern/`` chapter 09's wing | 01, 06, 09 |
| ``ds/`` | DeepSpeed: ``ds.runtime`` (start it), ``ds.gating`` (its gating) | 02 |
| ``models``, ``train``, ``checkpoint``, ``data`` | the MoE Transformer, the loop, exact resume, the data | 03-05 |
| ``collectives``, ``wire`` | differentiable all-to-all and all-gathers; bytes on the wire | 06 |
| ``data_parallel`` | MoE-aware data-parallel gradient grouping (and fastmoe's wrapper) | 07 |
| ``stats`` | the verdict over seeds | 05, 08, 09 |
| ``_deprecate`` | every deprecated name and path, one table, with its removal version | - |

Names are loaded lazily so ``import labutils`` stays fast and never imports DeepSpeed or matplotlib.
"""
from __future__ import annotations

import importlib

__version__ = "0.3.0"

# public name -> module that defines it
_EXPORTS = {
    # chapter 00: foundation
    "launch": "launcher", "WorkerError": "launcher", "worker_info": "launcher",
    "default_backend": "launcher.backend",
    "select_preset": "presets", "preset_name": "presets",
    "cmp": "compare", "check": "compare", "must_fail": "compare", "assert_close": "compare",
    "compare_tensors": "compare", "compare_models": "compare", "ParityReport": "compare",
    "plot_losses": "plotting", "plot_param_counts": "plotting", "plot_expert_load": "plotting",
    "count_params": "params", "ParamCounts": "params",
    "env_report": "nbtools", "show_source": "nbtools", "seed_everything": "nbtools",
    "collect_aux_loss": "moe",
    "GroupedDataParallel": "data_parallel", "allreduce_grouped_grads": "data_parallel",
    "mark_expert_params": "data_parallel",
    "init_deepspeed": "ds",
}

__all__ = sorted(_EXPORTS) + ["__version__"]  # noqa: PLE0605 (built from the table above)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        # a name that moved out of the package (check_exercise); submodules (`from . import x`) are not names
        alias = None if name.startswith("_") else importlib.import_module(f"{__name__}._deprecate").forward_name(name)
        if alias is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return alias
    try:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except ImportError as exc:  # matplotlib for the plots, DeepSpeed for init_deepspeed: say how to get it
        from .optional import missing_hint

        hint = missing_hint(exc, f"{__name__}.{name}")
        if hint is None:
            raise
        raise hint from exc
    globals()[name] = value
    return value


def __dir__():
    return __all__


# `labutils.launch` is the function; the 0.1.0 module of that name is `launcher` now. Old module paths
# (`labutils.launch`, `labutils.dist`, ...) keep working with a warning until 1.0.0: see _deprecate.py.
from . import _deprecate  # noqa: E402

_deprecate.register(__name__)
