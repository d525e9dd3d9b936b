"""labbook.toys (one module per chapter section): one copy of chapters 02 and 07's small models and workers (no
worker started here)."""
from __future__ import annotations

import ast
import importlib
import json
import pathlib
import pickle
import pkgutil
import subprocess
import sys

import cloudpickle
import torch

from labbook import toys
from labbook.toys import ch02_deepspeed, ch07_costs, ch07_ddp, ch07_ep_groups, ch07_fsdp, ch07_moe

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKERS = (ch07_ddp.ddp_run, ch07_ddp.ddp_controls, ch07_ddp.replicate_checks, ch07_fsdp.fsdp_vs_ddp,
           ch07_moe.moe_checks, ch07_ep_groups.moe_ep_groups, ch07_ep_groups.lab_fmoe_check, ch07_costs.dp_costs,
           ch02_deepspeed.ep_parity, ch02_deepspeed.capacity_pitfall)


def test_workers_ship_by_reference():
    """launch pickles with cloudpickle: a module function travels as its name, so workers run this code."""
    for fn in WORKERS:
        blob = cloudpickle.dumps(fn)
        assert len(blob) < 200, f"{fn.__name__} pickled by value ({len(blob)} bytes)"
        assert pickle.loads(blob) is fn


def test_importing_toys_does_not_import_deepspeed():
    code = "import sys, labbook.toys; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_chapters_import_toys_instead_of_defining_them():
    """Chapters 02 and 07 show toys' code with show_source; none of their cells defines a toys name again."""
    modules = [importlib.import_module(f"{toys.__name__}.{m.name}") for m in pkgutil.iter_modules(toys.__path__)]
    names = {n for mod in modules for n, v in vars(mod).items() if getattr(v, "__module__", "") == mod.__name__}
    assert {"Net", "TinyMoE", "expert", "dp_costs"} <= names, sorted(names)  # classes and functions of every module
    for chapter in ("02_deepspeed_moe", "07_data_parallel"):
        nb = json.loads((ROOT / "notebooks" / f"{chapter}.ipynb").read_text())
        defined = set()
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                tree = ast.parse("".join(cell["source"]))
                defined |= {node.name for node in tree.body
                            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names}
        assert not defined, f"{chapter} defines {sorted(defined)} again: import them from labbook.toys.chNN_*"


def test_tiny_moe_single_process_picks_one_expert_per_token():
    torch.manual_seed(0)
    model = ch07_moe.TinyMoE(d=8, h=16, num_experts=3)
    x = torch.randn(5, 8)  # (T, d)
    h = model.inp(x)
    score, idx = torch.softmax(model.gate(h), dim=-1).max(dim=-1)
    want = model.out(h + score[:, None] * torch.stack([model.experts[int(e)](h[t]) for t, e in enumerate(idx)]))
    torch.testing.assert_close(model(x), want)
