"""The `sluice` PySpark data source on Spark local[2] against real `sluice serve` processes:
batch reads from a replica, streaming into a file sink across a restart, a failover under a
running stream, and a daemon that is down or silent."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import bmemcached
import pytest
import sluice.spark
from helpers import contents, run_cli, start_node, wait_converged
from mcbp_wire import DELETE, PATH_MKDIR_P, PATH_XATTR, SUBDOC_DICT_UPSERT, connect, mutation_spec, request
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.utils import StreamingQueryException
from sluice.spark import planning
from sluice.spark.options import OptionError, parse
from test_kv_documents import call, multi_mutation, store


@pytest.fixture(scope="module")
def spark():
    session = (
        SparkSession.builder.master("local[2]")
        .appName("sluice-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    sluice.spark.register(session)
    yield session
    session.stop()


def wait_until(what: str, check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.25)


def write(node, items: dict[str, str | None]) -> None:
    """Sets (or, for None, deletes) keys through a memcached client."""
    c = bmemcached.Client([node.address])
    for k, v in items.items():
        if v is None:
            c.delete(k)
        else:
            assert c.set(k, v)


def test_a_batch_read_from_a_replica_equals_what_was_written(spark, tmp_path):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    stopped = False
    try:
        expected: dict[str, str | None] = {f"k{i}": f"v{i}" * (i % 5 + 1) for i in range(4000)}
        write(active, expected)
        overwrites = {f"k{i}": f"w{i}" for i in range(0, 4000, 3)}
        deletes: dict[str, str | None] = {f"k{i}": None for i in range(0, 4000, 7)}
        write(active, overwrites)
        write(active, deletes)
        expected.update(overwrites)
        expected.update(deletes)
        wait_converged(active, replica)
        # The active stops answering: what is read comes from the replica.
        active.proc.send_signal(signal.SIGSTOP)
        stopped = True
        df = (
            spark.read.format("sluice")
            .option("nodes", f"{active.address},{replica.address}")
            .option("timeout", "2")
            .load()
        )
        # 4,000 changes: fewer than a partition's minimum, so one partition unless told.
        assert df.rdd.getNumPartitions() == 1
        three = spark.read.format("sluice").option("nodes", replica.address).option("numPartitions", "3")
        assert three.load().rdd.getNumPartitions() == 3
        rows = df.collect()
        live = {r.key: bytes(r.value).decode() for r in rows if r.op == "mutation"}
        assert live == {k: v for k, v in expected.items() if v is not None}
        assert {r.key for r in rows if r.op == "deletion"} == {k for k, v in expected.items() if v is None}
        # Each key once, with the replica's seqno, CAS and rev seqno.
        assert len(rows) == len(expected)
        on_replica = contents(replica)
        assert {(r.vbucket, r.key.encode()): (r.seqno, r.cas % 2**64, r.rev_seqno) for r in rows} == {
            k: (v[0], v[3], v[4]) for k, v in on_replica.items()
        }
        # A checksum computed by Spark itself, deletions left out by the source.
        live_df = df.sparkSession.read.format("sluice").option("nodes", replica.address)
        agg = (
            live_df.option("includeDeletes", "false")
            .load()
            .agg(F.count("*").alias("n"), F.sum(F.crc32("value")).alias("crc"))
            .first()
        )
        assert agg.n == len(live)
        assert agg.crc == sum(zlib.crc32(v.encode()) for v in live.values())
    finally:
        if stopped:
            active.proc.send_signal(signal.SIGCONT)
        replica.stop()
        active.stop()


def test_extended_attributes_reach_a_replica_and_spark(spark, tmp_path):
    """Documents with user and system extended attributes, one of them deleted (its tombstone
    keeps the system ones), replicated over DCP and read by Spark from the replica: with the
    `xattrs` option they are a JSON column beside the body (without it, a stream carries the
    body alone: tests/test_tail.py)."""
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    try:
        xa = PATH_XATTR | PATH_MKDIR_P
        with connect(active) as s:
            for key in (b"tagged", b"gone"):
                store(s, key, b'{"n":1}')
                r = multi_mutation(
                    s,
                    key,
                    mutation_spec(SUBDOC_DICT_UPSERT, b"meta.by", b'"ann"', xa),
                    mutation_spec(SUBDOC_DICT_UPSERT, b"_sync.rev", b"2", xa),
                )
                assert r["status"] == 0, r
            store(s, b"plain", b'{"n":2}')
            assert call(s, request(DELETE, b"gone"))["status"] == 0
        wait_converged(active, replica)
        read = spark.read.format("sluice").option("nodes", replica.address)
        rows = {r.key: r for r in read.option("xattrs", "true").load().collect()}
        assert bytes(rows["tagged"].value) == b'{"n":1}'
        assert json.loads(rows["tagged"].xattrs) == {"meta": {"by": "ann"}, "_sync": {"rev": 2}}
        assert (bytes(rows["plain"].value), rows["plain"].xattrs) == (b'{"n":2}', "{}")
        assert rows["gone"].op == "deletion" and json.loads(rows["gone"].xattrs) == {"_sync": {"rev": 2}}
    finally:
        replica.stop()
        active.stop()


def changes_in(spark, path: Path):
    if not (path / "_spark_metadata").exists():
        return []
    return spark.read.schema(sluice.spark.spark_schema()).parquet(str(path)).collect()


def assert_each_change_once_and_none_missing(rows: list, node) -> None:
    """No (vbucket, seqno) twice, and each key's newest row is the node's current version."""
    seen = [(r.vbucket, r.seqno) for r in rows]
    assert len(seen) == len(set(seen)), "a change was written twice"
    newest: dict[tuple[int, bytes], tuple] = {}
    for r in rows:
        k = (r.vbucket, r.key.encode())
        if k not in newest or newest[k][0] < r.seqno:
            newest[k] = (r.seqno, r.op, bytes(r.value))
    assert newest == {k: (v[0], v[1], v[2]) for k, v in contents(node).items()}


@pytest.mark.parametrize("read_on_driver", [False, True])
def test_streaming_picks_up_new_writes_and_a_restart_writes_each_change_once(spark, tmp_path, read_on_driver):
    node = start_node(tmp_path, "a")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def run(**trigger):
        return (
            spark.readStream.format("sluice")
            .option("nodes", node.address)
            .option("startingOffsets", "earliest")
            .option("maxRecordsPerBatch", "250")
            .option("readOnDriver", str(read_on_driver).lower())
            .load()
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )

    try:
        write(node, {f"a{i}": f"one{i}" for i in range(600)})
        q = run(processingTime="500 milliseconds")
        try:
            wait_until("the first writes in the sink", lambda: len(changes_in(spark, out)) >= 600)

            # The query's progress names the source's latest offset: every vbucket's high seqno
            # (not offered to a reader on the driver).
            def latest_seqnos() -> int:
                p = q.lastProgress
                latest = p and p["sources"][0].get("latestOffset")
                return sum(v["seqno"] for v in json.loads(latest)["vbuckets"].values()) if latest else 0

            if not read_on_driver:
                wait_until("the latest offset in the query's progress", lambda: latest_seqnos() >= 600)
            # New writes, overwrites and deletes while the query runs.
            write(node, {f"b{i}": f"two{i}" for i in range(300)})
            write(node, {f"a{i}": None for i in range(0, 600, 10)})
            wait_until(
                "the new writes in the sink",
                lambda: {r.key for r in changes_in(spark, out)} >= {f"b{i}" for i in range(300)},
            )
            sizes = [p["numInputRows"] for p in q.recentProgress]
        finally:
            q.stop()
        assert max(sizes) <= 250 and sum(1 for n in sizes if n) >= 3, sizes
        # Written while the query is stopped; picked up from the checkpoint.
        write(node, {f"c{i}": f"three{i}" for i in range(400)})
        write(node, {f"a{i}": f"four{i}" for i in range(1, 600, 10)})
        q = run(availableNow=True)
        assert q.awaitTermination(180)
        assert q.exception() is None
        assert_each_change_once_and_none_missing(changes_in(spark, out), node)
    finally:
        node.stop()


def by_position(row: dict) -> tuple[int, int]:
    return row["vbucket"], row["seqno"]


def test_a_driver_read_replayed_between_offsets_gives_exactly_that_range(tmp_path):
    """What a restarted query's task reads for a micro-batch the driver had planned."""
    node = start_node(tmp_path, "a")
    try:
        write(node, {f"k{i}": f"v{i}" for i in range(300)})
        opts = parse(
            {"nodes": node.address, "readOnDriver": "true", "maxRecordsPerBatch": "120"}, streaming=True
        )
        reader = sluice.spark.SluiceDriverStreamReader(opts, None)
        start = planning.offset_json(
            {vb: planning.Position(0, s.uuid) for vb, s in planning.locate(opts).items()}
        )
        seen: list[str] = []
        for _ in range(10):
            batches, end = reader.read(start)
            rows = [r for b in batches for r in b.to_pylist()]
            if end == start:
                assert rows == []
                break
            assert 0 < len(rows) <= 120
            again = [r for b in reader.readBetweenOffsets(start, end) for r in b.to_pylist()]
            assert sorted(again, key=by_position) == sorted(rows, key=by_position)
            seen += [r["key"] for r in rows]
            start = end
        assert sorted(seen) == sorted(f"k{i}" for i in range(300))
    finally:
        node.stop()


@pytest.mark.parametrize("fail_on_data_loss", [True, False])
def test_a_failover_under_a_running_stream(spark, tmp_path, fail_on_data_loss):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    name = f"failover_{str(fail_on_data_loss).lower()}"
    q = None
    try:
        write(active, {f"x{i}": "before" for i in range(300)})
        wait_converged(active, replica)
        q = (
            spark.readStream.format("sluice")
            .option("nodes", f"{active.address},{replica.address}")
            .option("startingOffsets", "earliest")
            .option("failOnDataLoss", str(fail_on_data_loss).lower())
            .option("timeout", "3")
            .load()
            .writeStream.format("memory")
            .queryName(name)
            .trigger(processingTime="500 milliseconds")
            .start()
        )

        def keys() -> set[str]:
            return {r.key for r in spark.sql(f"SELECT key FROM {name}").collect()}

        wait_until("the rows before the failover", lambda: len(keys()) >= 300)
        active.stop(sig=9)
        out = run_cli("promote", "--admin", replica.admin)
        assert out.returncode == 0, out
        write(replica, {f"y{i}": "after" for i in range(100)})
        if fail_on_data_loss:
            with pytest.raises(StreamingQueryException) as e:
                q.awaitTermination(120)
            text = str(e.value)
            assert "vbucket" in text and "failover" in text and "failOnDataLoss=false" in text, text
        else:
            wait_until("the writes after the failover", lambda: keys() >= {f"y{i}" for i in range(100)})
            assert q.isActive and q.exception() is None
    finally:
        if q is not None and q.isActive:
            q.stop()
        replica.stop()
        active.stop(sig=9)


def test_a_daemon_down_or_silent_is_a_clear_error(spark):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        spark.read.format("sluice").option("nodes", down).load().count()
    assert "no sluice node answered" in str(e.value) and "cannot connect" in str(e.value)
    # A node that accepts connections and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(Exception) as e:
            spark.read.format("sluice").option("nodes", addr).option("timeout", "2").load().count()
        assert "no sluice node answered" in str(e.value) and "no answer" in str(e.value)
    assert time.monotonic() - t0 < 60


def test_options_are_checked_by_name(spark):
    with pytest.raises(Exception) as e:
        spark.read.format("sluice").option("startingOfsets", "earliest").load().count()
    assert "startingofsets" in str(e.value) and "unknown option" in str(e.value)
    with pytest.raises(Exception) as e:
        spark.readStream.format("sluice").option("maxRecordsPerBatch", "lots").load().writeStream.format(
            "memory"
        ).queryName("bad_limit").start().awaitTermination(60)
    assert "maxRecordsPerBatch" in str(e.value) and "whole number" in str(e.value)
    for options, name in [
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss"),
        ({"nodes": "nowhere"}, "nodes"),
        ({"vbuckets": "5-2"}, "vbuckets"),
        ({"startingOffsets": '{"0": "x"}'}, "startingOffsets"),
        ({"user": "u"}, "password"),
    ]:
        with pytest.raises(OptionError, match=name):
            parse(options, streaming=False)
    with pytest.raises(OptionError, match="endingOffsets"):
        parse({"endingOffsets": "latest"}, streaming=True)
    with pytest.raises(OptionError, match="readOnDriver.*streaming reads only"):
        parse({"readOnDriver": "true"}, streaming=False)


def test_the_failover_rule():
    log = [(30, 120), (20, 100), (10, 0)]
    # On the current history: nothing to say.
    assert planning.diverged(log, 150, 30, 140) is None
    assert planning.diverged(log, 150, 30, 160)[0] == 150
    # Read past the point where an old branch ended: back to that point.
    assert planning.diverged(log, 150, 10, 105)[0] == 100
    # Within an old branch: nothing read was rolled back, but the uuid changed: a failover.
    agree, why = planning.diverged(log, 150, 20, 110)
    assert agree == 110 and "failover at seqno 120" in why
    # An unknown uuid: from the beginning, unless nothing was read.
    assert planning.diverged(log, 150, 99, 40)[0] == 0
    assert planning.diverged(log, 150, 99, 0) is None
    assert planning.uuid_at(log, 110) == 20 and planning.uuid_at(log, 120) == 30


def test_partitions_are_chosen_from_the_data_and_the_cores():
    def ranges(n: int, span: int) -> list:
        return [("n", planning.VbucketRange(vb, 1, 0, span)) for vb in range(n)]

    # Little data: one partition; enough to share: one per core; a lot: at most a million
    # changes each; never more partitions than vbucket ranges.
    assert planning.partitions_for(ranges(1024, 5), cores=8) == 1
    assert planning.partitions_for(ranges(1024, 1000), cores=8) == 8
    assert planning.partitions_for(ranges(1024, 100_000), cores=8) == 103
    assert planning.partitions_for(ranges(4, 10**7), cores=8) == 4
    assert planning.partitions_for([], cores=8) == 1


def test_offsets_are_canonical():
    a = planning.offset_json({3: planning.Position(5, 7), 10: planning.Position(1, 2)})
    b = planning.offset_json({10: planning.Position(1, 2), 3: planning.Position(5, 7)})
    import json

    assert (
        json.dumps(a)
        == json.dumps(b)
        == ('{"v": 1, "vbuckets": {"3": {"seqno": 5, "uuid": 7}, "10": {"seqno": 1, "uuid": 2}}}')
    )
    assert planning.parse_offset(json.loads(json.dumps(a))) == {
        3: planning.Position(5, 7),
        10: planning.Position(1, 2),
    }


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "replica_to_parquet.py"


def batch_counts(output: str) -> dict[int, int]:
    """The example's "batch N: M changes written" lines as {N: M}."""
    found = re.findall(r"^batch (\d+): (\d+) changes written$", output, re.M)
    return {int(b): int(n) for b, n in found}


def test_workers_that_cannot_import_sluice_are_named_with_pysparks_setting(tmp_path, monkeypatch):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    with pytest.raises(sluice.SluiceError) as e:
        sluice.spark.check_worker_python(str(bare / "bin" / "python"))
    assert "PYSPARK_PYTHON is not set" in str(e.value) and f"PYSPARK_PYTHON={sys.executable}" in str(e.value)
    assert "No module named 'sluice'" in str(e.value)
    sluice.spark.check_worker_python(sys.executable)
    sluice.spark.use_this_python()
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/other/python3")
    sluice.spark.use_this_python()
    assert os.environ["PYSPARK_PYTHON"] == "/opt/other/python3", "a setting of the user's is kept"


def test_the_example_pipeline_resumes_after_a_stop_with_no_duplicate_and_no_gap(spark, tmp_path):
    active = start_node(tmp_path, "a")
    replica = start_node(tmp_path, "r", "--replica-of", active.address)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--nodes",
        f"{active.address},{replica.address}",
        "--out",
        str(out),
        "--checkpoint",
        str(checkpoint),
        "--max-records-per-batch",
        "200",
        "--interval",
        "200 milliseconds",
    ]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
    try:
        write(active, {f"e{i}": f"one{i}" for i in range(1000)})
        # Without PYSPARK_PYTHON: the example makes Spark's workers run this interpreter.
        env.pop("PYSPARK_PYTHON", None)
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            wait_until("the job's first batches", lambda: len(changes_in(spark, out)) >= 200)
            # More writes while it runs; then it is stopped, likely in the middle of a batch.
            write(active, {f"f{i}": f"two{i}" for i in range(500)})
            job.send_signal(signal.SIGTERM)
            output, _ = job.communicate(timeout=120)
            assert job.returncode == 0, output
        finally:
            if job.poll() is None:
                job.kill()
        write(active, {f"e{i}": None for i in range(0, 1000, 4)})
        wait_converged(active, replica)
        done = subprocess.run([*cmd, "--available-now"], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = changes_in(spark, out)
        assert_each_change_once_and_none_missing(rows, replica)
        # Each run printed the batches it committed with the rows the sink wrote: together,
        # every row of the output once; the --available-now run wrote (and printed) the rest.
        first, second = batch_counts(output), batch_counts(done.stdout)
        assert first and any(n > 0 for n in first.values()), output
        assert any(n > 0 for n in second.values()), done.stdout
        assert not set(first) & set(second), (first, second)
        assert sum(first.values()) + sum(second.values()) == len(rows), (first, second, len(rows))
    finally:
        replica.stop()
        active.stop()


# A space with a field of every type the typed columns decode.
THINGS = """
[buckets.things]
num_vbuckets = 8
[spaces.things]
id = 600
format = [
  { name = "id", type = "unsigned" },
  { name = "region", type = "string" },
  { name = "score", type = "number", is_nullable = true },
  { name = "delta", type = "integer", is_nullable = true },
  { name = "ok", type = "boolean", is_nullable = true },
  { name = "blob", type = "varbinary", is_nullable = true },
  { name = "tags", type = "array", is_nullable = true },
  { name = "extra", type = "any", is_nullable = true },
  { name = "uid", type = "uuid", is_nullable = true },
]
primary_key = ["id", "region"]
"""


def test_a_space_reads_as_typed_columns(spark, tmp_path):
    """.option("space", ...): one column per field of the format, from tuples written by the
    tarantool connector; a deletion carries its primary key; the space's bucket is found by
    the driver (STAT spaces)."""
    import decimal
    import uuid

    import tarantool
    from iproto_helpers import host_port, user_table
    from sluice.kv import KvConnection

    users = user_table("app", "secret", '{ things = ["read", "write", "stream"] }')
    users += user_table("other", "secret", '{ default = ["read"] }')
    node = start_node(tmp_path, "t", extra=THINGS + users)
    try:
        host, port = host_port(node.iproto)
        conn = tarantool.Connection(host, port, user="app", password="secret")
        uid = uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e")
        expected = {}
        for i in range(300):
            t = [i, "eu" if i % 2 else "us", i / 4, -i, i % 3 == 0, bytes([i % 256, 0]), [i, "x"], {"n": i}]
            if i % 10 == 0:  # a decimal in an `any` field reads as its text
                t[7] = decimal.Decimal("-12.50")
                t.append(uid)
            conn.replace("things", t)
            expected[(i, t[1])] = t
        conn.delete("things", [7, "eu"])
        conn.insert("things", [1000, "ap"])  # only the required fields
        conn.close()

        def things(reader):
            options = {"nodes": node.address, "space": "things", "user": "app", "password": "secret"}
            return reader.format("sluice").options(**options)

        df = things(spark.read).load()
        assert df.columns == [
            "id", "region", "score", "delta", "ok", "blob", "tags", "extra", "uid",
            "_op", "_vbucket", "_seqno", "_cas",
        ]  # fmt: skip
        types = dict(df.dtypes)
        assert (types["id"], types["score"], types["ok"], types["blob"], types["tags"]) == (
            "bigint", "double", "boolean", "binary", "string",
        )  # fmt: skip
        rows = {(r.id, r.region): r for r in df.collect()}
        assert len(rows) == 301
        deleted = rows.pop((7, "eu"))
        assert deleted._op == "deletion"
        assert (deleted.score, deleted.tags, deleted.ok) == (None, None, None)
        bare = rows.pop((1000, "ap"))
        assert bare._op == "mutation" and bare.score is None and bare.extra is None
        del expected[(7, "eu")]
        for key, t in expected.items():
            r = rows[key]
            assert r._op == "mutation" and r._seqno > 0
            assert (r.score, r.delta, r.ok, bytes(r.blob)) == (t[2], t[3], t[4], t[5])
            assert r.tags == f'[{t[0]},"x"]'
            if key[0] % 10 == 0:
                assert (r.extra, r.uid) == ('"-12.50"', str(uid))
            else:
                assert (r.extra, r.uid) == (f'{{"n":{t[0]}}}', None)
        # Spark computes on the typed columns.
        live = df.where(F.col("_op") == "mutation")
        agg = live.agg(F.sum("delta").alias("d"), F.max("score").alias("s")).first()
        assert (agg.d, agg.s) == (-sum(k[0] for k in expected), 299 / 4)

        # A streaming query of the space reads the same rows.
        query = (
            things(spark.readStream)
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.format("memory")
            .queryName("things")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        streamed = spark.sql("SELECT id, region, delta, _op FROM things").collect()
        assert {(r.id, r.region, r.delta, r._op) for r in streamed} == {
            (k[0], k[1], r.delta, r._op) for k, r in rows.items()
        } | {(7, "eu", None, "deletion"), (1000, "ap", None, "mutation")}

        # The node lists only the spaces a user may read.
        assert set(KvConnection(node.address, None, "app", "secret", 5).stats("spaces")) == {"space:things"}
        assert KvConnection(node.address, None, "other", "secret", 5).stats("spaces") == {}
        # Spark wraps the source's error in its own (AnalysisException).
        with pytest.raises(Exception, match="no space 'things' that user other may read"):
            spark.read.format("sluice").option("nodes", node.address).option("space", "things").option(
                "user", "other"
            ).option("password", "secret").load()
        with pytest.raises(OptionError, match="give space or bucket"):
            parse({"space": "things", "bucket": "things"}, streaming=False)
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_a_streaming_query_on_a_followed_space_sees_the_writes_made_on_tarantool(spark, tmp_path):
    """CDC from a real Tarantool: sluice follows it ([tarantool_upstream]) and a streaming query
    on the followed space, with typed columns from its format, sees the Tarantool's writes."""
    import tarantool
    from tarantool_peer import (
        CDC_PASSWORD,
        PASSWORD,
        TARANTOOL,
        TARANTOOL_MISSING,
        USER,
        TarantoolPeer,
        follower_config,
        start_follower,
    )

    if TARANTOOL is None:
        pytest.skip(TARANTOOL_MISSING)
    grant = f"box.schema.user.grant('{USER}', 'replication')"
    with TarantoolPeer(tmp_path / "tarantool", extra_lua=grant) as peer:
        node = start_follower(tmp_path, follower_config(tmp_path, peer))
        host, _, port = peer.address.rpartition(":")
        up = tarantool.Connection(host, int(port), user=USER, password=PASSWORD)
        options = {"nodes": node.address, "space": "users", "user": "cdc", "password": CDC_PASSWORD}
        query = (
            spark.readStream.format("sluice")
            .options(**options)
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.format("memory")
            .queryName("followed")
            .trigger(processingTime="500 milliseconds")
            .start()
        )
        try:
            up.eval(
                "for i = 1, 200 do box.space.users:replace{i, 'spark' .. i, i} end "
                "box.space.users:update(5, {{'+', 3, 1000}}) box.space.users:delete(7)"
            )

            def rows() -> set:
                return {tuple(r) for r in spark.sql("SELECT id, name, age, _op FROM followed").collect()}

            wanted = {
                (5, "spark5", 1005, "mutation"),
                (7, None, None, "deletion"),
                (200, "spark200", 200, "mutation"),
            }
            wait_until("the Tarantool's writes in the stream", lambda: wanted <= rows())
            assert {r[0] for r in rows()} == set(range(1, 201))
            assert dict(spark.table("followed").dtypes)["age"] == "bigint"
        finally:
            query.stop()
            up.close()
            node.stop()


def test_a_bucket_with_no_changes_reads_as_no_rows(spark, tmp_path):
    node = start_node(tmp_path, "empty")
    try:
        df = spark.read.format("sluice").option("nodes", node.address).load()
        assert df.count() == 0
    finally:
        node.stop()


def test_a_topic_reads_as_kafka_rows_in_batch_and_streaming(spark, tmp_path):
    from datetime import datetime, timezone

    from sluice.spark import topic
    from sluice.tank import TankConnection

    node = start_node(tmp_path, "a")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    try:
        with TankConnection(node.tank) as tank:
            tank.create_topic("events", 2)
            tank.produce("events", [b"plain", (b"\xff\x00k", b"binary key")], ts_ms=1_700_000_000_123)
            tank.produce("events", [f"m{i}".encode() for i in range(500)], snappy=True, partition=1)
        df = spark.read.format("sluice").option("nodes", node.address).option("topic", "events").load()
        rows = sorted(df.collect(), key=lambda r: (r.partition, r.offset))
        assert len(rows) == 502
        first, second = rows[0], rows[1]
        assert (first.key, first.value, first.topic, first.partition, first.offset) == (
            None,
            b"plain",
            "events",
            0,
            1,
        )
        assert (second.key, second.value, second.offset) == (b"\xff\x00k", b"binary key", 2)
        stamp = datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=timezone.utc)
        assert first.timestamp.astimezone(timezone.utc) == stamp
        assert [r.value for r in rows[2:]] == [f"m{i}".encode() for i in range(500)]

        def run():
            return (
                spark.readStream.format("sluice")
                .option("nodes", node.address)
                .option("topic", "events")
                .option("startingOffsets", "earliest")
                .option("maxRecordsPerBatch", "200")
                .load()
                .writeStream.format("parquet")
                .option("path", str(out))
                .option("checkpointLocation", str(checkpoint))
                .trigger(availableNow=True)
                .start()
            )

        def sunk():
            return spark.read.schema(topic.spark_schema()).parquet(str(out)).collect()

        q = run()
        assert q.awaitTermination(180) and q.exception() is None
        assert len(sunk()) == 502
        with TankConnection(node.tank) as tank:
            tank.produce("events", [b"later"], partition=0)
        q = run()
        assert q.awaitTermination(180) and q.exception() is None
        got = [(r.partition, r.offset) for r in sunk()]
        assert len(got) == len(set(got)) == 503, "a message was written twice or is missing"
        assert (0, 3) in got

        # A topic whose oldest segment files retention deleted reads from its first message kept.
        with TankConnection(node.tank) as tank:
            tank.create_topic("short", 1, "log.segment.bytes=8192\nlog.retention.bytes=20000")
            for i in range(100):
                tank.produce("short", [b"m%03d" % i + b"x" * 500])
            deadline = time.monotonic() + 20
            while tank.partitions("short")[0][0] == 1:
                assert time.monotonic() < deadline, "retention never ran"
                time.sleep(0.2)
            first_kept, last = tank.partitions("short")[0]
        df = spark.read.format("sluice").option("nodes", node.address).option("topic", "short").load()
        offsets = sorted(r.offset for r in df.collect())
        assert offsets == list(range(first_kept, last + 1))
    finally:
        node.stop()


def test_a_cluster_is_read_from_its_map_in_etcd(spark, tmp_path):
    """Given the cluster's etcd URL, the source plans over the nodes of the map and reads each
    vbucket once (from a replica where there is one)."""
    from sluice.tank import TankConnection
    from test_cluster import EtcdServer, collection, form, stop_all, wait_map
    from test_cluster_topics import produce_following_leaders
    from test_permissions import PASSWORD

    etcd = EtcdServer(tmp_path / "etcd")
    nodes = {}
    try:
        guest = '[users.guest]\ntopics = { "*" = ["read", "write", "admin"] }\n'
        nodes = form(tmp_path, etcd, ["n1", "n2", "n3"], config=guest)
        with collection(nodes["n1"]) as coll:
            for i in range(500):
                coll.upsert(f"k{i}", {"i": i})
        deadline = time.monotonic() + 30
        rows: list = []
        while len(rows) < 500:
            # Replicas may still be applying the last writes.
            assert time.monotonic() < deadline, len(rows)
            df = (
                spark.read.format("sluice")
                .option("nodes", etcd.url)
                .option("user", "repl")
                .option("password", PASSWORD)
                .load()
            )
            rows = df.collect()
        assert sorted(r.key for r in rows) == sorted(f"k{i}" for i in range(500))
        assert {json.loads(bytes(r.value))["i"] for r in rows} == set(range(500))

        # A topic placed over the cluster: each partition read once, from its leader or a copy
        # (a node that holds neither shows it as dead, as a vbucket that is not there).
        with TankConnection(nodes["n1"].tank) as t:
            t.create_topic("events", 6)
        wait_map(etcd, lambda m: "events" in m.get("topics", {}))
        for p in range(6):
            produce_following_leaders(nodes["n1"].tank, "events", [b"message %d" % p], p)
        deadline = time.monotonic() + 30
        while True:
            df = (
                spark.read.format("sluice")
                .option("nodes", etcd.url)
                .option("user", "repl")
                .option("password", PASSWORD)
                .option("topic", "events")
                .load()
            )
            messages = sorted((r.partition, bytes(r.value)) for r in df.collect())
            if len(messages) == 6 or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # the copies may still be catching up
        assert messages == [(p, b"message %d" % p) for p in range(6)]
    finally:
        stop_all(nodes)
        etcd.close()
