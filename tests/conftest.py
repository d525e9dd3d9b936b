"""Shared test settings."""
import os

import pytest

RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_rendezvous_env():
    """A test that starts DeepSpeed or torch.distributed in this process must not leak its rendezvous
    variables (a port it still holds) into later tests or into the nbval kernels started from this process."""
    saved = {k: os.environ.get(k) for k in RENDEZVOUS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# -- markers (registered in pyproject.toml): `make quick` runs what carries none of them ----------------------
# Whole modules of one kind are marked here; single tests carry their own decorator (e.g. @pytest.mark.gpu).
MODULE_MARKS = {
    "test_launch": "dist", "test_dist": "dist", "test_moe_parallel": "dist", "test_data_parallel": "dist",
    "test_deepspeed_helpers": "dist", "test_bad_input_launch": "dist", "test_portable_copy": "dist",
    "test_fastmoe_dist": "dist",
    "test_launch_notebook": "kernel", "test_student": "kernel",
    "test_browser": "browser",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.kernel)       # nbval: every chapter runs in a Jupyter kernel
        elif module in MODULE_MARKS:
            item.add_marker(getattr(pytest.mark, MODULE_MARKS[module]))


# -- newcomer: a skipped browser test says so at the end, with the one command that enables it ----------------
BROWSER_ENABLE = {  # words of test_browser.py's skip reason -> the command that removes it
    "no Chromium": "sudo apt-get update && sudo apt-get install -y chromium fonts-noto-color-emoji",
    "playwright missing": "pip install playwright==1.65.2",
}


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: after pytest's short summary, last before the totals
def pytest_terminal_summary(terminalreporter):
    """`make test` on a machine without Chromium skips the JupyterLab browser test; say it here, in the last
    lines a newcomer reads, with the command that enables it (`.ci/run` installs Chromium the same way)."""
    yield
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "test_browser.py" in r.nodeid]
    if not skipped:
        return
    reasons = {str(r.longrepr[2]) if isinstance(r.longrepr, tuple) else str(r.longrepr) for r in skipped}
    terminalreporter.section("browser test did not run", sep="-", yellow=True, bold=True)
    terminalreporter.write_line(f"The JupyterLab browser test was skipped ({len(skipped)} tests):")
    for reason in sorted(reasons):
        terminalreporter.write_line(f"  {reason}")
        for words, command in BROWSER_ENABLE.items():
            if words in reason:
                terminalreporter.write_line(f"  enable it with: {command}")
