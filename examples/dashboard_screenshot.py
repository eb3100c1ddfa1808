"""Take docs/dashboard.png: the featstore page of the Dask dashboard during a demo compute.

    python examples/dashboard_screenshot.py [--n 40000] [--out docs/dashboard.png]

Runs the demo CNN's compute on the embedded cluster (which serves the page with no set-up) in a
background thread, opens the page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium) once the compute is a third done, and saves a screenshot.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import featstore
from featstore.demo import ModelA, SyntheticImages

PAGE_LINE = re.compile(r"progress page at (\S+)")


class _Tee:
    """stderr that also remembers the page URL the compute prints."""

    def __init__(self, inner) -> None:
        self.inner, self.url = inner, None

    def write(self, text: str) -> int:
        m = PAGE_LINE.search(text)
        if m:
            self.url = m.group(1)
        return self.inner.write(text)

    def flush(self) -> None:
        self.inner.flush()


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,720"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=opts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=40000)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "dashboard.png")
    p.add_argument("--at", type=float, default=0.35, help="take it when this share of samples is done")
    args = p.parse_args()
    tee = _Tee(sys.stderr)
    sys.stderr = tee
    with tempfile.TemporaryDirectory() as root:
        store = featstore.open_store(root)
        job = threading.Thread(target=store.compute, args=("demo/cnn-a",), kwargs=dict(
            model=ModelA(), dataset=SyntheticImages(args.n), keep=["target"],
            outputs={"features": "float16", "logits": "float32"}, batch_size=256,
            options=featstore.ComputeOptions(progress=False)), daemon=True)
        job.start()
        while tee.url is None:
            time.sleep(0.2)
        driver = _browser()
        try:
            driver.get(tee.url)
            while True:
                cells = dict(driver.execute_script(READ_CELLS))
                if int(cells.get("samples_done", 0)) >= args.at * args.n:
                    break
                time.sleep(0.5)
            time.sleep(1.0)
            driver.save_screenshot(str(args.out))
            print(f"saved {args.out}: {cells}", file=sys.__stderr__)
        finally:
            driver.quit()
        job.join()
    return 0


READ_CELLS = """
function walk(n, out) { if (n.shadowRoot) walk(n.shadowRoot, out);
  for (const c of n.children || []) {
    if (c.matches && c.matches('tr[data-run] td[data-field]')) out.push([c.dataset.field, c.dataset.value]);
    walk(c, out); }
  return out; }
return walk(document.body, []);
"""

if __name__ == "__main__":
    sys.exit(main())
