"""The options registry: every writer option declared once.

Owns each option's name, kind, default, accepted values, environment variable, doc text
and whether txsink sets it itself (``internal``). Everything else is generated from
:data:`OPTIONS`: :meth:`txsink.config.WriterConfig.from_options` parses through it, the
CLI's common flags (:mod:`txsink.cli.common`) take their type, default, variable and
help from it, and ``docs/options.md`` is rendered from it (:mod:`txsink.options_doc`).

Invariants:

- option names are lower case and equal the :class:`~txsink.config.WriterConfig` field
  names (a unit test checks both directions);
- a default is the *text* a user would give (``None``: required); :meth:`Option.parse`
  turns text into the typed value and raises :class:`ConfigError` naming the option and
  what it accepts;
- renames happen elsewhere: every name and default here is part of the option contract.

Pure: reads neither files nor the environment (:mod:`txsink.config` reads the variables).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from txsink.errors import ConfigError
from txsink.names import parse_url, split_table
from txsink.protocol.ids import valid_job


class Kind(enum.Enum):
    """How an option's text becomes its value (and the value's Python type)."""

    TEXT = "text"  # str, as given
    INT = "integer"  # int >= minimum; with optional, empty text is None
    SECONDS = "seconds"  # float > 0 (>= 0 with zero_ok)
    BOOL = "boolean"  # true/false, 1/0, yes/no, on/off
    CHOICE = "choice"  # one of choices, case-insensitive, stored lower case
    LIST = "list"  # comma-separated, blanks dropped -> tuple[str, ...]
    URL = "url"  # http(s)://host:port (names.parse_url), trailing / dropped
    URLS = "urls"  # comma-separated URLs without userinfo -> tuple[str, ...]
    TABLE = "table"  # db.table (names.split_table), kept as given
    JOB = "job"  # a job name (protocol.ids.valid_job)
    USERPASS = "user:password"  # empty, or user:password
    SETTINGS = "name=value,..."  # ClickHouse settings -> tuple[tuple[str, str], ...], by name


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True)
class Option:
    """One writer option. ``default`` is text (None: required, unless the environment
    variable ``env`` supplies it); ``env_in_writer=False`` means only the CLI reads
    ``env`` (the writer never has). ``normalize`` rewrites the text before parsing."""

    name: str
    doc: str
    default: str | None = ""
    kind: Kind = Kind.TEXT
    choices: tuple[str, ...] = ()
    minimum: int = 0
    maximum: int | None = None
    zero_ok: bool = False
    optional: bool = False
    env: str = ""
    env_in_writer: bool = True
    secret: bool = False
    internal: bool = False
    normalize: Callable[[str], str] | None = None

    @property
    def required(self) -> bool:
        return self.default is None

    @property
    def flag(self) -> str:
        """The CLI spelling: ``--keeper-root`` for ``keeper_root``."""
        return "--" + self.name.replace("_", "-")

    def parse(self, raw: str) -> Any:
        """The typed value of ``raw``; ConfigError naming this option otherwise."""
        text = self.normalize(raw) if self.normalize else raw
        return _PARSERS[self.kind](self, text)


def _int(opt: Option, raw: str) -> int | None:
    if opt.optional and not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {opt.name!r} must be an integer, got {raw!r}") from None
    if value < opt.minimum:
        raise ConfigError(f"option {opt.name!r} must be >= {opt.minimum}, got {value}")
    if opt.maximum is not None and value > opt.maximum:
        raise ConfigError(f"option {opt.name!r} must be <= {opt.maximum}, got {value}")
    return value


def _seconds(opt: Option, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"option {opt.name!r} must be a number of seconds, got {raw!r}") from None
    if value < 0 or (value == 0 and not opt.zero_ok):
        raise ConfigError(
            f"option {opt.name!r} must be {'>=' if opt.zero_ok else '>'} 0, got {value}"
        )
    return value


def _bool(opt: Option, raw: str) -> bool:
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"option {opt.name!r} must be true or false, got {raw!r}")


def _choice(opt: Option, raw: str) -> str:
    low = raw.lower()
    if low not in opt.choices:
        match = closest(low, opt.choices)
        hint = f" (did you mean {match}?)" if match else ""
        raise ConfigError(
            f"option {opt.name!r} must be one of {', '.join(opt.choices)}, got {low!r}{hint}"
        )
    return low


def _list(opt: Option, raw: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in raw.split(",") if c.strip())


def _url(opt: Option, raw: str) -> str:
    parse_url(raw, option=opt.name)
    return raw.strip().rstrip("/")


def _urls(opt: Option, raw: str) -> tuple[str, ...]:
    """``http://h1:8123,http://h2:8123`` -> the URLs (no userinfo: credentials go in
    user/password and apply to every server), each once."""
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    for u in urls:
        parse_url(u, option=opt.name, userinfo=False)
    if len(set(urls)) != len(urls):
        raise ConfigError(f"option {opt.name!r} names a shard twice: {', '.join(urls)}")
    return tuple(urls)


def _table(opt: Option, raw: str) -> str:
    split_table(raw, option=opt.name)
    return raw


def _job(opt: Option, raw: str) -> str:
    if not valid_job(raw):
        raise ConfigError(
            f"option {opt.name!r} must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,99}}, got {raw!r}"
        )
    return raw


def _userpass(opt: Option, raw: str) -> str:
    if raw and ":" not in raw:
        raise ConfigError(f"option {opt.name!r} must be user:password")
    return raw


_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def setting_name(opt: str, name: str) -> str:
    """``name`` if it can be a ClickHouse setting name; ConfigError naming ``opt``."""
    if not _SETTING_NAME.fullmatch(name):
        raise ConfigError(
            f"option {opt!r}: {name!r} is not a ClickHouse setting name (letters, digits, _)"
        )
    return name


def _settings(opt: Option, raw: str) -> tuple[tuple[str, str], ...]:
    """``insert_quorum=2, log_comment=etl`` -> the pairs, sorted by name; values are text
    as given (around each entry, blanks are dropped); a name twice is refused."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        name, eq, value = entry.partition("=")
        if not eq:
            raise ConfigError(
                f"option {opt.name!r} takes name=value pairs separated by commas, got {entry!r}"
            )
        name = setting_name(opt.name, name.strip())
        if name in out:
            raise ConfigError(f"option {opt.name!r} names setting {name} twice")
        out[name] = value.strip()
    return tuple(sorted(out.items()))


_PARSERS: dict[Kind, Callable[[Option, str], Any]] = {
    Kind.TEXT: lambda opt, raw: raw,
    Kind.INT: _int,
    Kind.SECONDS: _seconds,
    Kind.BOOL: _bool,
    Kind.CHOICE: _choice,
    Kind.LIST: _list,
    Kind.URL: _url,
    Kind.URLS: _urls,
    Kind.TABLE: _table,
    Kind.JOB: _job,
    Kind.USERPASS: _userpass,
    Kind.SETTINGS: _settings,
}


def _root(raw: str) -> str:
    return "/" + raw.strip("/")


MODES = ("auto", "attach", "dedup")
VISIBILITIES = ("auto", "partition", "batch")
COMPRESSIONS = ("lz4", "zstd", "gzip", "none")
STATES = ("keeper", "clickhouse")
CREATE_TABLE = ("never", "if_missing")
# Spark passes its own writer options through to the data source: ignored, not refused.
SPARK_OWNED = ("path", "checkpointlocation", "queryname")

_DECLARED: tuple[Option, ...] = (
    Option(
        "url",
        "ClickHouse HTTP(S) URL, http(s)://host:port; userinfo (http://user:pass@host:port) "
        "is split off into user/password",
        default=None,
        kind=Kind.URL,
        env="TXSINK_URL",
    ),
    Option("user", "ClickHouse user", default="default", env="TXSINK_USER", env_in_writer=False),
    Option(
        "password",
        "ClickHouse password; never shown or stored",
        env="TXSINK_PASSWORD",
        secret=True,
    ),
    Option("table", "target table, db.table", default=None, kind=Kind.TABLE),
    Option(
        "keeper",
        "Keeper connect string host:port[,host:port][/chroot] (not needed with state=clickhouse)",
        default=None,
        env="TXSINK_KEEPER",
    ),
    Option(
        "state",
        "where the transaction state lives: keeper (ZooKeeper or ClickHouse Keeper at "
        "`keeper`) or clickhouse (KeeperMap tables in `state_database` on the server of "
        "`url`, the first shard's for a sharded job: no Keeper endpoint needed, e.g. "
        "ClickHouse Cloud; docs/cloud.md). Fixed for a job's life",
        default="keeper",
        kind=Kind.CHOICE,
        choices=STATES,
        env="TXSINK_STATE",
    ),
    Option(
        "state_database",
        "database of the state=clickhouse store (its KeeperMap table `nodes`)",
        default="txsink_state",
    ),
    Option(
        "job",
        "stable writer name; one live writer per job",
        default=None,
        kind=Kind.JOB,
        env="TXSINK_JOB",
        env_in_writer=False,
    ),
    Option("mode", "how a batch is written", default="auto", kind=Kind.CHOICE, choices=MODES),
    Option(
        "visibility",
        "with batch, readers of a table see each batch whole or not at all, and a batch "
        "costs the same statements whatever the number of tasks (one ATTACH PARTITION ALL "
        "per table; attach mode, one non-replicated MergeTree server, a readable query "
        "log); auto: batch where it can be honoured, else partition",
        default="auto",
        kind=Kind.CHOICE,
        choices=VISIBILITIES,
    ),
    Option(
        "compact_bytes",
        "visibility=batch on plain MergeTree: a batch whose largest partition stages at most "
        "this many bytes is gathered into one part per partition (one INSERT ... SELECT in "
        "staging) before it is published (0: never; its parts are copied as they are)",
        "1073741824",
        Kind.INT,
    ),
    Option(
        "staging_database",
        "database that holds staging tables (attach mode)",
        default="txsink_staging",
    ),
    Option(
        "keeper_root", "root node of txsink's Keeper layout", default="/txsink", normalize=_root
    ),
    Option(
        "keeper_auth",
        "digest credentials user:password for Keeper ACLs (empty: open ACL); never shown or stored",
        kind=Kind.USERPASS,
        env="TXSINK_KEEPER_AUTH",
        secret=True,
    ),
    Option("keeper_timeout", "Keeper connect/session timeout, seconds", "15", kind=Kind.SECONDS),
    Option(
        "keeper_retry_s",
        "how long a Keeper step is re-run while ZooKeeper is unreachable or the session is "
        "re-established (leader election, restart, expiry), seconds; 0 = fail at once",
        "30",
        kind=Kind.SECONDS,
        zero_ok=True,
    ),
    Option(
        "block_rows", "rows per insert block sent to ClickHouse", "1000000", Kind.INT, minimum=1
    ),
    Option(
        "block_bytes",
        "bytes per insert block (whichever limit is hit first)",
        "268435456",
        Kind.INT,
        minimum=1024,
    ),
    Option("compress", "HTTP insert compression", "lz4", kind=Kind.CHOICE, choices=COMPRESSIONS),
    Option("connect_timeout", "ClickHouse connect timeout, seconds", "10", kind=Kind.SECONDS),
    Option("send_receive_timeout", "ClickHouse send/receive timeout, seconds", "300", Kind.SECONDS),
    Option("verify", "verify the server's TLS certificate (https URLs)", "true", Kind.BOOL),
    Option("ca_cert", "path of a CA bundle for https URLs"),
    Option("retry_attempts", "attempts for transient ClickHouse errors", "5", Kind.INT, minimum=1),
    Option("retry_max_wait", "longest back-off between attempts, seconds", "30", Kind.SECONDS),
    Option(
        "publish_retry_s",
        "how long a commit re-observes and resumes publishing after a ClickHouse failure "
        "whose outcome is unknown (lost reply, reset, server restart), seconds; 0 = fail at "
        "once (the xid stays PREPARED for the next commit or `txsink recover`)",
        "60",
        kind=Kind.SECONDS,
        zero_ok=True,
    ),
    Option(
        "txn_version",
        "batch writes: a version number; a rerun with the same or a lower one is a no-op",
        kind=Kind.INT,
        optional=True,
    ),
    Option(
        "retention",
        "committed xid records kept in Keeper for status/verify",
        "1000",
        Kind.INT,
        minimum=1,
    ),
    Option(
        "dedup_order_by",
        "dedup mode: comma-separated columns to sort each partition by",
        kind=Kind.LIST,
    ),
    Option(
        "dedup_min_window",
        "dedup mode: refuse targets whose dedup window is smaller",
        "100",
        Kind.INT,
        minimum=1,
    ),
    Option(
        "first_batch",
        "streaming: the first micro-batch this job writes, when its checkpoint was written "
        "before under another job name or state store and the query stopped cleanly "
        "(docs/operations.md#new-store)",
        kind=Kind.INT,
        minimum=0,
        optional=True,
    ),
    Option(
        "skip_committed_replays",
        "dedup mode: executors skip writing a replayed, committed batch (attach mode: "
        "the commit skips it and drops what its tasks staged)",
        "true",
        Kind.BOOL,
    ),
    Option("metrics_textfile", "write Prometheus text-format metrics to this file"),
    Option(
        "metrics_port",
        "serve the metrics for Prometheus to scrape on this port of the driver "
        "(http://driver:port/metrics), started by the first commit of a process",
        kind=Kind.INT,
        minimum=1,
        maximum=65535,
        optional=True,
    ),
    Option(
        "shards",
        "a table on several ClickHouse shards: comma-separated shard URLs "
        "(http://h1:8123,http://h2:8123); `table` names the local table on each, one xid "
        "spans them all (attach mode); `url` may be left out (it is the first shard)",
        kind=Kind.URLS,
    ),
    Option(
        "shard_by",
        "with shards: an integer column; a row goes to shard intHash64(column) % number of "
        "shards (what a Distributed table with that sharding key chooses); empty: rows are "
        "spread evenly",
        normalize=str.strip,
    ),
    Option(
        "shard_http_port",
        "with `table=` naming a `Distributed` table (shards found in `system.clusters`): "
        "the HTTP port of every shard's server; empty: the port of `url`",
        kind=Kind.INT,
        minimum=1,
        optional=True,
    ),
    Option(
        "settings",
        "ClickHouse settings for txsink's inserts (staging and dedup-mode blocks), "
        "name=value pairs separated by commas; or one option per setting, "
        "settings.<name>=<value> (a value with a comma). Settings txsink owns are refused "
        "with the reason (see ClickHouse settings below)",
        kind=Kind.SETTINGS,
    ),
    Option(
        "create_table",
        "when the target is missing: if_missing creates it from the DataFrame's schema "
        "(types: docs/types.md#created-tables) with order_by, partition_by, engine and "
        "table_settings, on every shard; never fails (docs/options.md#creating-the-target)",
        default="never",
        kind=Kind.CHOICE,
        choices=CREATE_TABLE,
    ),
    Option(
        "order_by",
        "create_table: the ORDER BY of the created table (required to create one), e.g. "
        "id or customer_id,ts; tuple() for none",
    ),
    Option(
        "partition_by", "create_table: the PARTITION BY of the created table, e.g. toYYYYMM(ts)"
    ),
    Option(
        "engine",
        "create_table: the created table's engine, of the MergeTree family, with its "
        "arguments (ReplacingMergeTree(ver))",
        default="MergeTree",
    ),
    Option(
        "table_settings",
        "create_table: the created table's SETTINGS, name=value,... (index_granularity=8192); "
        "in dedup mode non_replicated_deduplication_window defaults to dedup_min_window",
    ),
    Option(
        "run_id",
        "set by foreach_batch to the streaming query's run id",
        internal=True,
    ),
    Option(
        "micro_batch",
        "set by foreach_batch; txn_version is a streaming batch id (replays repeat only the "
        "newest batch, so an older one is refused, not skipped)",
        "false",
        Kind.BOOL,
        internal=True,
    ),
)

#: name -> option, in declaration order (the order of docs/options.md).
OPTIONS: dict[str, Option] = {o.name: o for o in _DECLARED}

#: spellings users bring from other writers -> txsink's option (lower case, as Spark
#: hands options over): Delta Lake's idempotent-write pair, and names that do not clash
#: with Spark's own ``.mode("append")`` or with the ``verify`` command.
ALIASES: dict[str, str] = {
    "txnversion": "txn_version",  # Delta Lake
    "txnappid": "job",  # Delta Lake: the writer's stable id
    "commit_mode": "mode",
    "tls_verify": "verify",
    # Kafka Connect's ClickHouse sink: its username, and its list of ClickHouse settings
    # ("insert_quorum=2,..."). Not hostname/port/ssl (together they are `url`) nor
    # database (part of `table`): none of them is one txsink option.
    "username": "user",
    "clickhousesettings": "settings",
    # Spark ClickHouse Connector (SCC): its SQL configurations spark.clickhouse.write.*
    # given as options; batchSize is rows per insert, compression.codec none | lz4.
    # Not maxRetry (retries, where retry_attempts counts attempts) nor retryInterval.
    "spark.clickhouse.write.batchsize": "block_rows",
    "spark.clickhouse.write.compression.codec": "compress",
}
#: Prefixes of options that each pass one ClickHouse setting: txsink's ``settings.<name>``
#: and ``clickhouse_setting_<name>``, the prefix of clickhouse-java (the client SCC uses:
#: its catalog's ``option.clickhouse_setting_<name>``).
SETTING_PREFIXES = ("settings.", "clickhouse_setting_")
SECRET_OPTIONS = tuple(o.name for o in _DECLARED if o.secret)


def user_options() -> list[str]:
    """The options a user gives (internal ones left out), in declaration order: the
    lists and suggestions users see."""
    return [name for name, opt in OPTIONS.items() if not opt.internal]


def closest(word: str, known: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The one of ``known`` that ``word`` most looks like, if any is close (the
    did-you-mean of unknown options and unknown ClickHouse settings)."""
    import difflib

    match = difflib.get_close_matches(word, list(known), n=1, cutoff=cutoff)
    return match[0] if match else None


def default_of(name: str) -> Any:
    """The typed default of option ``name`` (for code that runs without a WriterConfig)."""
    opt = OPTIONS[name]
    if opt.default is None:
        raise KeyError(f"option {name!r} is required: it has no default")
    return opt.parse(opt.default)
