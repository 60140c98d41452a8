"""Writer options: every key, its default and its parsing, in one place.

``WriterConfig.from_options`` is called on the driver with the options a user gave to
``.option(...)`` / ``foreach_batch(**options)``; errors name the bad key. The frozen
result is pickled to executors and to the commit worker. docs/options.md documents
every key listed in ``OPTIONS`` (a unit test checks that it does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlparse

from txsink.credentials import MASK, merge_url_credentials, redact_url
from txsink.errors import ConfigError
from txsink.protocol.ids import valid_job

# key -> (default, help). A default of None means required (or taken from the environment).
OPTIONS: dict[str, tuple[str | None, str]] = {
    "url": (
        None,
        "ClickHouse HTTP(S) URL, http(s)://host:port (env TXSINK_URL); userinfo "
        "(http://user:pass@host:port) is split off into user/password",
    ),
    "user": ("default", "ClickHouse user"),
    "password": ("", "ClickHouse password (env TXSINK_PASSWORD); never shown or stored"),
    "table": (None, "target table, db.table"),
    "keeper": (None, "Keeper connect string host:port[,host:port][/chroot] (env TXSINK_KEEPER)"),
    "job": (None, "stable writer name; one live writer per job"),
    "mode": ("auto", "auto | attach | dedup"),
    "visibility": (
        "partition",
        "partition | batch: with batch, readers of a table see each batch whole or not at "
        "all (one ATTACH PARTITION ALL per table; attach mode, non-replicated MergeTree)",
    ),
    "staging_database": ("txsink_staging", "database that holds staging tables (attach mode)"),
    "keeper_root": ("/txsink", "root node of txsink's Keeper layout"),
    "keeper_auth": (
        "",
        "digest credentials user:password for Keeper ACLs (env TXSINK_KEEPER_AUTH; empty: "
        "open ACL); never shown or stored",
    ),
    "keeper_timeout": ("15", "Keeper connect/session timeout, seconds"),
    "keeper_retry_s": (
        "30",
        "how long a Keeper step is re-run while ZooKeeper is unreachable or the session is "
        "re-established (leader election, restart, expiry), seconds; 0 = fail at once",
    ),
    "block_rows": ("1000000", "rows per insert block sent to ClickHouse"),
    "block_bytes": ("268435456", "bytes per insert block (whichever limit is hit first)"),
    "compress": ("lz4", "HTTP insert compression: lz4 | zstd | gzip | none"),
    "connect_timeout": ("10", "ClickHouse connect timeout, seconds"),
    "send_receive_timeout": ("300", "ClickHouse send/receive timeout, seconds"),
    "verify": ("true", "verify the server's TLS certificate (https URLs)"),
    "ca_cert": ("", "path of a CA bundle for https URLs"),
    "retry_attempts": ("5", "attempts for transient ClickHouse errors"),
    "retry_max_wait": ("30", "longest back-off between attempts, seconds"),
    "publish_retry_s": (
        "60",
        "how long a commit re-observes and resumes publishing after a ClickHouse failure "
        "whose outcome is unknown (lost reply, reset, server restart), seconds; 0 = fail at "
        "once (the xid stays PREPARED for the next commit or `txsink recover`)",
    ),
    "txn_version": (
        "",
        "batch writes: a version number; a rerun with the same or a lower one is a no-op",
    ),
    "retention": ("1000", "committed xid records kept in Keeper for status/verify"),
    "dedup_order_by": ("", "dedup mode: comma-separated columns to sort each partition by"),
    "dedup_min_window": ("100", "dedup mode: refuse targets whose dedup window is smaller"),
    "skip_committed_replays": ("true", "executors skip writing a replayed, committed batch"),
    "metrics_textfile": ("", "write Prometheus text-format metrics to this file"),
    "shards": (
        "",
        "a table on several ClickHouse shards: comma-separated shard URLs "
        "(http://h1:8123,http://h2:8123); `table` names the local table on each, one xid "
        "spans them all (attach mode); `url` may be left out (it is the first shard)",
    ),
    "shard_by": (
        "",
        "with shards: an integer column; a row goes to shard intHash64(column) % number of "
        "shards (what a Distributed table with that sharding key chooses); empty: rows are "
        "spread evenly",
    ),
    "shard_http_port": (
        "",
        "with table= naming a Distributed table (shards discovered from system.clusters): "
        "the HTTP port of every shard's server; empty: the port of `url`",
    ),
    "run_id": ("", "internal: set by foreach_batch to the streaming query's run id"),
    "micro_batch": (
        "false",
        "internal: set by foreach_batch; txn_version is a streaming batch id (replays repeat "
        "only the newest batch, so an older one is refused, not skipped)",
    ),
}
SPARK_OWNED = ("path", "checkpointlocation", "queryname")
SECRET_OPTIONS = ("password", "keeper_auth")
MODES = ("auto", "attach", "dedup")
VISIBILITIES = ("partition", "batch")
COMPRESSIONS = ("lz4", "zstd", "gzip", "none")


def _int(key: str, raw: str, minimum: int = 0) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {key!r} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(f"option {key!r} must be >= {minimum}, got {value}")
    return value


def _float(key: str, raw: str, *, zero_ok: bool = False) -> float:
    """A number of seconds, > 0 (or >= 0 with ``zero_ok``: 0 turns the thing off)."""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"option {key!r} must be a number of seconds, got {raw!r}") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"option {key!r} must be {'>=' if zero_ok else '>'} 0, got {value}")
    return value


def _bool(key: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"option {key!r} must be true or false, got {raw!r}")


@dataclass(frozen=True, repr=False)
class WriterConfig:
    """The parsed options of one writer. ``url`` never holds userinfo (split off into
    ``user``/``password``); the repr masks ``password`` and ``keeper_auth``."""

    url: str
    user: str
    password: str
    table: str
    keeper: str
    job: str
    mode: str
    staging_database: str
    keeper_root: str
    keeper_auth: str
    keeper_timeout: float
    keeper_retry_s: float
    block_rows: int
    block_bytes: int
    compress: str
    connect_timeout: float
    send_receive_timeout: float
    verify: bool
    ca_cert: str
    retry_attempts: int
    retry_max_wait: float
    publish_retry_s: float
    txn_version: int | None
    retention: int
    dedup_order_by: tuple[str, ...]
    dedup_min_window: int
    skip_committed_replays: bool
    metrics_textfile: str
    run_id: str
    micro_batch: bool = False
    visibility: str = "partition"
    shards: tuple[str, ...] = ()  # shard URLs (no userinfo); () = one server, `url`
    shard_by: str = ""
    shard_http_port: int | None = None

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in SECRET_OPTIONS:
                shown.append(f"{f.name}={MASK if value else ''!r}")
            elif f.name == "url":
                shown.append(f"url={redact_url(value)!r}")
            else:
                shown.append(f"{f.name}={value!r}")
        return f"WriterConfig({', '.join(shown)})"

    @property
    def database(self) -> str:
        return self.table.split(".", 1)[0]

    @property
    def table_name(self) -> str:
        return self.table.split(".", 1)[1]

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> WriterConfig:
        given = {str(k).lower(): ("" if v is None else str(v)) for k, v in options.items()}
        for key in SPARK_OWNED:  # Spark passes its own writer options through
            given.pop(key, None)
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; known options: "
                f"{', '.join(sorted(OPTIONS))} (see docs/options.md)"
            )
        raw = {k: given.get(k, d if d is not None else "") for k, (d, _) in OPTIONS.items()}
        shards = parse_shards(raw["shards"])
        raw["url"] = raw["url"] or (shards[0] if shards else os.environ.get("TXSINK_URL", ""))
        raw["keeper"] = raw["keeper"] or os.environ.get("TXSINK_KEEPER", "")
        for key in ("url", "table", "keeper", "job"):
            if not raw[key]:
                raise ConfigError(f"option {key!r} is required: {OPTIONS[key][1]}")
        # Secrets: an option wins over the environment; url userinfo must agree with both.
        # (an empty option counts as not given)
        password = given.get("password") or os.environ.get("TXSINK_PASSWORD") or None
        raw["keeper_auth"] = given.get("keeper_auth") or os.environ.get("TXSINK_KEEPER_AUTH", "")
        creds = merge_url_credentials(raw["url"], given.get("user") or None, password)
        raw["url"] = creds.url
        raw["user"] = creds.user if creds.user is not None else raw["user"]
        raw["password"] = creds.password or ""
        url = urlparse(raw["url"])
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(
                f"option 'url' must look like http(s)://host:port, got {redact_url(raw['url'])!r}"
            )
        if raw["table"].count(".") != 1 or not all(raw["table"].split(".")):
            raise ConfigError(f"option 'table' must be db.table, got {raw['table']!r}")
        if not valid_job(raw["job"]):
            raise ConfigError(
                f"option 'job' must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,99}}, got {raw['job']!r}"
            )
        mode = raw["mode"].lower()
        if mode not in MODES:
            raise ConfigError(f"option 'mode' must be one of {', '.join(MODES)}, got {mode!r}")
        visibility = raw["visibility"].lower()
        if visibility not in VISIBILITIES:
            raise ConfigError(
                f"option 'visibility' must be one of {', '.join(VISIBILITIES)}, got {visibility!r}"
            )
        compress = raw["compress"].lower()
        if compress not in COMPRESSIONS:
            raise ConfigError(
                f"option 'compress' must be one of {', '.join(COMPRESSIONS)}, got {compress!r}"
            )
        if raw["keeper_auth"] and ":" not in raw["keeper_auth"]:
            raise ConfigError("option 'keeper_auth' must be user:password")
        if shards and raw["url"].rstrip("/") not in shards:
            raise ConfigError(
                f"option 'url' ({redact_url(raw['url'])}) is not one of the shards "
                f"({', '.join(shards)}); leave url out with shards, or name one of them"
            )
        if raw["shard_by"] and not shards:
            raise ConfigError(
                "option 'shard_by' needs 'shards' (the shard URLs); a Distributed table "
                "given as table= brings its own sharding key"
            )
        if raw["shard_http_port"] and shards:
            raise ConfigError(
                "option 'shard_http_port' is for shards discovered from a Distributed table; "
                "with 'shards' each URL carries its port"
            )
        return WriterConfig(
            url=raw["url"].rstrip("/"),
            user=raw["user"],
            password=raw["password"],
            table=raw["table"],
            keeper=raw["keeper"],
            job=raw["job"],
            mode=mode,
            staging_database=raw["staging_database"],
            keeper_root="/" + raw["keeper_root"].strip("/"),
            keeper_auth=raw["keeper_auth"],
            keeper_timeout=_float("keeper_timeout", raw["keeper_timeout"]),
            keeper_retry_s=_float("keeper_retry_s", raw["keeper_retry_s"], zero_ok=True),
            block_rows=_int("block_rows", raw["block_rows"], 1),
            block_bytes=_int("block_bytes", raw["block_bytes"], 1024),
            compress=compress,
            connect_timeout=_float("connect_timeout", raw["connect_timeout"]),
            send_receive_timeout=_float("send_receive_timeout", raw["send_receive_timeout"]),
            verify=_bool("verify", raw["verify"]),
            ca_cert=raw["ca_cert"],
            retry_attempts=_int("retry_attempts", raw["retry_attempts"], 1),
            retry_max_wait=_float("retry_max_wait", raw["retry_max_wait"]),
            publish_retry_s=_float("publish_retry_s", raw["publish_retry_s"], zero_ok=True),
            txn_version=_int("txn_version", raw["txn_version"]) if raw["txn_version"] else None,
            retention=_int("retention", raw["retention"], 1),
            dedup_order_by=tuple(c.strip() for c in raw["dedup_order_by"].split(",") if c.strip()),
            dedup_min_window=_int("dedup_min_window", raw["dedup_min_window"], 1),
            skip_committed_replays=_bool("skip_committed_replays", raw["skip_committed_replays"]),
            metrics_textfile=raw["metrics_textfile"],
            run_id=raw["run_id"],
            micro_batch=_bool("micro_batch", raw["micro_batch"]),
            visibility=visibility,
            shards=shards,
            shard_by=raw["shard_by"].strip(),
            shard_http_port=(
                _int("shard_http_port", raw["shard_http_port"], 1)
                if raw["shard_http_port"]
                else None
            ),
        )

    @property
    def shard_urls(self) -> tuple[str, ...]:
        """Every ClickHouse server this writer writes to (``(url,)`` without shards)."""
        return self.shards or (self.url,)

    def to_options(self) -> dict[str, str]:
        """The options that rebuild this config (used by foreach_batch)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, tuple):
                value = ",".join(value)
            out[f.name] = str(value)
        return out


def parse_shards(raw: str) -> tuple[str, ...]:
    """``http://h1:8123,http://h2:8123`` -> the URLs (no userinfo: credentials go in
    user/password and apply to every shard); ConfigError naming a bad one."""
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    for u in urls:
        parsed = urlparse(u)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path:
            raise ConfigError(
                f"option 'shards': {redact_url(u)!r} does not look like http(s)://host:port"
            )
        if "@" in parsed.netloc:
            raise ConfigError(
                "option 'shards': give credentials with user/password (they apply to every "
                "shard), not inside a shard URL"
            )
    if len(set(urls)) != len(urls):
        raise ConfigError(f"option 'shards' names a shard twice: {', '.join(urls)}")
    return tuple(urls)
