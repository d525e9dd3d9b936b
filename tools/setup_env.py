"""Create .venv and install the pinned environment; idempotent (a stamp records what was installed).

    python3 tools/setup_env.py            # what `make book`, `make test` and `make lab` run first

Steps: pick Python >= 3.10 (3.11 preferred: the committed outputs were recorded with it), create .venv,
install torch==2.13.0 alone (refusing a CUDA build on a machine without a GPU: on such a machine where
PyPI would serve the CUDA wheel, set TORCH_INDEX_URL to the CPU wheel index), install the pins (plus the
transitive lock on 3.11), install labutils in editable mode, prebuild DeepSpeed's CPU communication op
into .cache/torch_extensions so chapters and workers never JIT-compile it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
STAMP = VENV / ".labbook-installed"
INPUTS = ["requirements.txt", "constraints-py311.txt", "pyproject.toml", "tools/setup_env.py"]


def run(*cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def pick_python() -> str:
    for name in ("python3.11", sys.executable, "python3"):
        exe = shutil.which(name) or (name if os.path.exists(name) else None)
        if not exe:
            continue
        out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2] >= (3, 10))"],
                             capture_output=True, text=True)
        if out.stdout.strip() == "True":
            return exe
    sys.exit("Python >= 3.10 is required (3.11 recommended)")


def fingerprint() -> str:
    h = hashlib.sha256()
    for name in INPUTS:
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


def install_torch() -> None:
    pip = [PY, "-m", "pip", "install", "-q"]
    index = os.environ.get("TORCH_INDEX_URL")
    if index:
        pip += ["--index-url", index]
    report = subprocess.run([*pip, "--dry-run", "--report", "-", "torch==2.13.0"], capture_output=True, text=True)
    if report.returncode == 0 and report.stdout.strip():
        names = [item["metadata"]["name"] for item in json.loads(report.stdout).get("install", [])]
        cuda = [n for n in names if n.startswith(("nvidia-", "triton"))]
        if cuda and not has_gpu():
            sys.exit(f"refusing to install a CUDA build of torch on a machine without a GPU (it would pull {cuda[:3]}"
                     f"...). Set TORCH_INDEX_URL to PyTorch's CPU wheel index and run again.")
    run(*pip, "torch==2.13.0")


def main() -> int:
    if STAMP.exists() and STAMP.read_text() == fingerprint() and PY.exists():
        return 0
    if not PY.exists():
        run(pick_python(), "-m", "venv", VENV)
    run(PY, "-m", "pip", "install", "-q", "--upgrade", "pip")
    install_torch()
    version = subprocess.run([PY, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    lock = ["-c", ROOT / "constraints-py311.txt"] if version == "3.11" else []
    if not lock:
        print(f"note: Python {version}: installing the direct pins only; outputs were recorded with 3.11")
    run(PY, "-m", "pip", "install", "-q", "-r", ROOT / "requirements.txt", *lock)
    run(PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT)
    run(PY, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3", "--display-name",
        "Python 3 (MoE Lab Book)")  # found first through JUPYTER_PATH (set by the Makefile)
    run(PY, ROOT / "tools" / "build_ds_ops.py")
    STAMP.write_text(fingerprint())
    print("environment ready:", VENV)
    return 0


if __name__ == "__main__":
    sys.exit(main())
