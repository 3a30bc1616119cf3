"""Who may do what over TANK on a node with users. TANK has no login, so a TANK connection has
the grants of `[users.guest]` (by topic name or prefix, under `topics`), as an iproto session
that sent no AUTH: produce needs write, consume and discovery read, CreateTopic admin. A refused
request gets TANK's own answer (read-only for writes, an unknown topic for reads) and a log
line. A topic's DCP stream needs `stream` on the topic."""

from __future__ import annotations

import pytest
from helpers import start_node
from iproto_helpers import user_table
from sluice import Client, SluiceError
from sluice.tank import TankConnection, TankError

USERS = (
    user_table("app", "secret", '{ default = ["read", "stream"] }')
    + 'topics = { "feed" = ["stream"] }\n'
    + '[users.guest]\ntopics = { "public.*" = ["read", "write", "admin"], "feed" = ["read"] }\n'
    + "[topics.feed]\npartitions = 1\n[topics.secret]\npartitions = 1\n"
)


def test_tank_clients_have_the_guests_topic_grants(tmp_path):
    node = start_node(tmp_path, "n", extra=USERS)
    try:
        with TankConnection(node.tank) as t:
            # admin, write and read on public.*
            t.create_topic("public.news")
            t.produce("public.news", [b"first"])
            assert [m.content for m in t.consume("public.news").messages] == [b"first"]
            # read only on feed: the produce is refused as a read-only broker's
            with pytest.raises(TankError, match="read-only"):
                t.produce("feed", [b"not allowed"])
            assert t.consume("feed").messages == []
            # nothing on secret: as if it did not exist
            with pytest.raises(TankError, match="unknown"):
                t.consume("secret")
            with pytest.raises(TankError, match="read-only"):
                t.create_topic("secret.more")
            assert sorted(name for name, _ in t.topics()) == ["feed", "public.news"]
            assert t.partitions("secret") == []
        line = node.wait_for("refused: TANK clients have the grants of [users.guest]")
        assert "no write permission" in line or "no read permission" in line or "no admin" in line, line
        assert node.metric("sluice_tank_refused_total") >= 4
        # The topic streams over DCP for a user with stream on it, and not for one without.
        with Client(node.address, username="app", password="secret") as c:
            with c.stream(topic="feed", end="now", format="python") as s:
                assert list(s) == []
            with pytest.raises(SluiceError, match="lacks the stream permission on topic"):
                with c.stream(topic="secret", end="now", format="python") as s:
                    list(s)
    finally:
        assert node.stop() == 0, node.log()[-3000:]


def test_with_users_and_no_guest_a_tank_client_gets_nothing(tmp_path):
    extra = user_table("app", "secret", '{ default = ["read"] }') + "[topics.feed]\npartitions = 1\n"
    node = start_node(tmp_path, "n", extra=extra)
    try:
        with TankConnection(node.tank) as t:
            with pytest.raises(TankError, match="read-only"):
                t.produce("feed", [b"anonymous"])
            with pytest.raises(TankError, match="unknown"):
                t.consume("feed")
            assert t.topics() == []
        assert node.status()["topics"][0]["partitions"][0]["high_water_mark"] == 0
    finally:
        assert node.stop() == 0, node.log()[-3000:]
