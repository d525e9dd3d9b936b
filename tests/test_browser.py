"""JupyterLab in a real browser: every chapter opens, renders its outputs and runs its first cell.

One JupyterLab server (loopback, a port the OS picks, token on) and one headless Chromium (Debian's
``chromium`` driven by Playwright; no browser is ever downloaded) for the whole module. Per chapter:

* the notebook opens on the lab's kernel ("Python 3 (MoE Lab Book)") with no error dialog and no uncaught
  JavaScript error;
* its recorded outputs render: every code cell with outputs has an output area, every recorded image is an
  ``img`` that has loaded (natural width > 0);
* its first code cell is selected, cleared and run with Shift+Enter: it gets an execution count, no error
  output, and its output appears again (when the recorded cell had output);
* a screenshot goes to ``build/screenshots/NN_slug.png`` (scrolled to the first figure, if any).

The server serves a temporary copy of ``notebooks/`` with autosave off, so the committed notebooks are never
written. The last test shuts the server down and checks no kernel or server process is left.
Without Chromium every test here skips and says how to enable it. ``LAB_DOCS_SCREENSHOT=NN_slug`` copies that
chapter's screenshot to ``docs/jupyterlab.png`` (the README's picture).
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = ROOT / "build" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KERNEL_NAME = "Python 3 (MoE Lab Book)"
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif")
CELL_TIMEOUT_MS = 90_000
CELL_SEL = ".jp-Notebook .jp-Cell"  # cells sit in a windowed viewport inside .jp-Notebook

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - playwright is pinned in requirements.txt
    sync_playwright = PlaywrightTimeout = None

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM) or not os.access(CHROMIUM, os.X_OK),
                       reason="no Chromium: install Debian's package to run the JupyterLab browser test "
                              "(`sudo apt-get install chromium`; .ci/run does this in CI)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright missing: pip install playwright==1.65.2 "
                                                        "(the Python package only; it drives the system Chromium)"),
]


# -- the server ---------------------------------------------------------------------------------------------

class Lab:
    """A JupyterLab server on 127.0.0.1 serving a copy of notebooks/, and how to stop it cleanly."""

    def __init__(self, tmp: pathlib.Path):
        self.tmp, self.token = tmp, secrets.token_urlsafe(24)
        self.root = tmp / "notebooks"
        shutil.copytree(ROOT / "notebooks", self.root,
                        ignore=shutil.ignore_patterns("kernel-ipc-*", ".ipynb_checkpoints", "__pycache__"))
        self._write_settings(tmp / "settings")
        jupyter_path = [str(ROOT / ".venv" / "share" / "jupyter")] + [p for p in [os.environ.get("JUPYTER_PATH")] if p]
        env = dict(os.environ, JUPYTER_PATH=os.pathsep.join(jupyter_path),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"),
                   JUPYTER_DATA_DIR=str(tmp / "data"), IPYTHONDIR=str(tmp / "ipython"))
        env.pop("MPLBACKEND", None)  # the kernel draws inline, as for a reader
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
               f"--LabApp.user_settings_dir={tmp / 'settings'}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")  # containers and CI run as root
        self.log_path = tmp / "jupyterlab.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=tmp)
        self.children: set = set()
        info = tmp / "runtime" / f"jpserver-{self.proc.pid}.json"
        while not info.exists():  # written once the port is bound; it names the port the OS picked
            if self.proc.poll() is not None or time.perf_counter() - t0 > 60:
                self.stop()
                pytest.fail(f"JupyterLab did not start:\n{self.log()}")
            time.sleep(0.1)
        self.port = json.loads(info.read_text())["port"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_s = time.perf_counter() - t0

    @staticmethod
    def _write_settings(where: pathlib.Path) -> None:
        """No autosave (never write the copies back), no news or update checks (no network, no toasts)."""
        for plugin, values in {"docmanager-extension/plugin": {"autosave": False},
                               "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False}
                               }.items():
            path = where / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-4000:]

    def request(self, path: str, method: str = "GET", token: bool = True) -> int:
        sep = "&" if "?" in path else "?"
        url = self.url + path + (f"{sep}token={self.token}" if token else "")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def note_children(self) -> None:
        """Remember every process the server started (kernels), to check none outlives it."""
        self.children |= _descendants(self.proc.pid)

    def stop(self) -> set:
        """Shut down via the REST API (kernels too), then make sure; returns processes that had to be killed."""
        if self.proc.poll() is None:
            self.note_children()
            try:
                self.request("/api/shutdown", method="POST")
                self.proc.wait(timeout=30)
            except Exception:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        survivors = {pid for pid in self.children if _alive(pid)}
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return survivors


def _descendants(pid: int) -> set:
    parents = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), set()).add(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(lab):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1280, "height": 800})
            pg.set_default_timeout(60_000)
            pg.page_errors = []
            pg.on("pageerror", lambda exc: pg.page_errors.append(str(exc)))
            pg.goto(f"{lab.url}/lab?reset&token={lab.token}")
            pg.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
            pg.wait_for_selector(".jp-DirListing-item")
            yield pg
        finally:
            browser.close()


# -- the checks ---------------------------------------------------------------------------------------------

def test_token_is_required(lab):
    assert lab.request("/api/contents", token=False) == 403, "JupyterLab answers without its token"
    assert lab.request("/api/contents") == 200


def _expected(path: pathlib.Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    return {
        "cells": len(nb.cells),
        "with_outputs": sum(bool(c.outputs) for _, c in code),
        "images": sum(any(t in o.get("data", {}) for t in IMAGE_TYPES) for _, c in code for o in c.outputs),
        "first_code": code[0][0] if code else None,
        "first_has_output": bool(code and code[0][1].outputs),
    }


OPEN_JS = """async (path) => {
  const app = window.jupyterapp;
  const w = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await w.context.ready;
  window.__nb = w;
  return w.id;
}"""
KERNEL_IDLE_JS = """() => { const k = window.__nb.sessionContext.session?.kernel;
  return k && k.status === 'idle' && k.connectionStatus === 'connected'; }"""
CELL_JS = """(i) => { const m = window.__nb.content.model.cells.get(i);
  return {count: m.executionCount, outputs: m.outputs.toJSON()}; }"""
IN_VIEW_JS = """el => { const r = el.getBoundingClientRect();
  return r.top >= 0 && r.bottom <= window.innerHeight && r.height > 0; }"""
CLOSE_JS = """async () => { const w = window.__nb; if (!w) return;
  await w.sessionContext.shutdown(); w.context.model.dirty = false; w.dispose(); window.__nb = null; }"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_opens_renders_and_runs(lab, page, path):
    want = _expected(path)
    page.page_errors.clear()
    t0 = time.perf_counter()
    panel_id = page.evaluate(OPEN_JS, path.name)
    try:
        opened_s = _check_rendered(lab, page, path, panel_id, want) - t0
        _run_first_cell(page, path, panel_id, want)
        _no_dialog(page, path, "after running the first cell")
        assert not page.page_errors, f"{path.name}: JavaScript errors in the page: {page.page_errors}"
        _screenshot(page, page.locator("#" + panel_id), want, SHOTS / f"{path.stem}.png")
    except BaseException:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{path.stem}-FAILED.png"))
        raise
    finally:
        page.evaluate(CLOSE_JS)
    print(f"{path.stem}: opened and rendered in {opened_s:.1f} s, total {time.perf_counter() - t0:.1f} s")
    if os.environ.get("LAB_DOCS_SCREENSHOT") == path.stem:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(SHOTS / f"{path.stem}.png", ROOT / "docs" / "jupyterlab.png")


def _wait(page, path, what: str, js: str, arg=None, timeout: float = 60_000, detail: str | None = None):
    """``page.wait_for_function`` failing with a sentence (and ``detail``, a JS expression evaluated then)."""
    try:
        page.wait_for_function(js, arg=arg, timeout=timeout)
    except PlaywrightTimeout:
        seen = f" (seen: {page.evaluate(detail, arg)})" if detail else ""
        pytest.fail(f"{path.name}: {what} within {timeout / 1000:.0f} s{seen}")


def _check_rendered(lab, page, path, panel_id, want) -> float:
    """Every cell, an output per code cell with outputs, every figure loaded; the lab's kernel, no dialog."""
    count_js = "([id, sel]) => document.querySelectorAll('#' + id + ' ' + sel).length"
    _wait(page, path, f"not all {want['cells']} cells rendered", f"a => ({count_js})(a) === a[2]",
          [panel_id, CELL_SEL, want["cells"]], detail=count_js)  # cells attach progressively
    _wait(page, path, f"fewer than {want['with_outputs']} outputs rendered", f"a => ({count_js})(a) >= a[2]",
          [panel_id, ".jp-OutputArea-output", want["with_outputs"]], detail=count_js)
    if want["images"]:
        imgs_js = "([id]) => [...document.querySelectorAll('#' + id + ' .jp-OutputArea-output img')]"
        _wait(page, path, f"not all {want['images']} figures shown",
              f"a => {{ const imgs = ({imgs_js})(a); return imgs.length >= a[1] && "
              "imgs.every(i => i.complete && i.naturalWidth > 0); }", [panel_id, want["images"]], timeout=20_000,
              detail=f"a => ({imgs_js})(a).map(i => i.complete && i.naturalWidth > 0 ? 'ok' : 'broken').join(',')")
    t_rendered = time.perf_counter()
    _wait(page, path, "the kernel did not start", KERNEL_IDLE_JS, timeout=CELL_TIMEOUT_MS,
          detail="() => window.__nb.sessionContext.session?.kernel?.status")
    lab.note_children()
    assert page.evaluate("() => window.__nb.sessionContext.kernelDisplayName") == KERNEL_NAME
    _no_dialog(page, path, "after opening")
    return t_rendered


def _run_first_cell(page, path, panel_id, want) -> None:
    """Through the UI: select the first code cell, clear its output, Shift+Enter; its output comes back."""
    i = want["first_code"]
    if i is None:
        return
    cell = page.locator(f"#{panel_id} {CELL_SEL}").nth(i)
    cell.scroll_into_view_if_needed()
    cell.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")  # command mode
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-cell-output')")
    _wait(page, path, "the first cell's output was not cleared",
          "i => window.__nb.content.model.cells.get(i).outputs.length === 0", i)
    assert cell.locator(".jp-OutputArea-output").count() == 0
    assert page.evaluate(CELL_JS, i)["count"] is None  # so a new execution count means it ran
    page.keyboard.press("Shift+Enter")
    _wait(page, path, "the first cell did not finish",
          "i => window.__nb.content.model.cells.get(i).executionCount !== null && "
          "window.__nb.sessionContext.session.kernel.status === 'idle'", i, timeout=CELL_TIMEOUT_MS)
    result = page.evaluate(CELL_JS, i)
    errors = [o for o in result["outputs"] if o["output_type"] == "error"]
    assert not errors, f"{path.name}: the first cell raised {errors[0]['ename']}: {errors[0]['evalue']}"
    if want["first_has_output"]:
        assert result["outputs"], f"{path.name}: the first cell printed nothing this time"
        cell.locator(".jp-OutputArea-output").first.wait_for(state="visible")


def _screenshot(page, panel, want, dest: pathlib.Path) -> None:
    """The first figure if there is one, else the top of the notebook."""
    target = panel.locator(".jp-OutputArea-output img").first if want["images"] else panel.locator(CELL_SEL).first
    for _ in range(5):  # offscreen cells get their real height as they come into view: settle, then re-aim
        target.evaluate("el => el.scrollIntoView({block: 'center'})")
        page.wait_for_timeout(300)
        if page.evaluate(IN_VIEW_JS, target.element_handle()):
            break
    dest.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(dest))


def _no_dialog(page, path, when):
    dialogs = page.locator(".jp-Dialog")
    if dialogs.count():
        text = dialogs.first.inner_text()[:500]
        pytest.fail(f"{path.name}: error dialog {when}: {text}")


def test_server_stops_without_orphans(lab):
    assert lab.request("/api/status") == 200
    survivors = lab.stop()
    assert lab.proc.returncode is not None
    assert not survivors, f"processes left running after JupyterLab stopped: {sorted(survivors)}"
