"""Input a server must refuse clearly, and errors that must say why: a client sending a server's
request magic, an unknown vbucket state, undefined stream flags, an over-long consumer name; a
flood of bad connections that must not flood the log; and a WAL that cannot write, whose
reason every refused write names."""

from __future__ import annotations

import signal
import socket
import struct
import threading
import time

import pytest
import sluice
from dcp_wire import DcpConnection, frame, stream_req
from helpers import open_engine
from mcbp_wire import GET_ALL_VB_SEQNOS, SET, connect, read_response, request, set_extras

EINVAL = 0x04


def test_a_server_request_magic_from_a_client_is_refused_not_run(server):
    with connect(server) as s:
        s.sendall(request(SET, b"k", b"v", set_extras(), magic=0x82, opaque=7))
        r = read_response(s)
        assert (r["status"], r["opaque"]) == (EINVAL, 7)
        assert b"0x82" in r["value"]
        s.sendall(request(0x00, b"k"))
        assert read_response(s)["status"] == 0x01, "KEY_ENOENT: the SET was not executed"


@pytest.mark.parametrize("on_dcp", [False, True], ids=["kv", "dcp"])
def test_an_unknown_vbucket_state_gets_einval(server, on_dcp):
    bad = request(GET_ALL_VB_SEQNOS, extras=struct.pack(">I", 99))
    if on_dcp:
        c = DcpConnection(server.host, server.port)
        r = c.call(bad)
        status, value = r["word"], r["value"]
        c.close()
    else:
        with connect(server) as s:
            s.sendall(bad)
            r = read_response(s)
            status, value = r["status"], r["value"]
    assert status == EINVAL and b"no such vbucket state" in value, (status, value)


def test_undefined_stream_flags_are_named(server):
    c = DcpConnection(server.host, server.port)
    r = c.call(stream_req(0, flags=0x200 | 0x40000000 | 0x04))
    assert r["word"] == EINVAL
    assert r["value"] == b"undefined STREAM_REQ flag bits 0x40000200"
    assert c.call(stream_req(0, flags=0x04))["word"] == 0, "defined flags still work"
    c.close()


def test_a_consumer_name_over_200_bytes_is_called_too_long(server):
    c = DcpConnection(server.host, server.port)
    r = c.call(frame(0x5E, key=b"consumer_name", value=b"n" * 201))
    assert r["word"] == EINVAL
    assert r["value"] == b"DCP control consumer_name: the value is 201 bytes, over the limit of 200"
    assert c.control("consumer_name", "n" * 200) == 0
    c.close()


def test_bad_connections_are_counted_each_and_logged_once_in_a_while(server):
    for _ in range(30):
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(b"\x85" * 24)  # no magic a client sends (below 0x80 is the text protocol)
            assert s.recv(100) == b"", "closed"
    metrics = server.metrics()
    assert "sluice_protocol_errors_total 30" in metrics
    server.proc.send_signal(signal.SIGTERM)
    server.wait_for("stopped cleanly")  # every line logged before it is in server.lines
    assert server.proc.wait(timeout=30) == 0
    warned = [line for line in server.lines if "closing connection from" in line]
    assert len(warned) == 1, warned


def test_every_refused_write_names_why_the_wal_cannot_write(data_dir):
    """The flag that refuses writes and the reason it gives are one: the moment the writer
    starts failing, every refusal says why (here ENOSPC from the failpoint)."""
    reasons: list[str] = []
    stop = threading.Event()
    with open_engine(data_dir, wal__mode="write") as e:

        def hammer() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    e.set(b"w%d" % i, b"x")
                except sluice.TempFailError as err:
                    reasons.append(str(err))
                except sluice.WalFailedError:
                    pass

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(20):
            e.set_wal_failpoint("enospc")
            time.sleep(0.02)
            e.set_wal_failpoint("off")
            time.sleep(0.02)
        stop.set()
        for t in threads:
            t.join()
    refused = [r for r in reasons if "WAL cannot write" in r]
    assert refused, reasons[:5]
    assert all("No space left" in r for r in refused), [r for r in refused if "No space" not in r][:5]
