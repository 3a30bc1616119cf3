"""The web console the admin endpoint serves at `/`, in a real browser: Debian's chromium,
headless, driven by selenium through chromium-driver, against `sluice serve` nodes.

- An active with a replica and a topic: the page loads with no console error and no request to
  anything but the node, is served under its Content-Security-Policy and weighs under 300 KB,
  the numbers it shows are /status's (items, the replica's vbucket states and seqnos, the
  topic's partitions), and its live charts draw (canvases with coloured pixels).
- A replica with users whose admin endpoint speaks HTTPS: Promote and Create topic are refused
  (401, 403) without credentials or with a user lacking `admin`, and work signed in as an
  admin.
- A cluster of 3 nodes on a real etcd (skipped without Debian's etcd-server): the Cluster
  section shows the nodes up, the vbucket grid's actives and a topic's partition leaders as
  /status's `cluster` reports them, and Start rebalance is refused without an admin and
  requested (202) as one.

Skipped when selenium, chromium or chromedriver is missing:
`pip install selenium && apt-get install chromium chromium-driver`.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import threading
import time
import urllib.request
from pathlib import Path

import bmemcached
import pytest
from helpers import Node, start_node, wait_converged, write_users_config
from sluice.tank import TankConnection

webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (pip install selenium)"
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(
        "no chromium or chromedriver (apt-get install chromium chromium-driver)", allow_module_level=True
    )

# The files the page is made of, as the endpoint serves them.
PAGE_FILES = ("/", "/console.js", "/console.css", "/uPlot.iife.min.js", "/uPlot.min.css")
POLL_S = 2  # the page's polling interval


# --- The browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.add_argument("--headless=new")
    opts.add_argument("--window-size=1400,1600")
    opts.add_argument("--disable-dev-shm-usage")
    if os.geteuid() == 0:
        opts.add_argument("--no-sandbox")  # chromium's sandbox refuses to run as root
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The HTTPS node's certificate comes from the test's own CA.
    opts.accept_insecure_certs = True
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def base_url(node: Node) -> str:
    """The console's address: the node's admin endpoint (https:// when it speaks TLS)."""
    return node.admin if "://" in node.admin else f"http://{node.admin}"


def open_console(driver, node: Node, polls: int = 2) -> None:
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(base_url(node) + "/")
    wait_polls(driver, polls)


def polls_done(driver) -> int:
    return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-polls") or 0)


def wait_polls(driver, n: int) -> None:
    """Until the page has drawn `n` more answers of /status than when called (or n in all on
    a page just loaded)."""
    start = polls_done(driver) if n > 0 else 0
    WebDriverWait(driver, 10 + n * POLL_S * 3).until(lambda d: polls_done(d) >= start + n)


def errors(driver, allowed: tuple[str, ...] = ()) -> list[dict]:
    """The console's SEVERE entries since the last call, but for those naming `allowed` text."""
    return [
        e
        for e in driver.get_log("browser")
        if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)
    ]


def text(driver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def wait_text(driver, css: str, expected: str, timeout: float = 15) -> None:
    """Until the element at `css` shows `expected` (the page redraws every poll)."""

    def shown(d) -> bool:
        found = d.find_elements(By.CSS_SELECTOR, css)
        return bool(found) and found[0].text == expected

    try:
        WebDriverWait(driver, timeout).until(shown)
    except Exception:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        raise AssertionError(f"{css}: {found[0].text if found else 'absent'!r}, not {expected!r}") from None


def status(node: Node, cafile: Path | None = None) -> dict:
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    with urllib.request.urlopen(base_url(node) + "/status", timeout=10, context=context) as r:
        return json.load(r)


# Counts, per chart, the canvas pixels drawn at all and those in a saturated colour: axes, grid
# and labels are grey, so coloured pixels are the series' lines.
CHART_PIXELS = """
return [...document.querySelectorAll('.chart')].map((chart) => {
  const canvas = chart.querySelector('canvas');
  if (!canvas) return [chart.id, 0, 0];
  const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let ink = 0, colour = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] === 0) continue;
    ink++;
    if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 80) colour++;
  }
  return [chart.id, ink, colour];
});
"""


# --- An active, its replica and a topic -----------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("console")
    active = start_node(root, "active")
    replica = start_node(root, "replica", "--replica-of", active.address)
    try:
        with TankConnection(active.tank) as t:
            t.create_topic("events", 2)
            t.produce("events", [b"one", b"two", b"three"])
            t.produce("events", [b"elsewhere"], partition=1)
            t.consume("events", seq=0)
        c = bmemcached.Client([active.address])
        for i in range(300):
            c.set(f"key{i}", "v" * 100)
        c.disconnect_all()
        wait_converged(active, replica)
        # The topic reaches the replica too.
        deadline = time.monotonic() + 30
        while [p["high_water_mark"] for t in status(replica)["topics"] for p in t["partitions"]] != [3, 1]:
            assert time.monotonic() < deadline, status(replica)["topics"]
            time.sleep(0.05)
        yield active, replica
    finally:
        assert replica.stop() == 0, replica.log()[-2000:]
        assert active.stop() == 0, active.log()[-2000:]


def test_the_page_is_small_and_served_under_a_strict_policy(pair):
    active, _ = pair
    total = 0
    for path in PAGE_FILES:
        with urllib.request.urlopen(base_url(active) + path, timeout=10) as r:
            body = r.read()
            assert r.status == 200, path
            kind = r.headers["Content-Type"]
            if path == "/":
                assert kind.startswith("text/html"), kind
                csp = r.headers["Content-Security-Policy"] or ""
                rules = (
                    "default-src 'self'",
                    "script-src 'self'",
                    "style-src 'self'",
                    "frame-ancestors 'none'",
                )
                assert all(rule in csp for rule in rules), csp
                assert "unsafe" not in csp, csp
            total += len(body)
    assert total < 300_000, f"the page weighs {total} bytes"


def test_the_replicas_console_shows_what_status_says(pair, browser):
    active, replica = pair
    open_console(browser, replica)
    assert errors(browser) == []
    st = status(replica)

    # Overview: the role, the fronts and their addresses.
    wait_text(browser, "dd[data-field=role]", f"replica of {active.address}")
    assert text(browser, "dd[data-field=instance]") == st["instance"]
    assert text(browser, "dd[data-field=listen]") == replica.address
    fronts = browser.find_elements(By.CSS_SELECTOR, "#fronts tbody tr")
    assert [f.get_attribute("data-front") for f in fronts] == list(st["fronts"])
    for row in fronts:
        front = st["fronts"][row.get_attribute("data-front")]
        assert row.find_elements(By.TAG_NAME, "td")[1].text == front["listen"]

    # Buckets: the item count, and every vbucket's state and seqnos in the grid.
    bucket = st["buckets"][0]
    items = sum(v["items"] for v in bucket["vbuckets"])
    assert items == 300
    wait_text(browser, "#bucket-table tr[data-bucket=default] td[data-field=items]", f"{items:,}")
    cells = browser.find_elements(By.CSS_SELECTOR, ".vbgrid[data-bucket=default] .vb")
    assert len(cells) == len(bucket["vbuckets"]) == 16
    for cell, vb in zip(cells, bucket["vbuckets"], strict=True):
        assert cell.get_attribute("data-state") == vb["state"] == "replica"
        assert "vb-replica" in cell.get_attribute("class").split()
        title = cell.get_attribute("title")
        assert f"high seqno {vb['high_seqno']}" in title, title
        assert f"persisted seqno {vb['persisted_seqno']}" in title, title

    # Replication: whom it follows, streaming.
    assert text(browser, "#replication-body p[data-field=replica_of]") == (
        f"This node is a replica of {active.address}."
    )
    assert text(browser, "#followed tr[data-bucket=default] td:nth-child(3)") == "yes"

    # Topics: each partition's first and high-water sequence numbers.
    for p in st["topics"][0]["partitions"]:
        row = f"#topic-table tr[data-topic=events][data-partition='{p['partition']}']"
        assert text(browser, f"{row} td[data-field=first_seq]") == f"{p['first_seq']:,}"
        assert text(browser, f"{row} td[data-field=high_water_mark]") == f"{p['high_water_mark']:,}"

    # Cluster: not in one, so no placement and no rebalance to start.
    assert "cluster" not in st or st["cluster"] is None
    assert text(browser, "#cluster-body") == "This node is not in a cluster."
    assert not browser.find_element(By.ID, "cluster-placement").is_displayed()
    assert not browser.find_element(By.ID, "rebalance-action").is_displayed()

    # Nothing was asked of anyone but the node.
    urls = browser.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    assert urls and all(u.startswith(base_url(replica) + "/") for u in urls), urls
    assert errors(browser) == []


def test_the_charts_draw_live_traffic(pair, browser):
    active, replica = pair
    stop = threading.Event()

    def load() -> None:
        c = bmemcached.Client([active.address])
        with TankConnection(active.tank) as t:
            i = 0
            while not stop.is_set():
                c.set(f"load{i % 200}", "x" * 50)
                c.get(f"load{i % 200}")
                if i % 10 == 0:
                    t.produce("events", [b"more"])
                    t.consume("events", seq=0, fetch_size=4096)
                i += 1
                time.sleep(0.002)
        c.disconnect_all()

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        open_console(browser, active, polls=4)
        # The active's page: its replica, and the memcached front busy.
        replica_id = status(replica)["instance"]
        row = f"#replicas tr[data-replica='{replica_id}']"
        assert text(browser, f"{row} td:nth-child(2)") == replica.address
        assert text(browser, f"{row} td[data-field=vbuckets]") == "16"
        rps = text(browser, "#fronts tr[data-front=memcached] td[data-field=rps]")
        assert rps not in ("—", "0"), rps
        drawn = {name: (ink, colour) for name, ink, colour in browser.execute_script(CHART_PIXELS)}
        assert set(drawn) == {"chart-requests", "chart-lag", "chart-topics"}, drawn
        for name, (ink, colour) in drawn.items():
            assert ink > 1000 and colour > 50, (name, ink, colour)
        produced = text(browser, "#topic-table tr.topic-row[data-topic=events] td[data-field=produce_rate]")
        assert produced not in ("—", "0"), produced
        assert errors(browser) == []

        # The replica's page charts its own lag (seqnos and seconds).
        open_console(browser, replica, polls=3)
        names = browser.execute_script(
            "return [...document.querySelectorAll('#chart-lag .u-legend .u-label')].map((e) => e.textContent)"
        )
        assert f"default from {active.address} (seqnos)" in names, names
        drawn = {name: colour for name, _, colour in browser.execute_script(CHART_PIXELS)}
        assert drawn["chart-lag"] > 50, drawn
        assert errors(browser) == []
    finally:
        stop.set()
        loader.join(timeout=30)


# --- Actions, with users, over HTTPS --------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """An active and its replica, both with users (write_users_config's: bob read-only, root
    admin on every bucket and topic); the replica logs in to its active as root and serves its admin endpoint
    over HTTPS."""
    from test_tls import Pki, tls_config

    root = tmp_path_factory.mktemp("console-tls")
    pki = Pki(root, "console-test")
    cert, key = pki.issue("server", 52)
    users = root / "users.toml"
    write_users_config(users, '["read"]')
    # root (the file's last table) may create topics too, whichever grant POST /topics checks.
    users.write_text(users.read_text() + 'topics = { "*" = ["read", "write", "stream", "admin"] }\n')
    bucket = "[snapshot]\ninterval = 0\n[buckets.default]\nnum_vbuckets = 16\n"
    active_cfg = root / "active.toml"
    active_cfg.write_text(bucket + users.read_text())
    active = Node(root / "a", "--config", str(active_cfg))
    (root / "root.pw").write_text("root-secret\n")
    replica_cfg = root / "replica.toml"
    replica_cfg.write_text(
        tls_config(cert, key)
        + bucket
        + users.read_text()
        + f'[replication]\nuser = "root"\npassword_file = "{root / "root.pw"}"\n'
    )
    replica = Node(root / "b", "--config", str(replica_cfg), "--replica-of", active.address)
    try:
        assert replica.admin.startswith("https://"), replica.admin
        yield active, replica, pki.ca_file
    finally:
        assert replica.stop() == 0, replica.log()[-2000:]
        assert active.stop() == 0, active.log()[-2000:]


def sign_in(driver, user: str | None, password: str = "") -> None:
    """Signs the page's login box in as `user`, or out (None)."""
    clear = driver.find_element(By.ID, "login-clear")
    if clear.is_displayed():
        clear.click()
    if user is None:
        return
    for field, value in (("login-user", user), ("login-password", password)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "login-use").click()
    assert text(driver, "#login-state") == f"signed in as {user}"


def act(driver, button: str, result: str) -> tuple[int, str]:
    """Clicks an action's button twice (the first arms it and asks for confirmation): its
    answer's status and the text shown."""
    b, out = driver.find_element(By.ID, button), driver.find_element(By.ID, result)
    label, before = b.text, out.text
    b.click()
    assert b.text.startswith("Confirm"), b.text
    time.sleep(0.3)
    assert out.text == before, "nothing is sent before the second click"
    b.click()  # clears the last answer before sending
    WebDriverWait(driver, 60).until(lambda d: (out.get_attribute("data-status") or "").isdigit())
    assert b.text == label
    return int(out.get_attribute("data-status")), out.text


# A refused action is also a failed load in the browser's console.
REFUSALS = ("status of 401", "status of 403")


def test_actions_need_an_admin_over_https(secured, browser):
    active, replica, ca = secured
    open_console(browser, replica)
    assert errors(browser) == []
    wait_text(browser, "dd[data-field=admin_https]", "yes")

    # Promote: refused without credentials, and with a user lacking admin.
    code, shown = act(browser, "promote", "promote-result")
    assert code == 401 and shown.startswith("refused (401") and "credentials required" in shown, shown
    sign_in(browser, "bob", "bob-secret")
    code, shown = act(browser, "promote", "promote-result")
    assert code == 403 and shown.startswith("refused (403") and "admin permission" in shown, shown
    assert status(replica, ca)["replication"]["replica_of"] == active.address, "nothing changed"

    # As an admin it is taken, and the page shows the node active.
    sign_in(browser, "root", "root-secret")
    code, shown = act(browser, "promote", "promote-result")
    assert code == 200 and shown.startswith("done (200") and '"promoted"' in shown, shown
    assert status(replica, ca)["replication"] is None
    wait_text(browser, "dd[data-field=role]", "active")
    wait_text(browser, ".vbbox h3", "default: 16 vbuckets — 16 active")

    # Create a topic: refused signed out, created signed in as an admin.
    sign_in(browser, None)
    browser.find_element(By.ID, "topic-name").send_keys("made.here")
    partitions = browser.find_element(By.ID, "topic-partitions")
    partitions.clear()
    partitions.send_keys("3")
    code, shown = act(browser, "topic-create", "topic-result")
    assert code == 401 and shown.startswith("refused"), shown
    assert all(t["name"] != "made.here" for t in status(replica, ca)["topics"])
    sign_in(browser, "root", "root-secret")
    code, shown = act(browser, "topic-create", "topic-result")
    assert code == 200 and shown.startswith("done (200"), shown
    made = [t for t in status(replica, ca)["topics"] if t["name"] == "made.here"]
    assert len(made) == 1 and len(made[0]["partitions"]) == 3, made
    wait_text(browser, "#topic-table tr.topic-row[data-topic='made.here'] td:nth-child(2)", "3 partition(s)")
    assert errors(browser, allowed=REFUSALS) == []


# --- A cluster on etcd ----------------------------------------------------------------------

# TANK clients have the guest's grants (TANK has no login).
GUEST = '[users.guest]\ntopics = { "*" = ["read", "write", "admin"] }\n'
# Each vbucket's active as the placement grid shows it ("" for none).
GRID_ACTIVES = """
return [...document.querySelectorAll('#cluster-vbuckets .vb')]
  .map((c) => [c.dataset.active, c.dataset.chain]);
"""


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed")
def test_the_cluster_view_shows_the_map_and_starts_a_rebalance(tmp_path, browser):
    from test_cluster import EtcdServer, form, stop_all, wait_map
    from test_permissions import PASSWORD

    etcd = EtcdServer(tmp_path / "etcd")
    nodes: dict = {}
    try:
        nodes = form(tmp_path, etcd, ["n1", "n2", "n3"], config=GUEST)
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("placed", 3)
        wait_map(etcd, lambda m: "placed" in m.get("topics", {}), timeout=30)
        node = nodes["n2"]
        deadline = time.monotonic() + 30
        while True:
            c = status(node)["cluster"]
            leaders = c["topics"].get("placed", [])
            if c["nodes_up"] == 3 and len(leaders) == 3 and None not in leaders:
                break
            assert time.monotonic() < deadline, c
            time.sleep(0.1)

        open_console(browser, node)
        assert errors(browser) == []
        wait_text(browser, "dd[data-field=nodes_up]", "3")
        # The nodes, each up, at its KV address.
        assert [n["name"] for n in c["nodes"]] == ["n1", "n2", "n3"]
        for n in c["nodes"]:
            row = f"#cluster-nodes tr[data-node={n['name']}]"
            assert text(browser, f"{row} td[data-field=up]") == "up"
            assert text(browser, f"{row} td[data-field=failed_over]") == "no"
            assert n["kv_address"] == nodes[n["name"]].address, n
            assert text(browser, f"{row} td[data-field=kv_address]") == n["kv_address"]
        # The vbucket grid: one cell per vbucket, coloured by (and naming) its active, its chain
        # on hover.
        grid = browser.execute_script(GRID_ACTIVES)
        assert len(grid) == len(c["vbuckets"]) == 16
        assert [a for a, _ in grid] == [chain[0] for chain in c["vbuckets"]]
        assert [ch for _, ch in grid] == [",".join(x or "" for x in chain) for chain in c["vbuckets"]]
        first = browser.find_element(By.CSS_SELECTOR, "#cluster-vbuckets .vb[data-vbucket='0']")
        assert f"active: {c['vbuckets'][0][0]}" in first.get_attribute("title")
        assert f"replicas: {c['vbuckets'][0][1]}" in first.get_attribute("title")
        # The topic's partitions, each with its leader.
        for p, leader in enumerate(c["topics"]["placed"]):
            row = f"#cluster-topic-table tr[data-topic=placed][data-partition='{p}']"
            assert text(browser, f"{row} td[data-field=leader]") == leader

        # Start rebalance: refused signed out (401) and as a user lacking admin (403), asked for
        # as an admin (202).
        code, shown = act(browser, "rebalance", "rebalance-result")
        assert code == 401 and shown.startswith("refused (401"), shown
        sign_in(browser, "app", PASSWORD)
        code, shown = act(browser, "rebalance", "rebalance-result")
        assert code == 403 and shown.startswith("refused (403"), shown
        sign_in(browser, "ops", PASSWORD)
        code, shown = act(browser, "rebalance", "rebalance-result")
        assert code == 202 and shown.startswith("done (202") and '"rebalance"' in shown, shown
        assert errors(browser, allowed=REFUSALS) == []
    finally:
        stop_all(nodes)
        etcd.close()
