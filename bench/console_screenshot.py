"""A screenshot of the web console (the admin endpoint's `/`) for docs/ and the README.

    apt-get install chromium chromium-driver && pip install selenium
    python bench/console_screenshot.py [--out docs/console.png] [--seconds 30] [--page active]

Starts an active node and its replica on free ports in a temp dir, creates a topic, and runs a
light load (memcached SETs and GETs, TANK produces and consumes) while headless chromium shows
the console of one of them (`--page active` or `replica`) for `--seconds` seconds, long enough
for the live charts to draw a history; then saves the whole page as a PNG. Every wait is
bounded: the script finishes or fails within `--seconds` plus about a minute.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, SluiceNode, log, wait_until  # noqa: E402

CONFIG = "[snapshot]\ninterval = 0\n[buckets.default]\nnum_vbuckets = 64\n"
WIDTH = 1400


def load(node: SluiceNode, stop: threading.Event) -> None:
    """A few hundred requests a second: enough to move the charts, light on a 2-core machine."""
    import bmemcached
    from sluice.tank import TankConnection

    tank_address = node.ready_line.split("(TANK ")[1].split(")")[0]
    c = bmemcached.Client([node.address])
    with TankConnection(tank_address) as t:
        i = 0
        while not stop.is_set():
            # The rate swells and ebbs, so the charts show a shape rather than a flat line.
            burst = 1 + int(3 * (1 + math.sin(time.monotonic() / 4)))
            for _ in range(burst):
                c.set(f"key{random.randrange(2000)}", "v" * random.randrange(50, 500))
                c.get(f"key{random.randrange(2000)}")
            if i % 5 == 0:
                t.produce("events", [b"event %d" % i], partition=i % 2)
            if i % 15 == 0:
                t.consume("events", partition=0, seq=0, fetch_size=2048)
            i += 1
            time.sleep(0.01)
    c.disconnect_all()


def browser():
    from selenium import webdriver

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        sys.exit("needs chromium and chromedriver: apt-get install chromium chromium-driver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--disable-dev-shm-usage", "--no-sandbox", f"--window-size={WIDTH},1200"):
        opts.add_argument(arg)
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(driver))
    d.set_page_load_timeout(30)
    d.set_script_timeout(30)
    return d


def screenshot(url: str, out: Path, seconds: float) -> None:
    """Shows `url` for `seconds`, then saves the whole page (not just the window) to `out`."""
    with urllib.request.urlopen(url, timeout=10) as r:
        page = r.read().decode(errors="replace")
    if "console.js" not in page:
        sys.exit(f"{url} serves no console (an older sluice?): {page[:200]!r}")
    d = browser()
    try:
        d.get(url)
        polls = lambda: int(d.find_element("tag name", "body").get_attribute("data-polls") or 0)  # noqa: E731
        wait_until(lambda: polls() >= 1, 30, "the console's first poll", interval=0.2)
        time.sleep(seconds)
        height = d.execute_script("return document.documentElement.scrollHeight")
        d.set_window_size(WIDTH, min(height + 40, 16000))
        time.sleep(1)  # the charts take the new size on their next frame
        out.parent.mkdir(parents=True, exist_ok=True)
        d.save_screenshot(str(out))
        errors = [e["message"] for e in d.get_log("browser") if e["level"] == "SEVERE"]
        if errors:
            log(f"the page logged errors: {errors}")
    finally:
        d.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "console.png")
    ap.add_argument("--seconds", type=float, default=30, help="history to gather before the shot")
    ap.add_argument("--page", choices=("active", "replica"), default="active")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="sluice-console-") as tmp:
        config = Path(tmp) / "sluice.toml"
        config.write_text(CONFIG)
        active = SluiceNode(Path(tmp) / "active", config)
        replica = None
        stop = threading.Event()
        try:
            replica = SluiceNode(Path(tmp) / "replica", config, replica_of=active.address)
            from sluice.tank import TankConnection

            with TankConnection(active.ready_line.split("(TANK ")[1].split(")")[0]) as t:
                t.create_topic("events", 2)
            threading.Thread(target=load, args=(active, stop), daemon=True).start()
            node = active if args.page == "active" else replica
            url = f"http://{node.admin}/"
            log(f"showing {url} for {args.seconds:.0f} s")
            screenshot(url, args.out, args.seconds)
            log(f"wrote {args.out}")
        finally:
            stop.set()
            for n in (replica, active):
                if n is not None:
                    n.stop()


if __name__ == "__main__":
    main()
