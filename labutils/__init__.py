"""labutils: the MoE Lab Book's helper package.

Copy this folder into your own project, under any name: it needs only torch (matplotlib for plots,
cloudpickle for ``launch``, each imported only when used, with a ``pip install`` hint when missing).
DeepSpeed and fastmoe are optional and imported only by the features that use them; a copy may delete
``perf/`` (benchmarks) and ``ds/`` (DeepSpeed). The layout, one idea per module:

| module | what | chapter |
|---|---|---|
| ``launcher``, ``_worker``, ``torchrun`` | ``launch``: workers from a notebook cell; the torchrun entry point | 00 |
| ``presets``, ``compare``, ``plotting``, ``params`` | presets, parity checks, plots, parameter counts | 00 |
| ``exercises``, ``nbtools`` | exercise checkers; env report, seeding, ``show_source``, ``quiet`` | 00 |
| ``moe/`` | the FastMoE-compatible core; ``moe.expert_parallel`` and ``moe.traffic`` for chapter 06 | 01, 06 |
| ``ds/`` | DeepSpeed: ``ds.runtime`` (start it), ``ds.gating`` (its gating, THE capacity formula) | 02 |
| ``models``, ``train``, ``data`` | the MoE Transformer, the trainer with exact resume, the data | 03-05 |
| ``collectives`` | differentiable all-to-all and all-gathers | 06 |
| ``data_parallel`` | MoE-aware data-parallel gradient grouping | 07 |
| ``toys`` | the small models and worker functions chapters 02 and 07 show and the tests import | 02, 07 |
| ``perf/`` | timing, dispatch designs, speed tables (chapters 01 and 08, ``benchmarks/``) | 01, 08 |

Names are loaded lazily so ``import labutils`` stays fast and never imports DeepSpeed or matplotlib.
"""
from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    # chapter 00: foundation
    "launch": "launcher", "WorkerError": "launcher", "worker_info": "launcher", "default_backend": "launcher",
    "select_preset": "presets", "preset_name": "presets",
    "cmp": "compare", "check": "compare", "assert_close": "compare",
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
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
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
# (`labutils.launch`, `labutils.dist`, ...) keep working with a warning until 1.0.0: see _compat.py.
from . import _compat  # noqa: E402

_compat.register(__name__)
