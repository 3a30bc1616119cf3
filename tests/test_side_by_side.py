"""Nodes side by side on one machine: a node whose `listen` is not on port 11210 places every
front listener no flag or configuration sets on listen's host at its default port plus (listen's
port - 11210), so that a second node needs only its own --listen, --admin-listen and
--data-dir. Explicit settings, "" (off) among them, win."""

from __future__ import annotations

import socket

import bmemcached
import pytest
from helpers import Node, beside, free_port, is_free, listen_port_with_free_fronts, run_cli
from sluice import _native
from sluice.config import Config
from sluice.options import default_of
from sluice.tank import TankConnection

FRONT_KEYS = ("iproto_listen", "tank_listen", "greenstack_listen")


def fronts(cfg: Config) -> dict[str, str]:
    return {key: cfg.values[key] for key in FRONT_KEYS}


def test_the_fronts_follow_listen_unless_set():
    defaults = fronts(Config.from_dict({}))
    assert defaults == {k: _native.DEFAULTS[k] for k in FRONT_KEYS}
    # On the default port nothing moves, whatever the host.
    assert fronts(Config.from_dict({}).with_overrides(listen="127.0.0.2:11210")) == defaults
    moved = Config.from_dict({}).with_overrides(listen="127.0.0.1:11310")
    assert fronts(moved) == {
        "iproto_listen": "127.0.0.1:3401",
        "tank_listen": "127.0.0.1:11111",
        "greenstack_listen": "127.0.0.1:11320",
    }
    assert moved.fronts_beside_listen() == fronts(moved)
    assert moved.values["admin_listen"] == default_of("admin_listen"), "admin is not a front"
    # listen's host, any address family.
    assert Config.from_dict({}).with_overrides(listen="[::1]:11211").values["tank_listen"] == "[::1]:11012"
    # Port 0 (a free one) gives each front a free one.
    assert set(fronts(Config.from_dict({}).with_overrides(listen="127.0.0.1:0")).values()) == {"127.0.0.1:0"}


def test_an_explicit_setting_wins():
    # A flag, "" (off) included.
    cfg = Config.from_dict({}).with_overrides(listen="127.0.0.1:11310", tank_listen="", iproto_listen="h:1")
    assert fronts(cfg) == {"iproto_listen": "h:1", "tank_listen": "", "greenstack_listen": "127.0.0.1:11320"}
    assert set(cfg.fronts_beside_listen()) == {"greenstack_listen"}
    # The file, also when it sets a front to its default address.
    doc = {"listen": "127.0.0.1:11310", "iproto_listen": "127.0.0.1:3301", "greenstack_listen": ""}
    cfg = Config.from_dict(doc)
    assert fronts(cfg) == {
        "iproto_listen": "127.0.0.1:3301",
        "tank_listen": "127.0.0.1:11111",
        "greenstack_listen": "",
    }
    # A --listen given over the file's moves the fronts the file leaves unset, and only them.
    cfg = Config.from_dict(doc, place_fronts=False).with_overrides(listen="127.0.0.1:11410")
    assert fronts(cfg) == {
        "iproto_listen": "127.0.0.1:3301",
        "tank_listen": "127.0.0.1:11211",
        "greenstack_listen": "",
    }


def test_tls_listen_auto_follows_too_and_the_other_tls_listeners_stay_off(tmp_path):
    tls = {"tls": {"certificate": "c.pem", "key": "k.pem"}}
    cfg = Config.from_dict(tls).with_overrides(listen="127.0.0.1:11310")
    assert cfg.server_settings()["tls_listeners"] == {
        "tls_listen": "127.0.0.1:11307",
        "iproto_tls_listen": "",
        "tank_tls_listen": "",
        "greenstack_tls_listen": "",
    }
    assert cfg.fronts_beside_listen()["tls_listen"] == "127.0.0.1:11307"
    chosen = Config.from_dict({**tls, "tls_listen": "127.0.0.1:9999"}).with_overrides(
        listen="127.0.0.1:11310"
    )
    assert chosen.server_settings()["tls_listeners"]["tls_listen"] == "127.0.0.1:9999"
    assert Config.from_dict({}).with_overrides(listen="127.0.0.1:11310").fronts_beside_listen().keys() == set(
        FRONT_KEYS
    ), "no TLS listener without a certificate"


@pytest.mark.parametrize(
    ("listen", "key", "port"),
    [("127.0.0.1:5000", "iproto_listen", -2909), ("127.0.0.1:65530", "greenstack_listen", 65540)],
)
def test_a_front_placed_out_of_range_is_an_error_naming_it(tmp_path, listen, key, port):
    with pytest.raises(_native.ConfigError) as e:
        Config.from_dict({}).with_overrides(listen=listen)
    assert f"invalid config: {key}: listen {listen} places it at port {port}" in str(e.value)
    assert f"--{key.replace('_', '-')} HOST:PORT" in str(e.value)
    r = run_cli("serve", "--data-dir", str(tmp_path / "d"), "--listen", listen, "--admin-listen", "")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"sluice: invalid config: {key}: listen {listen}")
    # The file's own setting, and a flag over the file, give the front its place ("" here: off).
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'listen = "{listen}"\n')
    r = run_cli("config", "check", str(cfg))
    assert r.returncode == 2 and f"invalid config: {key}: listen {listen}" in r.stderr, r.stderr
    cfg.write_text(f'listen = "{listen}"\n{key} = ""\n')
    r = run_cli("config", "check", str(cfg))
    assert r.returncode == 0, r.stderr
    file = Config.from_dict({"listen": listen}, place_fronts=False)
    assert file.with_overrides(**{key: ""}).values[key] == ""


def greeting(address: str) -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        return s.recv(128)


def test_two_nodes_on_one_machine_with_only_listen_admin_listen_and_data_dir(tmp_path):
    nodes: list[Node] = []
    try:
        for name in ("one", "two"):
            # Checked free just before the start: other tests take ports meanwhile.
            port = listen_port_with_free_fronts()
            nodes.append(
                Node(
                    tmp_path / name,
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--admin-listen",
                    f"127.0.0.1:{free_port()}",
                    free_fronts=False,
                )
            )
        for i, node in enumerate(nodes):
            placed = {name: f"127.0.0.1:{p}" for name, p in beside(node.port).items()}
            assert (node.iproto, node.tank, node.greenstack) == (
                placed["iproto"],
                placed["tank"],
                placed["greenstack"],
            ), node.lines
            log = "".join(node.lines)
            assert f"the listeners not set are placed beside listen {node.address}" in log, log
            assert f"iproto_listen {placed['iproto']}" in log, log
            # Each node serves its own data on each of its ports.
            client = bmemcached.Client([node.address])
            assert client.set("whose", f"node {i}")
            assert greeting(node.iproto).startswith(b"Tarantool"), "an iproto greeting"
            with TankConnection(node.tank) as tank:
                assert tank.topics() == []
        for i, node in enumerate(nodes):
            assert bmemcached.Client([node.address]).get("whose") == f"node {i}"
            assert node.status()["listen"] == node.address
        assert nodes[0].admin != nodes[1].admin
    finally:
        for node in nodes:
            assert node.stop() == 0, node.log()[-2000:]


def test_a_placed_front_that_is_taken_says_where_it_came_from(tmp_path):
    port = listen_port_with_free_fronts()
    iproto = beside(port)["iproto"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", iproto))
        taken.listen()
        r = run_cli(
            "serve",
            "--data-dir",
            str(tmp_path / "d"),
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{free_port()}",
        )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{iproto} (iproto_listen): Address already in use" in last, last
    assert f"iproto_listen was placed beside listen 127.0.0.1:{port}" in last, last
    assert is_free(port), "nothing is left listening"
