"""The ATTACH grant probe of visibility=auto on a real ClickHouse server, with a user and
a role made for the test (the embedded engine has no writable user storage: its grants
are tested from a users.xml, tests/integration/test_visibility_grant.py).

Point ``TXSINK_REAL_URL`` (http://host:8123) at a server whose user (``TXSINK_REAL_USER``
/ ``TXSINK_REAL_PASSWORD``, default ``default``) may manage access (``CREATE USER``,
``CREATE ROLE``, ``GRANT ... WITH GRANT OPTION``), e.g. the one ``docker compose up -d``
starts. Without one, or when it does not answer or may not manage access, the test is
skipped with that reason (never counted as passed). No Keeper and no Spark are needed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import uuid
from urllib.parse import urlparse

import pytest

from txsink.clickhouse.client import connect
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.config import WriterConfig
from txsink.errors import TxSinkError
from txsink.spark import validate

pytestmark = [pytest.mark.realserver]

URL = os.environ.get("TXSINK_REAL_URL", "")
ADMIN = os.environ.get("TXSINK_REAL_USER", "default")
ADMIN_PASSWORD = os.environ.get("TXSINK_REAL_PASSWORD", "")


def _skip_reason() -> str | None:
    if not URL:
        return "no real server: set TXSINK_REAL_URL (docker compose up -d)"
    u = urlparse(URL)
    try:
        with socket.create_connection((u.hostname or "", u.port or 8123), timeout=2):
            return None
    except OSError:
        return f"real ClickHouse {URL} does not answer"


REASON = _skip_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_a_role_that_may_move_but_not_attach_makes_auto_choose_partition_until_granted() -> None:
    admin = connect(URL, ADMIN, ADMIN_PASSWORD)
    tag = uuid.uuid4().hex[:8]
    db, staging, user, role = f"vg_{tag}", f"vg_{tag}_stg", f"vg_{tag}_u", f"vg_{tag}_r"
    password = secrets.token_hex(12)
    try:
        admin.command(f"CREATE USER {user} IDENTIFIED WITH sha256_password BY '{password}'")
    except TxSinkError as exc:
        admin.close()
        pytest.skip(f"user {ADMIN} on {URL} may not create users: {exc}")
    try:
        admin.command(f"CREATE ROLE {role}")
        for sql in (
            f"CREATE DATABASE {db}",
            f"CREATE DATABASE {staging}",
            f"CREATE TABLE {db}.t (id Int64, p Int32) ENGINE = MergeTree PARTITION BY p "
            "ORDER BY id",
            # partition visibility's grants, through a role and wildcards
            f"GRANT SELECT, INSERT, ALTER MOVE PARTITION ON {db}.* TO {role}",
            f"GRANT CREATE TABLE, DROP TABLE, SELECT, INSERT, ALTER, OPTIMIZE ON {staging}.* "
            f"TO {role}",
            f"GRANT SYSTEM FLUSH LOGS ON *.* TO {role}",
            f"GRANT SELECT ON system.query_log TO {role}",
            f"GRANT {role} TO {user}",
            f"ALTER USER {user} DEFAULT ROLE {role}",
        ):
            admin.command(sql)
        cfg = WriterConfig.from_options(
            {"url": URL, "keeper": "unused:2181", "table": f"{db}.t", "job": f"vg-{tag}",
             "user": user, "password": password, "staging_database": staging}
        )  # fmt: skip
        wh = ClickHouseWarehouse(connect(URL, user, password), staging_db=staging)
        try:
            info = wh.target_info(f"{db}.t")
            said = wh.attach_refusal(f"{db}.t")
            assert "Not enough privileges" in said and "ALTER DELETE" in said, said
            assert validate.chosen_visibility(cfg, info, "attach", wh) == "partition"
            admin.command(f"GRANT ALTER DELETE ON {db}.* TO {role}")  # wildcard, via the role
            assert wh.attach_refusal(f"{db}.t") == ""
            validate._grant_cache.clear()  # auto asks again GRANT_CACHE_SECONDS later
            assert validate.chosen_visibility(cfg, info, "attach", wh) == "batch"
        finally:
            wh.client.close()
        assert admin.query_rows(f"SELECT count() FROM {db}.t") == [(0,)]
        assert admin.query_rows(
            "SELECT count() FROM system.tables WHERE name LIKE 'txsink_probe%'"
        ) == [(0,)]
    finally:
        for sql in (
            f"DROP DATABASE IF EXISTS {db} SYNC",
            f"DROP DATABASE IF EXISTS {staging} SYNC",
            f"DROP USER IF EXISTS {user}",
            f"DROP ROLE IF EXISTS {role}",
        ):
            with contextlib.suppress(TxSinkError):
                admin.command(sql)
        admin.close()
