"""Tarantool's own client against sluice: tests/netbox_compare.lua, run by the `tarantool` binary,
uses net.box (connect with a password, ping, insert, replace, update, upsert, delete, select and
get with every iterator, limits, offsets, partial keys and the errors) and prints each result as a
JSON line. The same script runs against a real Tarantool 2.6 declaring the same spaces
(tests/tarantool_peer.py) and against `sluice serve`; the two outputs must be equal line for line,
error codes and messages included."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import Node
from tarantool_peer import PASSWORD, TARANTOOL, TARANTOOL_MISSING, USER, TarantoolPeer, sluice_config

pytestmark = pytest.mark.skipif(TARANTOOL is None, reason=TARANTOOL_MISSING)

SCRIPT = Path(__file__).with_name("netbox_compare.lua")


def run_script(address: str, work_dir: Path) -> list[dict]:
    """The script's JSON lines against the server at `address`."""
    assert TARANTOOL is not None
    work_dir.mkdir()
    r = subprocess.run(
        [TARANTOOL, str(SCRIPT), address, USER, PASSWORD],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=work_dir,
    )
    assert r.returncode == 0, f"net.box script against {address} failed: {r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines()]


@pytest.fixture(scope="module")
def tarantool_lines(tmp_path_factory) -> list[dict]:
    work = tmp_path_factory.mktemp("tarantool")
    with TarantoolPeer(work / "server") as peer:
        return run_script(peer.address, work / "client")


def test_script_covers_every_request_against_tarantool(tarantool_lines):
    """The reference run itself: every request kind answered, and the errors that the
    comparison relies on really are errors (a script that failed early would compare nothing)."""
    steps = {line["step"]: line for line in tarantool_lines}
    assert steps["connect"]["result"] == "active"
    assert steps["ping"]["result"] is True
    assert steps["insert duplicate"]["error"]["code"] == 3
    assert steps["get after upserts"]["result"] == [6, "fay2", 51]
    assert steps["events partial eq"]["result"] == [[1, 1, "login"], [1, 2, "view", "home"], [1, 3, "logout"]]
    assert steps["select no such index"]["error"] == {
        "code": 35,
        "message": "No index #7 is defined in space 'users'",
    }
    assert steps["guest select"]["error"]["code"] == 42
    assert tarantool_lines[-1]["step"] == "no such user", "the script ran to its end"


def test_netbox_sees_the_same_answers_from_sluice(tmp_path, tarantool_lines):
    node = Node(tmp_path / "sluice", "--config", str(sluice_config(tmp_path / "sluice.toml")))
    try:
        sluice_lines = run_script(node.iproto, tmp_path / "client")
    finally:
        assert node.stop() == 0, node.log()[-3000:]
    differences = [
        f"{t['step']}:\n  tarantool: {json.dumps(t)}\n  sluice:    {json.dumps(s)}"
        for t, s in zip(tarantool_lines, sluice_lines, strict=False)
        if t != s
    ]
    assert len(sluice_lines) == len(tarantool_lines), (
        f"{len(sluice_lines)} lines from sluice, {len(tarantool_lines)} from tarantool; "
        f"sluice's last: {sluice_lines[-1:]}"
    )
    assert not differences, f"{len(differences)} answers differ:\n" + "\n".join(differences)
