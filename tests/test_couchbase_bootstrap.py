"""What Couchbase's SDKs read while they bootstrap over the KV port, byte for byte: the error map
(GET_ERROR_MAP), the cluster map (GET_CLUSTER_CONFIG, the body of NOT_MY_VBUCKET, the map pushed
on a change), and collection-aware keys (HELLO Collections, GET_COLLECTIONS_MANIFEST,
GET_COLLECTION_ID)."""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

import sluice
from helpers import NUM_VBUCKETS, run_cli, start_node
from mcbp_wire import GET, HELLO, SET, connect, login, read_frame, read_response, request, set_extras

GET_ERROR_MAP, GET_CLUSTER_CONFIG, SELECT_BUCKET = 0xFE, 0xB5, 0x89
GET_COLLECTIONS_MANIFEST, GET_COLLECTION_ID = 0xBA, 0xBB
GET_META, GETQ_META, NOOP = 0xA0, 0xA1, 0x0A
AUTH_ERROR = 0x20
XERROR, SELECT_BUCKET_FEATURE, JSON_FEATURE, DUPLEX, CLUSTERMAP_CHANGE, COLLECTIONS = (
    0x07,
    0x08,
    0x0B,
    0x0C,
    0x0D,
    0x12,
)
NOT_MY_VBUCKET, UNKNOWN_COLLECTION, UNKNOWN_SCOPE, EINVAL = 0x07, 0x88, 0x8C, 0x04
ROOT = Path(__file__).resolve().parent.parent


def call(s, frame: bytes) -> dict:
    s.sendall(frame)
    return read_response(s)


def hello(s, *features: int) -> list[int]:
    """HELLO asking for `features`: those the server acknowledged."""
    r = call(s, request(HELLO, b'{"a":"sluice-test"}', b"".join(struct.pack(">H", f) for f in features)))
    assert r["status"] == 0
    return [struct.unpack(">H", r["value"][i : i + 2])[0] for i in range(0, len(r["value"]), 2)]


def bucket_connection(node, *features: int, user: tuple[str, str] | None = None):
    """A connection as an SDK's bucket connection is: HELLO, login (SASL PLAIN as `user`, a
    name and password) on a node with users, then SELECT_BUCKET default."""
    s = connect(node)
    hello(s, XERROR, SELECT_BUCKET_FEATURE, JSON_FEATURE, *features)
    if user is not None:
        assert login(s, *user) == 0
    assert call(s, request(SELECT_BUCKET, b"default"))["status"] == 0
    return s


def config(s, datatype: int = 0x01) -> dict:
    """GET_CLUSTER_CONFIG; the datatype is JSON for a client that said it knows datatypes."""
    r = call(s, request(GET_CLUSTER_CONFIG))
    assert (r["status"], r["datatype"]) == (0, datatype), r
    return json.loads(r["value"])


def wait_for_map(node, check, timeout: float = 30, user: tuple[str, str] | None = None) -> dict:
    """The node's bucket map once `check(map)` holds."""
    deadline = time.monotonic() + timeout
    with bucket_connection(node, user=user) as s:
        while True:
            m = config(s)
            if check(m):
                return m
            assert time.monotonic() < deadline, f"map never matched: {m}"
            time.sleep(0.1)


def replicated_everywhere(m: dict) -> bool:
    """Every vbucket's chain names the active, then one replica (the replica's streams come up
    one by one: a map between lists it for some vbuckets only)."""
    chains = m["vBucketServerMap"]["vBucketMap"]
    return len(chains) == NUM_VBUCKETS and all(len(c) == 2 and -1 not in c for c in chains)


def sluice_statuses() -> dict[str, int]:
    """Every status constant sluice-proto names (mcbp.rs's `pub mod status`)."""
    text = (ROOT / "rust/sluice-proto/src/mcbp.rs").read_text()
    block = text.split("pub mod status {")[1].split("}")[0]
    return {m[0]: int(m[1], 16) for m in re.findall(r"pub const (\w+): u16 = 0x([0-9a-fA-F]+);", block)}


def test_error_map_holds_every_status_in_the_version_asked(tmp_path):
    node = start_node(tmp_path, "n")
    try:
        with connect(node) as s:
            hello(s, XERROR, JSON_FEATURE)
            r = call(s, request(GET_ERROR_MAP, value=struct.pack(">H", 2)))
            assert r["status"] == 0
            m = json.loads(r["value"])
            assert m["version"] == 2 and isinstance(m["revision"], int)
            errors = m["errors"]
            assert all(k == k.lower() and int(k, 16) >= 0 for k in errors)
            for name, code in sluice_statuses().items():
                e = errors.get(f"{code:x}")
                assert e is not None, f"{name} ({code:#x}) is missing from the error map"
                assert e["name"] and e["desc"] and e["attrs"], e
            # Statuses of commands other parts of the KV front answer (locking, sub-document).
            for code in [0x09, 0x0E, 0x21, *range(0xC0, 0xD6)]:
                assert f"{code:x}" in errors
            assert errors["7"]["attrs"] == ["fetch-config", "invalid-input"]
            assert {"temp", "retry-now"} <= set(errors["86"]["attrs"])
            assert {"conn-state-invalidated", "auth"} <= set(errors["20"]["attrs"])
            for code in ("86", "a2", "a4", "7", "9"):
                retry = errors[code]["retry"]
                assert retry["strategy"] in ("constant", "linear", "exponential")
                assert all(retry[k] >= 0 for k in ("interval", "after", "ceil", "max-duration"))
            assert "retry" not in errors["1"], "a missing key is not retried"
            # The highest version not above the one asked.
            assert json.loads(call(s, request(GET_ERROR_MAP, value=b"\x00\x01"))["value"])["version"] == 1
            assert json.loads(call(s, request(GET_ERROR_MAP, value=b"\x00\x09"))["value"])["version"] == 2
            assert call(s, request(GET_ERROR_MAP, value=b"\x00\x00"))["status"] == EINVAL
            assert call(s, request(GET_ERROR_MAP, value=b"\x02"))["status"] == EINVAL
    finally:
        node.stop()


def test_a_node_alone_serves_every_vbucket_and_hello_names_the_features(tmp_path):
    node = start_node(tmp_path, "n")
    try:
        with connect(node) as s:
            wanted = [XERROR, SELECT_BUCKET_FEATURE, JSON_FEATURE, DUPLEX, CLUSTERMAP_CHANGE, COLLECTIONS]
            assert hello(s, *wanted) == wanted
            # No bucket chosen yet by a client that can choose: the cluster-level map.
            cluster = config(s)
            assert "vBucketServerMap" not in cluster and "name" not in cluster
            this_node = {"hostname": "$HOST", "services": {"kv": node.port}, "thisNode": True}
            assert cluster["nodesExt"] == [this_node]
            assert call(s, request(SELECT_BUCKET, b"default"))["status"] == 0
            m = config(s)
        assert m["name"] == "default" and m["nodeLocator"] == "vbucket"
        assert re.fullmatch(r"[0-9a-f]{32}", m["uuid"])
        assert isinstance(m["rev"], int) and m["rev"] > 0 and m["revEpoch"] == 1
        # Bound to loopback, the node does not know the name clients use: $HOST, which they
        # replace with the address they connected to.
        assert m["nodesExt"] == [this_node]
        vbmap = m["vBucketServerMap"]
        assert vbmap["hashAlgorithm"] == "CRC" and vbmap["numReplicas"] == 0
        assert vbmap["serverList"] == [f"$HOST:{node.port}"]
        assert vbmap["vBucketMap"] == [[0]] * NUM_VBUCKETS
        assert "cccp" in m["bucketCapabilities"]
        # A client that never says HELLO (so never selects) gets its bucket's map at once.
        with connect(node) as s:
            assert config(s, datatype=0)["vBucketServerMap"]["vBucketMap"] == [[0]] * NUM_VBUCKETS
    finally:
        node.stop()


def test_not_my_vbucket_carries_the_map_never_an_error_context(tmp_path):
    node = start_node(tmp_path, "n")
    try:
        with bucket_connection(node) as s:
            wrong = (sluice.vbucket_of(b"k", NUM_VBUCKETS) + 1) % NUM_VBUCKETS
            for frame in (
                request(SET, b"k", b"v", set_extras(), vbucket=wrong),
                request(GET, b"k", vbucket=wrong),
            ):
                r = call(s, frame)
                assert r["status"] == NOT_MY_VBUCKET and r["datatype"] & 0x01
                body = json.loads(r["value"])
                assert "error" not in body
                assert body["nodesExt"][0]["services"]["kv"] == node.port
                assert len(body["vBucketServerMap"]["vBucketMap"]) == NUM_VBUCKETS
    finally:
        node.stop()


def test_replica_in_the_chains_and_promotion_pushed_to_clients(tmp_path):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    try:
        # The active lists the replica after itself once its streams are up, by the address
        # it told in the DCP control sluice_kv_address.
        m = wait_for_map(active, replicated_everywhere)
        assert m["vBucketServerMap"]["serverList"] == [f"$HOST:{active.port}", f"127.0.0.1:{replica.port}"]
        assert m["vBucketServerMap"]["vBucketMap"] == [[0, 1]] * NUM_VBUCKETS
        assert m["nodesExt"][1] == {"hostname": "127.0.0.1", "services": {"kv": replica.port}}
        # The replica names its active as active and itself as replica.
        with bucket_connection(replica, DUPLEX, CLUSTERMAP_CHANGE) as s:
            before = config(s)
            vbmap = before["vBucketServerMap"]
            assert vbmap["serverList"] == [f"$HOST:{replica.port}", f"127.0.0.1:{active.port}"]
            assert vbmap["vBucketMap"] == [[1, 0]] * NUM_VBUCKETS
            # A write to a replica vbucket: NOT_MY_VBUCKET with the map, which names the active.
            r = call(s, request(SET, b"k", b"v", set_extras(), vbucket=sluice.vbucket_of(b"k", NUM_VBUCKETS)))
            assert r["status"] == NOT_MY_VBUCKET
            assert json.loads(r["value"])["vBucketServerMap"]["vBucketMap"] == vbmap["vBucketMap"]
            promoted = run_cli("promote", "--admin", replica.admin)
            assert promoted.returncode == 0, promoted.stderr
            # The client asked for change notifications: the new map comes unasked.
            s.settimeout(10)
            push = read_frame(s)
            assert (push["magic"], push["opcode"], push["key"]) == (0x82, 0x01, b"default")
            assert push["datatype"] & 0x01
            epoch, rev = struct.unpack(">qq", push["extras"])
            pushed = json.loads(push["value"])
            assert epoch == pushed["revEpoch"] and rev == pushed["rev"] > before["rev"]
            assert pushed["vBucketServerMap"]["vBucketMap"] == [[0]] * NUM_VBUCKETS
            assert pushed["vBucketServerMap"]["numReplicas"] == 0
            assert config(s)["rev"] == rev
    finally:
        replica.stop()
        active.stop()


def test_a_moved_vbucket_points_at_its_new_node_with_a_higher_rev(tmp_path):
    a = start_node(tmp_path, "a")
    b = start_node(tmp_path, "b")
    key = next(k for i in range(10_000) if sluice.vbucket_of(k := f"k{i}".encode(), NUM_VBUCKETS) == 5)
    stream = sluice.Client(a.address).stream(format="python", start="beginning")
    try:
        with bucket_connection(a) as s:
            before = config(s)
            assert call(s, request(SET, key, b"on a", set_extras(), vbucket=5))["status"] == 0
        seen = []
        deadline = time.monotonic() + 30
        while not seen:
            assert time.monotonic() < deadline, "the stream never showed the first write"
            seen += [c.value for c in stream.poll(1.0) or [] if c.key == key]
        moved = run_cli("move-vbucket", "--vb", "5", "--from", a.admin, "--to", b.admin, timeout=60)
        assert moved.returncode == 0, moved.stderr
        with bucket_connection(a) as s:
            after = config(s)
        assert after["rev"] > before["rev"]
        vbmap = after["vBucketServerMap"]
        assert vbmap["serverList"] == [f"$HOST:{a.port}", f"127.0.0.1:{b.port}"]
        assert vbmap["vBucketMap"][5] == [1]
        assert all(chain == [0] for vb, chain in enumerate(vbmap["vBucketMap"]) if vb != 5)
        # A stream of a's vbuckets follows vbucket 5 to b, going on where it left off.
        with bucket_connection(b) as s:
            assert call(s, request(SET, key, b"on b", set_extras(), vbucket=5))["status"] == 0
        while b"on b" not in seen:
            assert time.monotonic() < deadline, seen
            seen += [c.value for c in stream.poll(1.0) or [] if c.key == key]
        assert seen == [b"on a", b"on b"]
    finally:
        stream.close()
        b.stop()
        a.stop()


def test_collection_ids_prefix_keys_and_only_the_default_collection_exists(tmp_path):
    node = start_node(tmp_path, "n")
    try:
        with bucket_connection(node, COLLECTIONS) as s:
            # The vbucket is the document key's, not the prefixed key's.
            vb = sluice.vbucket_of(b"doc", NUM_VBUCKETS)
            assert call(s, request(SET, b"\x00doc", b"v1", set_extras(), vbucket=vb))["status"] == 0
            r = call(s, request(GET, b"\x00doc", vbucket=vb))
            assert (r["status"], r["value"]) == (0, b"v1")
            # Every command on a document key takes the prefix, the meta gets among them.
            r = call(s, request(GET_META, b"\x00doc", vbucket=vb))
            assert r["status"] == 0 and r["cas"] != 0
            s.sendall(request(GETQ_META, b"\x00doc", vbucket=vb, opaque=5) + request(NOOP, opaque=6))
            assert (read_response(s)["opaque"], read_response(s)["opaque"]) == (5, 6), "GETQ_META hit"
            r = call(s, request(GET, b"\x08doc"))
            assert r["status"] == UNKNOWN_COLLECTION
            body = json.loads(r["value"])
            assert body["manifest_uid"] == "0" and "context" in body["error"]
            assert call(s, request(GET, b"\x80"))["status"] == EINVAL, "a collection id cut short"
            assert call(s, request(GET, b"\x80\x80\x80\x80\x80\x00k"))["status"] == EINVAL
            r = call(s, request(GET_COLLECTIONS_MANIFEST))
            manifest = json.loads(r["value"])
            assert manifest["uid"] == "0"
            assert manifest["scopes"] == [
                {"name": "_default", "uid": "0", "collections": [{"name": "_default", "uid": "0"}]}
            ]
            # The path as value (later clients) or as key (Couchbase 7.0); empty parts are _default.
            for frame in (
                request(GET_COLLECTION_ID, value=b"_default._default"),
                request(GET_COLLECTION_ID, key=b"_default._default"),
                request(GET_COLLECTION_ID, value=b"."),
            ):
                r = call(s, frame)
                assert r["status"] == 0 and struct.unpack(">QI", r["extras"]) == (0, 0)
            for path, st in ((b"inventory.hotels", UNKNOWN_SCOPE), (b"_default.hotels", UNKNOWN_COLLECTION)):
                assert call(s, request(GET_COLLECTION_ID, value=path))["status"] == st
        # Stored without the prefix: a client without collections reads the same document.
        with connect(node) as s:
            r = call(s, request(GET, b"doc"))
            assert (r["status"], r["value"]) == (0, b"v1")
    finally:
        node.stop()


def test_the_error_map_is_served_before_login(tmp_path):
    """Some SDKs (Couchbase's Java SDK) fetch the error map before they log in; nothing else is
    served then, not even the map pushes a client asked for in HELLO."""
    from test_permissions import users_config

    node = start_node(tmp_path, "n", extra=users_config({"app": ["read"]}))
    try:
        with connect(node) as s:
            hello(s, XERROR, JSON_FEATURE, DUPLEX, CLUSTERMAP_CHANGE)
            r = call(s, request(GET_ERROR_MAP, value=struct.pack(">H", 2)))
            assert r["status"] == 0 and json.loads(r["value"])["version"] == 2
            assert call(s, request(GET, b"k"))["status"] == AUTH_ERROR
            assert call(s, request(GET_CLUSTER_CONFIG))["status"] == AUTH_ERROR
    finally:
        node.stop()
