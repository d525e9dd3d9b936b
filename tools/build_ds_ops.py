"""Prebuild DeepSpeed's CPU communication op once, so notebooks and workers never JIT-build it.

    python tools/build_ds_ops.py          # the Makefile runs this after creating the venv

``deepspeed.init_distributed`` compiles ``deepspeed_shm_comm`` on first use (~30 s on 2 cores). This puts it
in ``$TORCH_EXTENSIONS_DIR`` (default ``<repo>/.cache/torch_extensions``), where ``labutils.ds`` finds it.
Running it again just loads the cached op (~2 s). Exit status 0 also when DeepSpeed needs no op here.
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main() -> int:
    from labutils.ds import build_ops

    try:
        build_ops(verbose=True)
    except ImportError as exc:
        print(f"skipped: {exc}")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
