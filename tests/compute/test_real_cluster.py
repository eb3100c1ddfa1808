"""featstore on a real Dask cluster of command-line programs: ``dask scheduler --preload
featstore.dashboard`` and two ``dask worker`` processes on loopback, driven by ``featstore
compute ... --scheduler tcp://...`` against the moto S3 server; the featstore page read in
headless Chromium during a compute; a worker SIGKILLed mid-compute."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

import pytest
import torch

import featstore
from featstore.versions import stored
from tests import daskprocs
from tests.cli_factories import small_dataset, small_model

# Generous hang guards: on a shared 2-core machine at load ~40 one compute took minutes.
pytestmark = pytest.mark.timeout(1800)

OUTPUTS = "features=float16,logits=float32"


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dask")
    gate = tmp / "gate"  # while it exists, tests.cli_factories:gated_model is slow
    p = daskprocs.start(tmp, n_workers=2, env=daskprocs.child_env(FEATSTORE_TEST_GATE=str(gate)))
    p.gate = gate
    yield p
    p.close()


def _compute_cmd(url: str, opts: dict, name: str, address: str, model: str = "tests.cli_factories:small_model",
                 batch_size: int = 100, samples_per_shard: int = 100) -> list[str]:
    return [sys.executable, "-m", "featstore", "compute", url, name, "--model", model,
            "--dataset", "tests.cli_factories:small_dataset", "--outputs", OUTPUTS, "--keep", "target",
            "--batch-size", str(batch_size), "--samples-per-shard", str(samples_per_shard),
            "--scheduler", address, "--json", *[a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]]


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=daskprocs.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(cmd: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=daskprocs.child_env(), capture_output=True, text=True, timeout=timeout)


def _metric(text: str, metric: str, **labels: str) -> list[float]:
    """The values of ``metric`` whose labels include ``labels``, from Prometheus text."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(metric + "{") and all(w in line for w in want)]


def test_cli_compute_on_a_real_cluster_writes_a_verified_version(procs, s3_url):
    url, opts = s3_url
    res = _run(_compute_cmd(url, opts, "cli/small", procs.address, samples_per_shard=200))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    store = featstore.open_store(url, storage_options=opts)
    v = store.open(f"cli/small@{out['version']}")
    assert len(v) == len(small_dataset()) and out["shards"] == v.manifest.layout.n_shards == 6
    assert v.verify() == []
    # Model A's outputs, recomputed here: equal within float16's rounding (other process, other CPU).
    data = small_dataset()
    x = torch.stack([data[i]["input"] for i in range(0, 64)])
    with torch.inference_mode():
        want = small_model().eval()(x)
    got = v[0:64]
    torch.testing.assert_close(got["features"].float(), want["features"], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-4, rtol=1e-4)
    assert got["target"].tolist() == [data[i]["target"].item() for i in range(64)]
    # The scheduler's featstore plugin saw the whole run.
    metrics = procs.get("/metrics")
    assert _metric(metrics, "featstore_samples_done", version=out["version"]) == [len(v)]
    assert _metric(metrics, "featstore_shards", version=out["version"], state="done") == [6]
    # The same command again finds the committed version (same fingerprint).
    again = _run(_compute_cmd(url, opts, "cli/small", procs.address))
    assert again.returncode == 0 and json.loads(again.stdout)["version"] == out["version"]
    listing = _run([sys.executable, "-m", "featstore", "list", url, "--json",
                    *[a for k, val in opts.items() for a in ("--storage-option", f"{k}={val}")]])
    assert [r["version"] for r in json.loads(listing.stdout)] == [out["version"]]


def _wait_metric(procs, metric: str, cond, timeout: float = 600, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        values = _metric(procs.get("/metrics"), metric, **labels)
        if values and cond(values[0]):
            return values[0]
        time.sleep(0.2)
    raise AssertionError(f"{metric}{labels} never met the condition")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _browser():
    """Headless Debian Chromium through Selenium, with the driver path given explicitly (Selenium
    would otherwise try to download one)."""
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("no browser installed: needs Debian's chromium and chromium-driver "
                    "(apt-get install chromium chromium-driver); .ci/run installs them")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install .[test])")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1300,800"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


# Bokeh renders into shadow roots: walk them for the rows (one per run) and the cells the page
# marks with data-field.
READ_ROWS = """
function walk(n, out) { if (n.shadowRoot) walk(n.shadowRoot, out);
  for (const c of n.children || []) {
    if (c.matches && c.matches('tr[data-run]')) {
      const row = {};
      for (const td of c.querySelectorAll('td[data-field]')) row[td.dataset.field] = td.dataset.value;
      out.push(row);
    } else walk(c, out); }
  return out; }
return walk(document.body, []);
"""


def _read_page(driver, name: str, after: int = -1, timeout: float = 600) -> dict[str, str]:
    """The cells of ``name``'s run once the page shows it running with more than ``after``
    samples done (the page also lists the module's earlier runs)."""
    deadline, rows = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        rows = driver.execute_script(READ_ROWS)
        for cells in rows:
            if (cells.get("ref", "").startswith(f"{name}@") and cells.get("status") == "running"
                    and int(cells.get("samples_done", "0")) > max(after, 0)):
                return cells
        time.sleep(0.25)
    raise AssertionError(f"the page never showed {name} running past {after} samples: {rows}")


def test_dashboard_page_in_a_browser_during_a_compute(procs, s3_url, tmp_path):
    url, opts = s3_url
    plots = json.loads(procs.get("/individual-plots.json"))
    assert plots["Individual Featstore"] == "/individual-featstore"
    driver = _browser()
    procs.gate.touch()
    compute = _start(_compute_cmd(url, opts, "cli/watched", procs.address, model="tests.cli_factories:gated_model",
                                  batch_size=20))
    try:
        driver.get(procs.dashboard + "/individual-featstore")
        first = _read_page(driver, "cli/watched")
        second = _read_page(driver, "cli/watched", after=int(first["samples_done"]))
        assert int(second["samples_done"]) > int(first["samples_done"])
        assert math.isfinite(float(second["eta_s"])) and float(second["eta_s"]) > 0
        assert float(second["rate"]) > 0 and second["ref"].startswith("cli/watched@")
        driver.save_screenshot(str(tmp_path / "featstore-page.png"))
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        metrics = procs.get("/metrics")
        assert _metric(metrics, "featstore_samples_done", name="cli/watched")[0] > 0
        assert all(math.isfinite(x) for x in _metric(metrics, "featstore_eta_seconds", name="cli/watched"))
    finally:
        procs.gate.unlink(missing_ok=True)
        driver.quit()
        out, err = compute.communicate(timeout=900)
    assert compute.returncode == 0, err[-3000:]
    assert json.loads(out)["samples"] == len(small_dataset())


def test_sigkill_of_a_worker_mid_compute_still_commits_a_verified_version(procs, s3_url):
    url, opts = s3_url
    procs.gate.touch()
    compute = _start(_compute_cmd(url, opts, "cli/killed", procs.address, model="tests.cli_factories:gated_model",
                                  batch_size=50))
    try:
        _wait_metric(procs, "featstore_shards", lambda done: done >= 2, name="cli/killed", state="done")
        assert _metric(procs.get("/metrics"), "featstore_shards", name="cli/killed", state="todo")[0] > 0
        procs.kill_worker(0)
        procs.gate.unlink()
        out, err = compute.communicate(timeout=900)
    finally:
        procs.gate.unlink(missing_ok=True)
        if compute.poll() is None:
            compute.kill()
    assert compute.returncode == 0, err[-3000:]
    vid = json.loads(out)["version"]
    v = featstore.open_store(url, storage_options=opts).open(f"cli/killed@{vid}")
    assert len(v) == len(small_dataset()) and len(stored(v).shard_receipts()) == v.manifest.layout.n_shards == 12
    assert v.verify() == []
