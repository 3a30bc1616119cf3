"""A cluster of `sluice serve` nodes on a real etcd (Debian's etcd-server, on free ports): the
map formed and balanced, every key reachable through any node with Couchbase's SDK (map-aware),
replica reads, a node killed with kill -9 failed over automatically and taken back when it
returns, rebalance under a steady writer, and nodes that keep serving while etcd is gone. The
map computation itself is checked on its own first."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sluice
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.options import UpsertOptions
from couchbase_sdk import KV_TIMEOUT, sdk_cluster
from fault_proxy import FaultProxy
from helpers import NUM_VBUCKETS, run_cli, start_node
from mcbp_wire import GET, connect, login, read_response, request
from sluice.cluster import vbmap
from sluice.cluster.etcd import Etcd, EtcdError, parse_cluster_url
from sluice.greenstack import GreenstackClient
from test_couchbase_sdk_kv import USERS, SteadyWriter, replica_login
from test_permissions import PASSWORD
from test_replication import majority_set

DURABILITY_IMPOSSIBLE, SYNC_WRITE_AMBIGUOUS, NOT_MY_VBUCKET = 0xA1, 0xA3, 0x07

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd-server is not installed")


# -- the map on its own


def test_a_balanced_map_spreads_actives_and_replicas_evenly_and_moves_little():
    nodes = ["a", "b", "c"]
    m = vbmap.balance(nodes, 64, 1)
    counts = vbmap.summary(m)
    assert sorted(a for a, _ in counts.values()) == [21, 21, 22]
    assert sorted(r for _, r in counts.values()) == [21, 21, 22]
    assert all(len(c) == 2 and c[0] != c[1] and None not in c for c in m)
    # A fourth node: a quarter of the actives move to it, the rest stay where they are.
    m2 = vbmap.balance([*nodes, "d"], 64, 1, current=m)
    counts = vbmap.summary(m2)
    assert {a for a, _ in counts.values()} == {16} and {r for _, r in counts.values()} == {16}
    moved = sum(1 for x, y in zip(m, m2, strict=True) if x[0] != y[0])
    assert moved == 16
    # Two replicas on four nodes in two groups: no vbucket keeps all its copies in one group.
    groups = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    m3 = vbmap.balance(["a", "b", "c", "d"], 64, 2, groups=groups)
    assert all(len({groups[x] for x in c}) == 2 and len(set(c)) == 3 for c in m3)
    counts = vbmap.summary(m3)
    assert max(r for _, r in counts.values()) - min(r for _, r in counts.values()) <= 1
    # More replicas than other nodes: the slots no node can fill stay empty.
    assert vbmap.balance(["a"], 4, 2) == [["a", None, None]] * 4


def test_failover_promotes_the_most_advanced_replica_and_a_returning_node_is_taken_back():
    chains = [["a", "b", "c"], ["b", "a", "c"], ["a", None, None], ["c", "b", "a"]]
    seqnos = {"b": {0: 10}, "c": {0: 12}}
    out, lost = vbmap.fail_over(chains, "a", seqnos, {"b", "c"})
    assert out == [["c", "b", None], ["b", None, "c"], [None, None, None], ["c", "b", None]]
    assert lost == [2]
    back = vbmap.take_back(out, "a", vbmap.held_by(chains, "a"))
    # A replica again where it held a copy, and the active again where nobody could take over.
    assert back == [["c", "b", "a"], ["b", "a", "c"], ["a", None, None], ["c", "b", "a"]]


# -- etcd and nodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """An etcd of `members` members on free ports, each in its own data directory."""

    def __init__(self, data_dir: Path, members: int = 1) -> None:
        self.data_dir = data_dir
        self.clients = [free_port() for _ in range(members)]
        self.peers = [free_port() for _ in range(members)]
        self.url = "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.clients) + "/c1"
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.logs = [open(data_dir.with_name(f"{data_dir.name}{i}.log"), "a") for i in range(members)]  # noqa: SIM115
        for i in range(members):
            self.start_member(i)
        self.wait_ready()

    def start_member(self, i: int) -> None:
        initial = ",".join(f"e{k}=http://127.0.0.1:{p}" for k, p in enumerate(self.peers))
        self.procs[i] = subprocess.Popen(
            [
                "etcd",
                "--name",
                f"e{i}",
                "--data-dir",
                str(self.data_dir.with_name(f"{self.data_dir.name}{i}")),
                "--listen-client-urls",
                f"http://127.0.0.1:{self.clients[i]}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{self.clients[i]}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.peers[i]}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.peers[i]}",
                "--initial-cluster",
                initial,
            ],
            stdout=self.logs[i],
            stderr=self.logs[i],
        )

    def wait_ready(self) -> None:
        etcd = self.api()
        deadline = time.monotonic() + 30
        while True:
            try:
                etcd.put("/ping", "1")
                return
            except Exception:
                assert time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.1)

    def start(self) -> None:
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is not None:
                self.start_member(i)
        self.wait_ready()

    def api(self) -> Etcd:
        return Etcd(parse_cluster_url(self.url)[0])

    def kill_member(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(timeout=30)

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill_member(i)

    def close(self) -> None:
        self.stop()
        for log in self.logs:
            log.close()


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd")
    yield server
    server.close()


def cluster_node(
    tmp_path,
    etcd: EtcdServer,
    name: str,
    timeout: float = 2.0,
    vbuckets: int = NUM_VBUCKETS,
    url: str | None = None,
    listen: str | None = None,
    advertise: str | None = None,
    config: str = "",
):
    """A node of the cluster; `url` reaches etcd some other way, `advertise` is where the
    others reach this node (both through a fault proxy); `config` is more of its config."""
    extra = (
        USERS
        + config
        + replica_login(tmp_path)
        + f'[cluster]\netcd = "{url or etcd.url}"\nnode_name = "{name}"\n'
        + f"auto_failover_timeout = {timeout}\n"
        + (f'advertise = "{advertise}"\n' if advertise else "")
    )
    args = ("--listen", listen) if listen else ()
    return start_node(tmp_path, name, *args, extra=extra, num_vbuckets=vbuckets)


def cli(etcd: EtcdServer, *args: str, timeout: float = 120) -> str:
    try:
        r = run_cli("cluster", *args, "--cluster", etcd.url, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # What it printed, and where the cluster stood: what a stuck command waits for.
        out = e.stdout or b""
        printed = out.decode(errors="replace") if isinstance(out, bytes) else out
        m = cluster_map(etcd) or {}
        raise AssertionError(
            f"sluice cluster {' '.join(args)} ran over {timeout} s; it printed:\n{printed}\n"
            f"rebalance: {rebalance_state(etcd)}\ntopics: {m.get('topics')}"
        ) from None
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def cluster_map(etcd: EtcdServer) -> dict | None:
    """The map as etcd holds it (None before the cluster forms)."""
    kv = etcd.api().get("/sluice/c1/map")
    return kv.json() if kv else None


def wait_map(etcd: EtcdServer, check, timeout: float = 60) -> dict:
    """The map once `check` holds; etcd may be unreachable a while (its members electing)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            m = cluster_map(etcd)
        except EtcdError:
            m = None
        if m is not None and check(m):
            return m
        assert time.monotonic() < deadline, f"the map never matched: {m}"
        time.sleep(0.1)


def form(
    tmp_path,
    etcd: EtcdServer,
    names: list[str],
    timeout: float = 2.0,
    vbuckets: int = NUM_VBUCKETS,
    config: str = "",
) -> dict:
    """Starts the nodes (`config`: more of each one's config), the first forming the cluster,
    adds the others and rebalances."""
    nodes = {}
    for n in names:
        nodes[n] = cluster_node(tmp_path, etcd, n, timeout, vbuckets, config=config)
        if n == names[0]:
            wait_map(etcd, lambda m: True)
    wait_registered(etcd, names)
    cli(etcd, "add", *names[1:])
    out = cli(etcd, "rebalance")
    assert "done" in out and "100%" in out, out
    # A rebalance ends once every replica streams from its active: majority writes can count
    # on them at once.
    assert_followed(etcd, nodes)
    return nodes


def assert_followed(etcd: EtcdServer, nodes: dict) -> None:
    """Every vbucket's active sees each replica of its chain follow it (what majority writes
    count)."""
    m = cluster_map(etcd)
    statuses = {n: node.status()["buckets"][0]["vbuckets"] for n, node in nodes.items() if n in m["nodes"]}
    short = [
        vb
        for vb, chain in enumerate(m["chains"])
        if chain[0] in statuses
        and not {nodes[r].address for r in chain[1:] if r is not None}
        <= {f["kv_address"] for f in statuses[chain[0]][vb]["followers"]}
    ]
    assert not short, f"vbuckets {short} lack a follower"


def wait_replicated(etcd: EtcdServer, nodes: dict, timeout: float = 30) -> None:
    """Until every replica holds what its active holds, in every bucket (as the nodes' admin
    endpoints say): writes without durability reach replicas a moment after they are
    acknowledged, and a failover keeps only what its replica got."""
    m = cluster_map(etcd)
    deadline = time.monotonic() + timeout
    while True:
        highs = {
            n: {b["name"]: [v["high_seqno"] for v in b["vbuckets"]] for b in node.status()["buckets"]}
            for n, node in nodes.items()
            if n in m["nodes"] and n not in m["failed"]
        }
        behind = [
            (bucket, vb, replica, highs[replica][bucket][vb], high)
            for vb, chain in enumerate(m["chains"])
            if chain[0] in highs
            for bucket, marks in highs[chain[0]].items()
            if (high := marks[vb])
            for replica in chain[1:]
            if replica in highs and highs[replica][bucket][vb] < high
        ]
        if not behind:
            return
        assert time.monotonic() < deadline, f"behind (bucket, vbucket, replica, has, active): {behind[:10]}"
        time.sleep(0.1)


def wait_registered(etcd: EtcdServer, names: list[str]) -> None:
    api = etcd.api()
    deadline = time.monotonic() + 30
    while {kv.key.rsplit("/", 1)[1] for kv in api.get_prefix("/sluice/c1/nodes/")[0]} < set(names):
        assert time.monotonic() < deadline, "nodes never registered"
        time.sleep(0.1)


def stop_all(nodes) -> None:
    for n in nodes.values():
        n.stop()


@contextlib.contextmanager
def collection(node):
    """The default collection through Couchbase's SDK bootstrapped from `node`, as the app user."""
    sdk = sdk_cluster(node, "app", PASSWORD)
    try:
        yield sdk.bucket("default").default_collection()
    finally:
        sdk.close()


class Tail:
    """`sluice tail` of the bucket from `node`, from the beginning, as JSON lines: the last
    value it printed for each key (what a consumer of the stream holds)."""

    def __init__(self, node) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "tail", "--address", node.address, "--from", "beginning"]
            + ["--user", "repl", "--password-stdin"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.proc.stdin.write(PASSWORD + "\n")
        self.proc.stdin.close()
        self.values: dict[str, dict] = {}
        self.vbuckets: set[int] = set()
        self.reader = threading.Thread(target=self.read)
        self.reader.start()

    def read(self) -> None:
        for line in self.proc.stdout:
            row = json.loads(line)
            self.vbuckets.add(row["vbucket"])
            if row["op"] == "mutation":
                self.values[row["key"]] = json.loads(row["value"])
            else:
                self.values.pop(row["key"], None)

    def wait_for(self, writer: SteadyWriter, timeout: float = 30) -> None:
        """Until the tail shows every write the writer had acknowledged (and no later one)."""
        want = {k: {"i": i} for k, i in writer.acked.items() if k not in writer.ambiguous}
        deadline = time.monotonic() + timeout
        while True:
            missing = {k: (v, self.values.get(k)) for k, v in want.items() if self.values.get(k) != v}
            if not missing:
                return
            assert self.proc.poll() is None, self.stop()
            assert time.monotonic() < deadline, (len(missing), list(missing.items())[:5], self.stop())
            time.sleep(0.2)

    def stop(self) -> str:
        """Stops it; returns what it said on stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.reader.join(10)
        return self.proc.stderr.read()


class StartupProbe:
    """Connects to a port again and again until a node answers there, then asks for a key of
    `vbucket` on every connection: the statuses it got, from the first answer on."""

    def __init__(self, port: int, key: bytes, vbucket: int) -> None:
        self.port, self.key, self.vbucket = port, key, vbucket
        self.answers: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)
        self.thread.start()

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while not self.stop.is_set() and time.monotonic() < deadline and len(self.answers) < 1000:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                    if login(s, "app", PASSWORD) != 0:
                        continue
                    s.sendall(request(GET, self.key, vbucket=self.vbucket))
                    self.answers.append(read_response(s)["status"])
            except OSError:
                time.sleep(0.001)

    def finish(self) -> list[int]:
        """Once the node is ready: after one more answer."""
        seen = len(self.answers)
        deadline = time.monotonic() + 10
        while len(self.answers) <= seen and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.stop.set()
        self.thread.join(30)
        return self.answers


def after_kv(nodes: dict, m: dict, vb: int) -> str:
    """The KV address of `vb`'s active in map `m`, as nodes' configs list it."""
    return nodes[m["chains"][vb][0]].address


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


def vbucket_states(node) -> dict[int, str]:
    return {v["vbucket"]: v["state"] for v in node.status()["buckets"][0]["vbuckets"]}


def wait_serving_map(nodes: dict, m: dict, timeout: float = 30) -> None:
    """Every vbucket active on the node the map `m` names for it."""
    deadline = time.monotonic() + timeout
    while True:
        states = {name: vbucket_states(nodes[name]) for name in {c[0] for c in m["chains"]}}
        behind = [vb for vb, c in enumerate(m["chains"]) if states[c[0]][vb] != "active"]
        if not behind:
            return
        assert time.monotonic() < deadline, f"vbuckets {behind} never became active where the map says"
        time.sleep(0.05)


def test_a_cluster_forms_balanced_and_any_node_serves_every_key(tmp_path, etcd, monkeypatch):
    nodes = form(tmp_path, etcd, ["n1", "n2", "n3"])
    try:
        m = json.loads(cli(etcd, "map", "--json"))
        assert m["revision"] > 0
        counts = vbmap.summary(m["chains"])
        assert sorted(counts) == ["n1", "n2", "n3"]
        assert {a for a, _ in counts.values()} <= {5, 6} and {r for _, r in counts.values()} <= {5, 6}
        assert all(len(c) == 2 and c[0] != c[1] and None not in c for c in m["chains"])
        # Each node is active exactly for the vbuckets the map gives it, replica for its
        # replica vbuckets, dead for the rest.
        for name, node in nodes.items():
            states = vbucket_states(node)
            for vb, chain in enumerate(m["chains"]):
                want = "active" if chain[0] == name else "replica" if name in chain else "dead"
                assert states[vb] == want, (name, vb, states[vb], chain)
        status = cli(etcd, "status")
        assert "balance: actives per node 5-6, replicas per node 5-6" in status
        assert "0 vbucket(s) short of a replica" in status
        # Each node's /status, /metrics and `sluice status` say what it sees of the cluster.
        deadline = time.monotonic() + 10
        while (seen := nodes["n2"].status()["cluster"])["map_revision"] != m["revision"]:
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
        assert seen["nodes_up"] == 3 and seen["orchestrator"] == "n1" and seen["failed_over"] == 0
        assert nodes["n1"].metric("sluice_cluster_orchestrator") == 1
        assert nodes["n2"].metric("sluice_cluster_orchestrator") == 0
        assert nodes["n2"].metric("sluice_cluster_map_revision") == m["revision"]
        assert nodes["n2"].metric("sluice_cluster_rebalance_progress") == 1
        monkeypatch.setenv("SLUICE_PASSWORD", PASSWORD)  # the operator's, for the CLI
        shown = run_cli("status", "--admin", nodes["n2"].admin, "--user", "ops")
        assert f"cluster c1 as n2: map rev {m['revision']}, 3 node(s) up" in shown.stdout, shown.stdout
        assert "role: replica of the vbuckets the cluster map gives it" in shown.stdout

        # Writes at majority through the SDK bootstrapped from n1 (each waits for its vbucket's
        # replica, on whichever node the map puts it); reads through SDKs bootstrapped from
        # the others, and replica reads, see them all.
        with collection(nodes["n1"]) as coll:
            majority = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
            for i in range(200):
                coll.upsert(f"k{i}", {"i": i}, majority)
        for name in ("n2", "n3"):
            with collection(nodes[name]) as coll:
                for i in range(200):
                    assert coll.get(f"k{i}").content_as[dict] == {"i": i}
                    replica = coll.get_any_replica(f"k{i}")
                    assert replica.content_as[dict] == {"i": i}
        # Every node holds exactly its share: the items of its active and replica vbuckets.
        total = sum(v["items"] for n in nodes.values() for v in n.status()["buckets"][0]["vbuckets"])
        assert total == 400
    finally:
        stop_all(nodes)


def test_a_refused_etcd_login_is_an_error_naming_it(etcd):
    """With auth on, a wrong password is refused once (no login retried over and over), the
    right one logs in."""
    api = etcd.api()
    api.call("/v3/auth/user/add", {"name": "root", "password": "right"})
    api.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    api.call("/v3/auth/enable", {})
    endpoints = parse_cluster_url(etcd.url)[0]
    with pytest.raises(EtcdError, match="authentication failed"):
        Etcd(endpoints, username="root", password="wrong").get("/sluice/x")
    ok = Etcd(endpoints, username="root", password="right")
    ok.put("/sluice/x", "1")
    assert ok.get("/sluice/x").value == b"1"


def test_a_killed_node_is_failed_over_in_time_without_losing_majority_writes_and_rejoins(tmp_path, etcd):
    timeout = 2.0
    nodes = form(tmp_path, etcd, ["n1", "n2", "n3"], timeout=timeout)
    tail = None
    try:
        with collection(nodes["n1"]) as coll:
            writer = SteadyWriter(coll, DurabilityLevel.MAJORITY)
            # `sluice tail` from n1 streams every vbucket from its active, n3's too.
            tail = Tail(nodes["n1"])
            # A Greenstack client on n2 hears the failover as a map change.
            notices = []
            greenstack = GreenstackClient(
                nodes["n2"].greenstack, username="app", password=PASSWORD, on_notice=notices.append
            )
            time.sleep(1.5)
            before = cluster_map(etcd)
            lost_actives = [vb for vb, c in enumerate(before["chains"]) if c[0] == "n3"]
            writer.outage_from = time.monotonic()
            killed = time.monotonic()
            nodes["n3"].stop(sig=9)
            # With one replica, a vbucket whose replica was on n3 cannot reach a majority until
            # n3 is back: the writer goes on at level none, as an application would.
            writer.level = None
            after = wait_map(etcd, lambda m: "n3" in m["failed"], timeout=30)
            took = time.monotonic() - killed
            # The lease runs out within its 2 s TTL, then the timeout; a margin for this machine.
            assert took < timeout + 2 + 3, took
            for vb in lost_actives:
                assert after["chains"][vb][0] in ("n1", "n2") and "n3" not in after["chains"][vb]
            assert after["auto_failovers"] == 1
            deadline = time.monotonic() + 10
            while True:
                configs = [json.loads(n.fields["config"]) for n in notices if n.kind == "map_changed"]
                heard = configs[-1]["vBucketServerMap"] if configs else None
                servers = heard["serverList"] if heard else []
                if heard and all(
                    port_of(servers[heard["vBucketMap"][vb][0]]) == port_of(after_kv(nodes, after, vb))
                    for vb in lost_actives
                ):
                    break
                assert time.monotonic() < deadline, (heard, after["chains"])
                time.sleep(0.05)
            greenstack.close()
            writer.outage_until = time.monotonic() + 5  # the SDK's next map poll
            time.sleep(6)
            writer.finish()
            writer.check(coll)
            # Writes resumed on the promoted actives once the map changed. The one write that
            # may wait longer is the SDK's own: one it queued on its reconnecting session to the
            # dead node is not sent elsewhere when the new map drops that session, and waits out
            # its kv timeout (the SDK's threshold log: never dispatched).
            stall = writer.longest_stall(killed)
            assert stall <= max(took + 1, KV_TIMEOUT + 1), (stall, took, writer.since(killed))
            # The tail went on streaming n3's vbuckets from their promoted replicas.
            tail.wait_for(writer)
            assert tail.vbuckets == set(range(NUM_VBUCKETS))
            said = tail.stop()
            assert "moved" in said or "cluster map" in said, said
            # Writes go on to the vbuckets n3 was active for, on their new actives.
            promoted = {vb: after["chains"][vb][0] for vb in lost_actives}
            for vb, name in promoted.items():
                assert vbucket_states(nodes[name])[vb] == "active"

            # n3 comes back: a replica again of what it held, caught up with the new actives.
            # Its files say it is active for them, but no client that connects as it starts
            # gets an answer from them: it takes clients once it has converged on the map.
            port = free_port()
            vb = lost_actives[0]
            key = next(k for i in range(9999) if sluice.vbucket_of(k := f"k{i}".encode(), NUM_VBUCKETS) == vb)
            probe = StartupProbe(port, key, vb)
            nodes["n3"] = cluster_node(tmp_path, etcd, "n3", timeout, listen=f"127.0.0.1:{port}")
            answers = probe.finish()
            assert answers and set(answers) == {NOT_MY_VBUCKET}, answers
            back = wait_map(etcd, lambda m: "n3" not in m["failed"])
            held = vbmap.held_by(before["chains"], "n3")
            assert all("n3" in back["chains"][vb][1:] for vb in held)
            deadline = time.monotonic() + 60
            while True:
                states = vbucket_states(nodes["n3"])
                mine = {vb: s for vb, s in states.items() if vb in held}
                highs = {
                    v["vbucket"]: v["high_seqno"] for v in nodes["n3"].status()["buckets"][0]["vbuckets"]
                }
                actives = {}
                for vb in held:
                    owner = nodes[back["chains"][vb][0]]
                    actives[vb] = next(
                        v["high_seqno"]
                        for v in owner.status()["buckets"][0]["vbuckets"]
                        if v["vbucket"] == vb
                    )
                if set(mine.values()) == {"replica"} and all(highs[vb] == actives[vb] for vb in held):
                    break
                assert time.monotonic() < deadline, (mine, highs, actives)
                time.sleep(0.2)
            # It resumed from what it holds (its actives back to where their promoted replicas
            # took over), not from a copy from zero.
            for name in ("n1", "n2"):
                log = nodes[name].log()
                assert "rollback to 0" not in log, [line for line in log.splitlines() if "rollback" in line]
    finally:
        if tail is not None:
            tail.stop()
        stop_all(nodes)


def test_rebalance_adds_and_removes_nodes_under_a_steady_writer(tmp_path, etcd):
    nodes = form(tmp_path, etcd, ["n1", "n2"])
    tail = None
    try:
        with collection(nodes["n1"]) as coll:
            writer = SteadyWriter(coll)
            # A tail started on n1, which the rebalance empties: its vbuckets move under it.
            tail = Tail(nodes["n1"])
            time.sleep(1.0)
            nodes["n3"] = cluster_node(tmp_path, etcd, "n3")
            wait_registered(etcd, ["n3"])
            cli(etcd, "add", "n3")
            out = cli(etcd, "rebalance")
            assert "writes paused per vbucket" in out, out
            m = cluster_map(etcd)
            assert {a for a, _ in vbmap.summary(m["chains"]).values()} <= {5, 6}
            cli(etcd, "remove", "n1")
            cli(etcd, "rebalance")
            m = cluster_map(etcd)
            assert "n1" not in m["nodes"] and all("n1" not in c for c in m["chains"])
            assert {a for a, _ in vbmap.summary(m["chains"]).values()} == {NUM_VBUCKETS // 2}
            time.sleep(3.0)  # past the SDK's map polls
            writer.finish()
            writer.check(coll)
            assert set(vbucket_states(nodes["n1"]).values()) == {"dead"}
            tail.wait_for(writer)
    finally:
        if tail is not None:
            tail.stop()
        stop_all(nodes)


def rebalance_state(etcd: EtcdServer) -> dict:
    kv = etcd.api().get("/sluice/c1/rebalance")
    return kv.json() if kv else {}


def start_rebalance_adding(etcd: EtcdServer, name: str, moves_done: int) -> None:
    """Adds registered node `name` and starts a rebalance without waiting for it; returns once
    the new rebalance has made `moves_done` moves."""
    cli(etcd, "add", name)
    formed = rebalance_state(etcd)["started"]
    cli(etcd, "rebalance", "--no-wait")
    deadline = time.monotonic() + 60
    while rebalance_state(etcd)["started"] == formed or rebalance_state(etcd)["done"] < moves_done:
        assert time.monotonic() < deadline, rebalance_state(etcd)
        time.sleep(0.02)


def test_a_new_orchestrator_finishes_the_rebalance_its_killed_predecessor_began(tmp_path, etcd):
    # Enough vbuckets that the rebalance is still moving them when its orchestrator dies.
    vbuckets = 256
    nodes = form(tmp_path, etcd, ["n1", "n2"], vbuckets=vbuckets)
    try:
        with collection(nodes["n2"]) as coll:
            majority = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
            for i in range(300):
                coll.upsert(f"k{i}", {"i": i}, majority)
        nodes["n3"] = cluster_node(tmp_path, etcd, "n3", vbuckets=vbuckets)
        wait_registered(etcd, ["n3"])
        assert etcd.api().get("/sluice/c1/orchestrator").value == b"n1"
        start_rebalance_adding(etcd, "n3", moves_done=5)
        nodes["n1"].stop(sig=9)
        deadline = time.monotonic() + 120
        # One read per turn: the rebalance may finish between two reads.
        while (state := rebalance_state(etcd)).get("state") != "done":
            assert state.get("state") == "running", state
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert etcd.api().get("/sluice/c1/orchestrator").value in (b"n2", b"n3")
        m = cluster_map(etcd)
        assert "n1" in m["failed"]
        assert all(c[0] in ("n2", "n3") and set(c) == {"n2", "n3"} for c in m["chains"])
        assert {a for a, _ in vbmap.summary(m["chains"]).values()} == {vbuckets // 2}
        with collection(nodes["n3"]) as coll:
            assert all(coll.get(f"k{i}").content_as[dict] == {"i": i} for i in range(300))
    finally:
        stop_all(nodes)


def test_nodes_keep_serving_without_etcd_and_no_failover_happens(tmp_path, etcd):
    nodes = form(tmp_path, etcd, ["n1", "n2"])
    try:
        with collection(nodes["n2"]) as coll:
            etcd.stop()
            for i in range(100):
                coll.upsert(f"k{i}", i)
            assert all(coll.get(f"k{i}").content_as[int] == i for i in range(100))
            time.sleep(4)  # twice the failover timeout: nobody can fail anyone over
            etcd.start()
            time.sleep(3)
            m = cluster_map(etcd)
            assert m["failed"] == {} and m["auto_failovers"] == 0
            for i in range(100, 200):
                coll.upsert(f"k{i}", i)
            assert "n1" in nodes["n1"].log() and "etcd answers again" in nodes["n1"].log()
    finally:
        stop_all(nodes)


def test_the_cluster_works_on_with_one_etcd_member_of_three_killed(tmp_path):
    etcd = EtcdServer(tmp_path / "etcd", members=3)
    nodes = {}
    try:
        nodes = form(tmp_path, etcd, ["n1", "n2", "n3"])
        # The member every node asks first dies: they go on with the other two.
        etcd.kill_member(0)
        nodes["n3"].stop(sig=9)
        m = wait_map(etcd, lambda m: "n3" in m["failed"], timeout=30)
        assert all(c[0] in ("n1", "n2") for c in m["chains"])
        # A node hears the new map once its watch reaches a member that answers; until then
        # it hands clients the map that sends them to n3.
        wait_serving_map(nodes, m)
        with collection(nodes["n1"]) as coll:
            for i in range(50):
                coll.upsert(f"k{i}", i)
            assert all(coll.get(f"k{i}").content_as[int] == i for i in range(50))
    finally:
        stop_all(nodes)
        etcd.close()


def add_n3_and_write_to_it(etcd: EtcdServer, n3) -> tuple[bytes, int, socket.socket]:
    """Adds n3, rebalances, and writes at majority, on a connection of n3's own, to a key of a
    vbucket n3 is active for: (the key, its vbucket, the connection)."""
    wait_registered(etcd, ["n3"])
    cli(etcd, "add", "n3")
    cli(etcd, "rebalance")
    m = cluster_map(etcd)
    key = next(
        k
        for k in (f"key{i}".encode() for i in range(1000))
        if m["chains"][sluice.vbucket_of(k, NUM_VBUCKETS)][0] == "n3"
    )
    sock = connect(n3)
    assert login(sock, "app", PASSWORD) == 0
    assert majority_set(sock, key, b"before", timeout_ms=5000) == 0
    return key, sluice.vbucket_of(key, NUM_VBUCKETS), sock


def test_a_node_cut_off_from_etcd_is_failed_over_and_its_old_actives_refuse_majority_writes(tmp_path, etcd):
    proxy = FaultProxy(f"127.0.0.1:{etcd.clients[0]}")
    nodes = form(tmp_path, etcd, ["n1", "n2"])
    try:
        nodes["n3"] = cluster_node(tmp_path, etcd, "n3", url=f"etcd://{proxy.address}/c1")
        key, vb, old = add_n3_and_write_to_it(etcd, nodes["n3"])
        # n3 still serves its peers and clients, but etcd no longer hears from it.
        proxy.drop(True)
        m = wait_map(etcd, lambda m: "n3" in m["failed"], timeout=30)
        new_active = m["chains"][vb][0]
        assert new_active in ("n1", "n2")
        deadline = time.monotonic() + 30
        while vbucket_states(nodes[new_active])[vb] != "active":
            assert time.monotonic() < deadline, "the new active never took its vbucket"
            time.sleep(0.05)
        # n3 never learns of the new map, and still takes its vbucket as active; its replica
        # now follows the new active, so no majority write is acknowledged on n3 any more.
        status = majority_set(old, key, b"split", timeout_ms=2000)
        assert status in (DURABILITY_IMPOSSIBLE, SYNC_WRITE_AMBIGUOUS), hex(status)
        new = connect(nodes[new_active])
        assert login(new, "app", PASSWORD) == 0
        deadline = time.monotonic() + 30
        while (status := majority_set(new, key, b"after", timeout_ms=2000)) != 0:
            # The promoted vbucket's replica (n3's place is empty) may be none: a plain write.
            if status == DURABILITY_IMPOSSIBLE:
                break
            assert time.monotonic() < deadline, hex(status)
            time.sleep(0.1)
        # What the new active holds is what was acknowledged, never the write n3 refused.
        new.sendall(request(GET, key))
        got = read_response(new)
        assert got["status"] == 0 and got["value"] in (b"before", b"after"), got
        old.close()
        new.close()
    finally:
        proxy.close()
        stop_all(nodes)


def test_a_rebalance_stops_when_asked_and_a_new_one_finishes_the_moves(tmp_path, etcd):
    vbuckets = 256
    nodes = form(tmp_path, etcd, ["n1", "n2"], vbuckets=vbuckets)
    try:
        nodes["n3"] = cluster_node(tmp_path, etcd, "n3", vbuckets=vbuckets)
        wait_registered(etcd, ["n3"])
        start_rebalance_adding(etcd, "n3", moves_done=3)
        assert "rebalance stop requested" in cli(etcd, "stop-rebalance")
        deadline = time.monotonic() + 60
        while (state := rebalance_state(etcd))["state"] == "running":
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert state["state"] == "stopped" and state["done"] < state["total"], state
        status = cli(etcd, "status")
        assert "rebalance: stopped" in status, status
        out = cli(etcd, "rebalance")
        assert "rebalance done" in out, out
        m = cluster_map(etcd)
        assert {a for a, _ in vbmap.summary(m["chains"]).values()} <= {85, 86}
    finally:
        stop_all(nodes)


def test_a_node_cut_off_from_its_peers_but_not_etcd_takes_no_majority_write_and_is_not_failed_over(
    tmp_path, etcd
):
    nodes = form(tmp_path, etcd, ["n1", "n2"])
    # Peers and clients reach n3 through the proxy; n3 reaches etcd and its actives directly.
    port = free_port()
    proxy = FaultProxy(f"127.0.0.1:{port}")
    try:
        nodes["n3"] = cluster_node(tmp_path, etcd, "n3", listen=f"127.0.0.1:{port}", advertise=proxy.address)
        key, vb, direct = add_n3_and_write_to_it(etcd, nodes["n3"])
        proxy.drop(True)
        # Its replica hears nothing more from it: no majority write is acknowledged on n3.
        status = majority_set(direct, key, b"cut", timeout_ms=1500)
        assert status in (DURABILITY_IMPOSSIBLE, SYNC_WRITE_AMBIGUOUS), hex(status)
        time.sleep(4)  # twice the failover timeout: n3's lease is alive, nobody fails it over
        m = cluster_map(etcd)
        assert m["failed"] == {} and m["chains"][vb][0] == "n3"
        replica = m["chains"][vb][1]
        assert vbucket_states(nodes[replica])[vb] == "replica"
        direct.close()
    finally:
        proxy.close()
        stop_all(nodes)


def test_a_node_failed_over_by_hand_serves_nothing_until_it_restarts_and_is_taken_back(tmp_path, etcd):
    nodes = form(tmp_path, etcd, ["n1", "n2", "n3"])
    try:
        before = cluster_map(etcd)
        assert "failover of n2 requested" in cli(etcd, "failover", "n2")
        m = wait_map(etcd, lambda m: "n2" in m["failed"])
        assert all(c[0] in ("n1", "n3") and "n2" not in c for c in m["chains"])
        assert m["auto_failovers"] == 0
        deadline = time.monotonic() + 10
        while set(vbucket_states(nodes["n2"]).values()) != {"dead"}:
            assert time.monotonic() < deadline, vbucket_states(nodes["n2"])
            time.sleep(0.05)
        time.sleep(1.5)  # still running and registered: not taken back
        assert "n2" in cluster_map(etcd)["failed"]
        nodes["n2"].stop()
        nodes["n2"] = cluster_node(tmp_path, etcd, "n2")
        back = wait_map(etcd, lambda m: "n2" not in m["failed"])
        assert all("n2" in back["chains"][vb][1:] for vb in vbmap.held_by(before["chains"], "n2"))
    finally:
        stop_all(nodes)
