"""labutils: the MoE Lab Book's helper package.

Copy this folder into your own project: it needs only torch, matplotlib and cloudpickle.
DeepSpeed and fastmoe are optional and imported only by the features that use them.

Names are loaded lazily so ``import labutils`` stays fast and never imports DeepSpeed.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # chapter 00: foundation
    "select_preset": "presets", "preset_name": "presets",
    "cmp": "compare", "check": "compare", "assert_close": "compare",
    "compare_tensors": "compare", "compare_models": "compare", "ParityReport": "compare",
    "plot_losses": "plotting", "plot_param_counts": "plotting", "plot_expert_load": "plotting",
    "count_params": "params", "ParamCounts": "params",
    "env_report": "envreport", "show_source": "envreport",
    "check_exercise": "exercises",
    "collect_aux_loss": "moe",
    "seed_everything": "envreport",
    "GroupedDataParallel": "parallel", "allreduce_grouped_grads": "parallel", "mark_expert_params": "parallel",
    "init_deepspeed": "ds",
}

# The launcher is imported eagerly: its module is also called `launch`, and importing the submodule
# would otherwise shadow the function on the package.
from .launch import WorkerError, launch, worker_info  # noqa: E402

__all__ = sorted(_EXPORTS) + ["__version__", "WorkerError", "launch", "worker_info"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'labutils' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
