"""Every notebook, run as a reader runs it: real JupyterLab, a real (headless) browser.

Starts ``jupyter lab`` on 127.0.0.1 with a random token, opens each notebook in Debian's
Chromium through Playwright, runs "Restart Kernel and Run All Cells" and waits for the kernel
to go idle. Then it checks that no cell shows an error or stderr, that the notebooks with plots
render images, and saves a screenshot of each notebook under ``test-artifacts/jupyterlab/``.
The server, its kernels and the browser are shut down even when the test fails.

Run it alone with ``pytest tests/test_jupyterlab.py``; leave it out with
``pytest -m "not browser"``. It is skipped, with the reason, where Chromium or Playwright is
missing.
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "test-artifacts" / "jupyterlab"
CHROMIUM = "/usr/bin/chromium"
# Each notebook's time budget on 2 cores (run alone, under nbval). In the browser a run may
# take up to twice that, plus a minute, before the test calls it overrun.
BUDGET_S = {"01": 120, "02": 120, "03": 150, "04": 120, "05": 150}
DEFAULT_BUDGET_S = 120  # a new notebook, until it gets its own line above
# Run All stops at the first error and leaves the kernel idle: after this long idle with cells
# never run, the test fails and says where the run stopped.
IDLE_GRACE_S = 5
# Queued cells under a kernel that stays idle this long: the requests were lost.
STALL_S = 30
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]

pytestmark = pytest.mark.browser


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url, token, method="GET"):
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


def _stored_image_count(path):
    nb = json.loads(path.read_text())
    return sum("image/png" in out.get("data", {}) for cell in nb["cells"]
               for out in cell.get("outputs", []))


class JupyterLab:
    """``jupyter lab`` on 127.0.0.1 in its own process group, with private config and
    runtime folders, so everything it starts can be found and stopped."""

    def __init__(self):
        self.port, self.token = _free_port(), secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        self.home = Path(tempfile.mkdtemp(prefix="gradtut-lab-"))
        settings = self.home / "settings" / "@jupyterlab" / "notebook-extension"
        settings.mkdir(parents=True)
        # Render every cell (JupyterLab 4 only renders the visible ones by default), so that
        # the page can be checked for errors and images all the way down.
        (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
        # Never write the run back into the repository's notebooks, and ask no news server.
        for plugin, value in [("docmanager-extension/plugin", '{"autosave": false}'),
                              ("apputils-extension/notification", '{"fetchNews": "false"}')]:
            folder, name = plugin.split("/")
            (self.home / "settings" / "@jupyterlab" / folder).mkdir(exist_ok=True)
            (self.home / "settings" / "@jupyterlab" / folder /
             f"{name}.jupyterlab-settings").write_text(value)
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(self.home / "config"),
               "JUPYTER_RUNTIME_DIR": str(self.home / "runtime"),
               "JUPYTERLAB_SETTINGS_DIR": str(self.home / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(self.home / "workspaces")}
        command = [sys.executable, "-m", "jupyterlab", "--no-browser",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={ROOT}", "--LabApp.expose_app_in_browser=True"]
        if os.geteuid() == 0:
            command.append("--ServerApp.allow_root=True")
        self.log = open(self.home / "server.log", "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_ready(self, timeout_s=90):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.process.returncode}:\n"
                                   + self.log_tail())
            try:
                _request(f"{self.base}/api/status", self.token)
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines=30):
        self.log.flush()
        return "\n".join((self.home / "server.log").read_text().splitlines()[-lines:])

    def shut_down_kernels(self):
        for kernel in _request(f"{self.base}/api/kernels", self.token) or []:
            _request(f"{self.base}/api/kernels/{kernel['id']}", self.token, method="DELETE")

    def leftovers(self):
        """Processes still running that were started by this server (kernels use the
        private runtime folder for their connection files)."""
        found = subprocess.run(["pgrep", "-f", str(self.home)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def stop(self):
        try:
            if self.process.poll() is None:
                try:
                    self.shut_down_kernels()
                    _request(f"{self.base}/api/shutdown", self.token, method="POST")
                    self.process.wait(timeout=30)
                except (urllib.error.URLError, OSError, subprocess.TimeoutExpired):
                    pass
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGTERM)
                try:
                    self.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
        finally:
            stray = self.leftovers()
            for pid in stray:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.log.close()
            shutil.rmtree(self.home, ignore_errors=True)
        return stray


CURRENT = "window.jupyterapp.shell.currentWidget"
READY = f"""() => {{
  const w = window.jupyterapp && {CURRENT};
  return !!(w && w.content && w.content.widgets && w.sessionContext &&
            w.sessionContext.session && w.sessionContext.session.kernel &&
            w.context && w.context.path === %s);
}}"""
# Restart the notebook's kernel (what Kernel > Restart Kernel does, without its dialog),
# recording the statuses it goes through.
RESTART = f"""async () => {{
  const w = {CURRENT};
  window.__gradtut_restart = [];
  w.sessionContext.statusChanged.connect((_, status) => window.__gradtut_restart.push(status));
  await w.sessionContext.restartKernel();
}}"""
# Record every kernel status the notebook's session reports (a restart or a dead kernel shows
# up here even when it is over by the time we look).
WATCH = f"""() => {{
  const w = {CURRENT};
  window.__gradtut_statuses = [];
  w.sessionContext.statusChanged.connect((_, status) => window.__gradtut_statuses.push(status));
}}"""
# The state of the run, read once a second: per code cell its execution count, whether it is
# queued or running ("[*]"), its error and stderr outputs; the kernel's status and history.
STATE = f"""() => {{
  const w = {CURRENT};
  const code = w.content.widgets.filter(c => c.model.type === 'code');
  const outputs = c => Array.from({{length: c.model.outputs.length}},
                                  (_, i) => c.model.outputs.get(i).toJSON());
  const text = t => Array.isArray(t) ? t.join('') : (t || '');
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return {{
    kernel: kernel ? kernel.status : 'no kernel',
    statuses: window.__gradtut_statuses || [],
    cells: code.map((c, i) => ({{
      cell: i + 1,
      count: c.model.executionCount,
      pending: !!(c.promptNode && c.promptNode.textContent.includes('*')),
      source: c.model.sharedModel.getSource().split('\\n')[0].slice(0, 80),
      errors: outputs(c).filter(o => o.output_type === 'error')
                        .map(o => `${{o.ename}}: ${{o.evalue}}`.slice(0, 2000)),
      stderr: outputs(c).filter(o => o.output_type === 'stream' && o.name === 'stderr')
                        .map(o => text(o.text).slice(-2000)),
    }})),
  }};
}}"""
SUMMARY = f"""() => {{
  const w = {CURRENT};
  const code = w.content.widgets.filter(c => c.model.type === 'code');
  const outputs = c => Array.from({{length: c.model.outputs.length}},
                                  (_, i) => c.model.outputs.get(i).toJSON());
  return {{
    counts: code.map(c => c.model.executionCount),
    errors: code.flatMap((c, i) => outputs(c).filter(o => o.output_type === 'error')
                                      .map(o => `cell ${{i + 1}}: ${{o.ename}}: ${{o.evalue}}`)),
    images_in_model: code.reduce((n, c) => n + outputs(c).filter(
        o => o.data && o.data['image/png']).length, 0),
    stderr_shown: w.node.querySelectorAll(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').length,
    images_shown: w.node.querySelectorAll('.jp-RenderedImage img').length,
    id: w.id,
  }};
}}"""
# Shut the notebook's kernel down and close its tab without saving, so that the next
# notebook is the only one open (a tab left open would start a new kernel when its old one
# is shut down).
CLOSE = f"""async () => {{
  const w = {CURRENT};
  if (!w || !w.context) return;
  w.context.model.dirty = false;
  await w.sessionContext.shutdown();
  w.dispose();
}}"""


RESTARTING = {"restarting", "autorestarting", "terminating"}


def _squeeze(statuses):
    """The kernel's status history, short: how many changes, and the last few."""
    return f"{len(statuses)} changes, the last: {statuses[-8:]}"


class NotebookRunFailed(AssertionError):
    """The run stopped, failed or overran; the message says where and shows the evidence."""


def _verdict(state, idle_since, now):
    """None while the run is healthy and going on; "finished"; or why it has failed.
    ``idle_since``: since when the kernel has been idle without a break (None if busy)."""
    cells = state["cells"]
    unrun = [c for c in cells if c["count"] is None]
    culprit = (f" at cell {unrun[0]['cell']} (the first without a result): {unrun[0]['source']}"
               if unrun else "")
    if state["kernel"] == "dead" or "dead" in state["statuses"]:
        return f"the kernel died (status {state['kernel']!r}){culprit}"
    if set(state["statuses"]) & RESTARTING:
        return f"the kernel died or was restarted during the run{culprit}"
    if state["kernel"] != "idle":
        return None
    if any(c["pending"] for c in cells):
        # An idle kernel starts the next queued cell at once; queued cells under a kernel that
        # stays idle were never sent, or their requests were lost.
        if idle_since is not None and now - idle_since >= STALL_S:
            return (f"the kernel has been idle for {now - idle_since:.0f} s while "
                    f"{sum(c['pending'] for c in cells)} cells wait in the queue")
        return None
    if all(c["count"] is not None for c in cells):
        return "finished"
    if idle_since is not None and now - idle_since >= IDLE_GRACE_S:
        failed = [c["cell"] for c in cells if c["errors"]]
        return (f"the kernel has been idle for {now - idle_since:.0f} s with "
                f"{sum(c['count'] is None for c in cells)} code cells never run" +
                (f": Run All stopped at the error in cell {failed[0]}" if failed else
                 " and no error shown"))
    return None


def _report(reason, state, lab, path, seconds):
    """A failure message: the reason, then every cell that ran, failed or waits, the kernel's
    status and history, and the tail of the server log (kernels write their stderr there)."""
    lines = [f"{path.name}: {reason} after {seconds:.0f} s",
             f"kernel status {state['kernel']!r}; restarts during the run "
             f"{sum(s in RESTARTING for s in state['statuses'])}; statuses seen since the "
             f"first cell started {_squeeze(state['statuses'])}"]
    for c in state["cells"]:
        mark = ("ran" if c["count"] is not None else "RUNNING/QUEUED" if c["pending"]
                else "never ran")
        lines.append(f"  cell {c['cell']:2d} [{c['count'] if c['count'] is not None else ' '}] "
                     f"{mark:14s} {c['source']}")
        lines += [f"      ERROR {e}" for e in c["errors"]]
        lines += ["      STDERR " + s.strip().replace("\n", "\n             ")
                  for s in c["stderr"]]
    lines += ["server log (tail; a kernel's own stderr lands here):", lab.log_tail(40)]
    return "\n".join(lines)


def _wait_for_run(page, lab, path):
    """Poll the run once a second until every code cell has run and the kernel is idle.
    Fail at once, with a per-cell report, when the kernel died or restarted, or has been idle
    for IDLE_GRACE_S with cells never run (Run All stops at an error); fail when the notebook
    overruns its budget plus a margin."""
    budget = BUDGET_S.get(path.name[:2], DEFAULT_BUDGET_S)
    limit = budget * 2 + 60
    start, idle_since, running = time.monotonic(), None, None
    while True:
        now = time.monotonic()
        state = page.evaluate(STATE)
        pending = [c for c in state["cells"] if c["pending"]]
        running = pending[0] if pending else running
        idle_since = None if state["kernel"] != "idle" else (idle_since or now)
        verdict = _verdict(state, idle_since, now)
        if verdict == "finished":
            return
        if verdict is None and now - start > limit:
            verdict = f"the run took longer than {limit} s (budget {budget} s, doubled, plus 60)"
        if verdict is not None:
            if running is not None:
                verdict += (f"; the last cell seen running was cell {running['cell']}: "
                            f"{running['source']}")
            raise NotebookRunFailed(_report(verdict, state, lab, path, now - start))
        time.sleep(1)


def _until(page, lab, path, condition, failure, timeout_s=60):
    """Wait for a JavaScript condition; on timeout fail with the full per-cell report."""
    start = time.monotonic()
    try:
        page.wait_for_function(condition, timeout=timeout_s * 1000, polling=500)
    except Exception as err:  # playwright's TimeoutError: report what the page shows instead
        raise NotebookRunFailed(_report(f"{failure} within {timeout_s} s",
                                        page.evaluate(STATE), lab, path,
                                        time.monotonic() - start)) from err


def _screenshot(page, path, summary_id=None):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    if summary_id is not None:
        images = page.locator(f"[id='{summary_id}'] .jp-RenderedImage img")
        if images.count():
            images.first.scroll_into_view_if_needed()  # show a plot, not just the title
    page.screenshot(path=str(ARTIFACTS / f"{path.stem}.png"))


def _run_notebook(page, lab, path):
    relative = path.relative_to(ROOT).as_posix()
    # ?reset: start from an empty workspace, so that only this notebook is open (JupyterLab
    # would otherwise restore the earlier tabs, and start kernels for them).
    page.goto(f"{lab.base}/lab/tree/{relative}?reset&token={lab.token}")
    page.wait_for_function(READY % json.dumps(relative), timeout=120_000)
    # Notebook commands act on the notebook that has focus: give it the focus first.
    page.bring_to_front()
    page.evaluate(f"() => window.jupyterapp.shell.activateById({CURRENT}.id)")
    page.wait_for_function(f"() => {CURRENT}.content.node.contains(document.activeElement) ||"
                           f" {CURRENT}.node.contains(document.activeElement)", timeout=30_000)
    page.evaluate("() => window.jupyterapp.commands.execute("
                  "'notebook:clear-all-cell-outputs')")
    page.wait_for_function(f"() => {CURRENT}.content.widgets.every("
                           "c => c.model.type !== 'code' || c.model.executionCount === null)",
                           timeout=30_000)
    try:
        # Kernel > "Restart Kernel and Run All Cells" in two steps, each waited for. Issued at
        # once, the run-all can race the restart, and its execute requests are lost: the
        # cells stay queued and the kernel idle (jupyterlab/jupyterlab#13361). That is how
        # notebook 03 hung in CI, twice, with no cell run at all.
        _until(page, lab, path, f"() => {CURRENT}.sessionContext.session?.kernel?.status === "
               "'idle'", "the kernel did not become idle after the notebook opened")
        page.evaluate(RESTART)
        _until(page, lab, path, "() => window.__gradtut_restart.includes('restarting') && "
               f"{CURRENT}.sessionContext.session?.kernel?.status === 'idle'",
               "the kernel did not come back idle after its restart")
        page.evaluate(WATCH)  # from here on, any restart or a dead kernel fails the run
        # Not awaited (the command's promise settles only when the last cell has run).
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        _wait_for_run(page, lab, path)
    except BaseException:
        try:
            _screenshot(page, path)
        except Exception:  # pylint: disable=broad-except  (the page may be gone: keep the report)
            pass
        raise
    summary = page.evaluate(SUMMARY)
    _screenshot(page, path, summary["id"])
    return summary


@pytest.fixture(scope="module")
def browser_page():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is not installed (pip install -r "
                                      "requirements.txt installs it)")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium package "
                    "(apt-get install chromium); .ci/run does this in CI")
    lab = JupyterLab()
    try:
        lab.wait_until_ready()
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                yield page, lab
            finally:
                browser.close()
    finally:
        stray = lab.stop()
        assert not stray, f"processes outlived the JupyterLab server and were killed: {stray}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab(browser_page, path):
    page, lab = browser_page
    stored = path.read_bytes()
    try:
        summary = _run_notebook(page, lab, path)
    finally:
        try:
            page.evaluate(CLOSE)
        finally:
            lab.shut_down_kernels()
    assert path.read_bytes() == stored, "JupyterLab wrote to the notebook file"
    assert summary["errors"] == [], summary["errors"]
    assert summary["counts"] == list(range(1, len(summary["counts"]) + 1)), (
        "the cells did not run once each, top to bottom, in a fresh kernel")
    assert summary["stderr_shown"] == 0, "a cell shows stderr output"
    if _stored_image_count(path):
        assert summary["images_in_model"] == _stored_image_count(path)
        assert summary["images_shown"] >= summary["images_in_model"] > 0
    assert (ARTIFACTS / f"{path.stem}.png").stat().st_size > 10_000
