"""README.md's examples run as pasted, and the documentation's links lead somewhere.

An example is runnable when the line before its fence is a marker:

    <!-- runnable: LANGUAGE [TAG ...] -->

LANGUAGE is the fence's (`python`, `sh`, `toml`). TAGS say what the example needs:

- `node-config`: a TOML block that belongs in the configuration of the node the examples run
  against (the README tells its reader to start the node with it);
- `starts-replica`: the command that starts a replica of that node; it is run in the
  background, and its other fronts must take the ports the second-node rule gives them;
- `needs-replica`: run once that replica follows every vbucket;
- `needs-tank-cli`: TANK's own `tank-cli` (on PATH, or in TANK_DIR, a build of TANK's source);
- `needs-spark`: pyspark and Java;
- `tls-config`: the `[tls]` lines that use the files `sluice tls init` wrote; a node started
  with them serves TLS that `sluice.Client` checks against the CA.

The examples name the default addresses (127.0.0.1:11210 and the other fronts' ports); the test
rewrites them to a node of its own on free ports, since the defaults may be taken (a node the
reader runs, another test), and runs each example in a shared working directory. An example
that names no address would reach a default port: it fails here instead.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sluice
from helpers import Node, Watched, free_port, listen_port_with_free_fronts, start_node

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 500

MARKER = re.compile(r"^<!-- runnable: (\w+)((?: [\w-]+)*) -->$")
TAGS = {"node-config", "tls-config", "starts-replica", "needs-replica", "needs-tank-cli", "needs-spark"}

# The ports the README's examples name: the first node's, at the defaults, and the replica's,
# whose unset fronts sit at the defaults plus (11310 - 11210).
NODE_PORTS = {"listen": 11210, "iproto": 3301, "tank": 11011, "greenstack": 11220, "admin": 11280}
REPLICA_LISTEN, REPLICA_ADMIN = 11310, 11380
FRONT_DEFAULTS = {"iproto": 3301, "tank": 11011, "greenstack": 11220}
# Ports an example may name only in a form the rewrite understands.
NAMED_PORTS = {*NODE_PORTS.values(), 11207, REPLICA_LISTEN, REPLICA_ADMIN}
NAMED_PORTS |= {p + REPLICA_LISTEN - 11210 for p in FRONT_DEFAULTS.values()}

# "127.0.0.1:PORT", and "127.0.0.1", PORT as socket and tarantool-python addresses take it.
ADDRESS = re.compile(r"""(127\.0\.0\.1["']?(?:,\s*(?:port=)?|:))(\d+)(?!\d)""")
# Commands that reach a server, and the address flag each must be given.
REACHES_A_SERVER = re.compile(
    r"^\s*(sluice (serve|tail|status|promote|move-vbucket|topic|bench|cluster)|tank-cli)\b"
)


@dataclasses.dataclass(frozen=True)
class Example:
    line: int  # of the fence, 1-based
    section: str  # the heading it is under
    language: str
    tags: frozenset[str]
    text: str

    @property
    def id(self) -> str:
        return f"L{self.line}-{re.sub(r'[^A-Za-z0-9]+', '_', self.section).strip('_')}-{self.language}"


def readme_examples() -> list[Example]:
    lines = README.read_text().splitlines()
    examples = []
    section = ""
    for i, line in enumerate(lines):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        m = MARKER.match(line)
        if not m:
            continue
        language, tags = m.group(1), frozenset(m.group(2).split())
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence == f"```{language}", f"README.md:{i + 1}: the marker is not followed by ```{language}"
        assert tags <= TAGS, f"README.md:{i + 1}: unknown tags {sorted(tags - TAGS)}"
        end = next(j for j in range(i + 2, len(lines)) if lines[j] == "```")
        examples.append(Example(i + 2, section, language, tags, "\n".join(lines[i + 2 : end]) + "\n"))
    return examples


EXAMPLES = readme_examples()
RUN = [e for e in EXAMPLES if e.language != "toml" and "starts-replica" not in e.tags]
TLS_INIT = [e for e in RUN if "sluice tls init" in e.text]


def rewrite(text: str, ports: dict[int, int]) -> str:
    """`text` with every default port it names replaced by the test's port."""
    out = ADDRESS.sub(lambda m: m.group(1) + str(ports.get(int(m.group(2)), m.group(2))), text)
    left = sorted({int(p) for p in re.findall(r"(?<![\d.])(\d{4,5})(?![\d.])", out)} & NAMED_PORTS)
    assert not left, f"the example names default ports in a form the test cannot rewrite: {left}\n{text}"
    for line in out.splitlines():
        if REACHES_A_SERVER.match(line):
            assert "127.0.0.1:" in line, (
                f"this command names no address, so it would reach a default port: {line}"
            )
    return out


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the examples run, as a reader's shell would: the files they write land here."""
    return tmp_path_factory.mktemp("readme-work")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    """The node the examples run against: the embedded defaults' 64 vbuckets, with the README's
    node-config blocks."""
    config = "\n".join(e.text for e in EXAMPLES if "node-config" in e.tags)
    n = start_node(tmp_path_factory.mktemp("readme-node"), "node", extra=config, num_vbuckets=64)
    yield n
    assert n.stop() == 0, n.log()[-2000:]


@pytest.fixture(scope="module")
def ports(node: Node) -> dict[int, int]:
    """Each default port the examples name, as the test node's real port."""
    real = {"listen": node.address, "iproto": node.iproto, "tank": node.tank}
    real |= {"greenstack": node.greenstack, "admin": node.admin}
    return {NODE_PORTS[k]: port_of(v) for k, v in real.items()}


class Background(Watched):
    """A command started from an example (`sluice serve ...`) in a process group of its own;
    its stderr is read on a thread so that waits are bounded."""

    what = "the command"

    def __init__(self, command: str, cwd: Path) -> None:
        self._watch(
            subprocess.Popen(
                ["bash", "-c", f"exec {command.strip()}"],
                cwd=cwd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise


@pytest.fixture(scope="module")
def replica(node: Node, ports: dict[int, int], workdir: Path):
    """The README's replica, started by its own command with the test's ports, once it follows
    every vbucket of the first node's default bucket."""
    (start,) = [e for e in EXAMPLES if "starts-replica" in e.tags]
    listen, admin = listen_port_with_free_fronts(), free_port()
    delta = listen - 11210
    mapping = dict(ports)
    mapping |= {REPLICA_LISTEN: listen, REPLICA_ADMIN: admin}
    mapping |= {p + REPLICA_LISTEN - 11210: p + delta for p in FRONT_DEFAULTS.values()}
    command = rewrite(start.text, mapping).replace("\\\n", " ")
    proc = Background(command, workdir)
    try:
        ready = proc.wait_for("sluice ready")
        # A second node needs only --listen, --admin-listen and --data-dir: its other fronts
        # listen beside it, at their default ports plus (its port - 11210).
        for title, default in (("iproto", 3301), ("TANK", 11011), ("Greenstack", 11220)):
            assert f"({title} 127.0.0.1:{default + delta})" in ready, ready
        deadline = time.monotonic() + 30
        while True:
            bucket = next(b for b in node.status()["buckets"] if b["name"] == "default")
            if all(v["followers"] for v in bucket["vbuckets"]):
                break
            assert time.monotonic() < deadline, "the replica does not follow every vbucket"
            time.sleep(0.1)
        yield mapping
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-2000:]


def tank_cli_dir() -> str | None:
    """Where tank-cli is: TANK_DIR's build, else PATH."""
    tank_dir = os.environ.get("TANK_DIR")
    if tank_dir and (Path(tank_dir) / "tank-cli").exists():
        return tank_dir
    found = shutil.which("tank-cli")
    return str(Path(found).parent) if found else None


def missing_modules(code: str) -> list[str]:
    names = set()
    for n in ast.walk(ast.parse(code)):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names.add(n.module.split(".")[0])
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


@pytest.mark.parametrize("example", RUN, ids=[e.id for e in RUN])
def test_readme_example_runs_as_pasted(example: Example, request: pytest.FixtureRequest, workdir: Path):
    env = dict(os.environ)
    timeout = 60
    if "needs-tank-cli" in example.tags:
        where = tank_cli_dir()
        if where is None:
            pytest.skip("tank-cli is not installed (set TANK_DIR to a build of TANK's source)")
        env["PATH"] = where + os.pathsep + env["PATH"]
    if "needs-spark" in example.tags:
        if importlib.util.find_spec("pyspark") is None or shutil.which("java") is None:
            pytest.skip("Spark needs pyspark (the spark extra) and Java")
        timeout = 300
    if example.language == "python" and (missing := missing_modules(example.text)):
        pytest.skip(f"needs the Python packages {', '.join(missing)}")
    ports = request.getfixturevalue("replica" if "needs-replica" in example.tags else "ports")
    code = rewrite(example.text, ports)
    if example.language == "python":
        cmd = [sys.executable, "-c", code]
    else:
        assert example.language == "sh", example.language
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"README.md:{example.line} failed:\n{code}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), f"README.md:{example.line} printed nothing:\n{code}\n{r.stderr}"


def test_the_certificate_tls_init_makes_serves_tls(tmp_path: Path):
    """The README's `sluice tls init` and the `[tls]` lines beside it make a node that serves
    TLS, which a client given the CA (and nothing else) verifies."""
    (init,) = TLS_INIT
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", init.text], cwd=tmp_path, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    tls = tmp_path / "tls"
    for name in ("ca.pem", "ca-key.pem", "node.pem", "node-key.pem"):
        assert (tls / name).is_file(), f"sluice tls init wrote no {name}: {r.stdout}"
    assert "[tls]" in r.stdout and "node.pem" in r.stdout, r.stdout
    (lines,) = [e.text for e in EXAMPLES if "tls-config" in e.tags]
    config = tmp_path / "tls.toml"
    config.write_text('tls_listen = "127.0.0.1:0"\n' + lines.replace('"tls/', f'"{tls}/'))
    node = Node(tmp_path / "data", "--config", str(config))
    try:
        (address,) = re.findall(r"\(TLS (127\.0\.0\.1:\d+)\)", "".join(node.lines))
        with sluice.Client(address, cafile=str(tls / "ca.pem")) as client:
            client.set(b"over-tls", b"yes")
            assert client.get(b"over-tls").value == b"yes"
    finally:
        assert node.stop() == 0, node.log()[-2000:]


def test_the_readme_has_runnable_examples_of_every_protocol():
    text = "\n".join(e.text for e in RUN)
    for what in ("couchbase", "bmemcached", "pymemcache", "tarantool", "TankConnection", "tank-cli"):
        assert what in text, what
    for what in ("AsyncClient", "client.stream", "sluice tail", "TAP_CONNECT", "pyspark", "durability="):
        assert what in text, what
    assert [e for e in EXAMPLES if "starts-replica" in e.tags], "no example starts the replica"


def test_the_readme_is_a_guide_of_under_500_lines():
    n = len(README.read_text().splitlines())
    assert n < MAX_README_LINES, f"README.md has {n} lines; move detail to docs/"


def test_the_readmes_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    (expected,) = re.findall(r'^cmd="(.*)"$', ci, re.M)
    text = README.read_text()
    block = text.split("<!-- test-command -->\n```sh\n", 1)[1].split("\n```", 1)[0]
    assert block == expected


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings."""
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not (m := re.match(r"^#{1,6} (.*)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: " + ", ".join(broken)


def test_config_blocks_are_valid_for_serve(tmp_path: Path):
    """The node-config blocks pass `sluice config check` as the reader's sluice.toml."""
    config = tmp_path / "sluice.toml"
    config.write_text("\n".join(e.text for e in EXAMPLES if "node-config" in e.tags))
    r = subprocess.run(
        [sys.executable, "-m", "sluice", "config", "check", str(config)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
