"""Writer options parsed into one frozen object: :class:`WriterConfig`.

``WriterConfig.from_options`` is called on the driver with the options a user gave to
``.option(...)`` / ``foreach_batch(**options)``. Every option is declared once in
:mod:`txsink.options` (kind, default, variable, doc); this module applies the registry
and the rules that relate options to each other (environment fallbacks, credentials in
the URL, shards). Errors name the bad key. The frozen result is pickled to executors and
to the commit worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from txsink.clickhouse.insert_settings import refused_setting
from txsink.credentials import MASK, merge_url_credentials, redact_url
from txsink.errors import ConfigError
from txsink.names import split_table
from txsink.options import (
    ALIASES,
    OPTIONS,
    SECRET_OPTIONS,
    SETTING_PREFIXES,
    SPARK_OWNED,
    Option,
    closest,
    setting_name,
    user_options,
)

__all__ = ["OPTIONS", "WriterConfig"]


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
    state: str
    state_database: str
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
    first_batch: int | None = None  # streaming: the job's own micro-batches start here
    visibility: str = "auto"  # validation resolves it to partition or batch
    compact_bytes: int = 1 << 30
    shards: tuple[str, ...] = ()  # shard URLs (no userinfo); () = one server, `url`
    shard_by: str = ""
    shard_http_port: int | None = None
    metrics_port: int | None = None
    # ClickHouse settings for txsink's inserts (settings.<name>), sorted by name
    settings: tuple[tuple[str, str], ...] = ()
    create_table: str = "never"
    order_by: str = ""
    partition_by: str = ""
    engine: str = "MergeTree"
    table_settings: str = ""

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
        return split_table(self.table)[0]

    @property
    def table_name(self) -> str:
        return split_table(self.table)[1]

    @staticmethod
    def from_options(options: Mapping[str, Any]) -> WriterConfig:
        given = {str(k).lower(): ("" if v is None else str(v)) for k, v in options.items()}
        for key in SPARK_OWNED:  # Spark passes its own writer options through
            given.pop(key, None)
        given = _resolve_aliases(given)
        given, per_setting = _split_settings(given)
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            hints = [f"{u} (did you mean {m}?)" if (m := _closest(u)) else u for u in unknown]
            raise ConfigError(
                f"unknown option(s) {', '.join(hints)}; known options: "
                f"{', '.join(sorted(user_options()))}, settings.<name> (see docs/options.md)"
            )
        shards = OPTIONS["shards"].parse(given.get("shards", ""))
        if shards and not given.get("url"):  # a sharded writer's url is its first shard
            given["url"] = shards[0]
        raw: dict[str, str] = {}
        for opt in OPTIONS.values():
            text = given.get(opt.name)
            # An option wins over its variable; an empty option counts as not given.
            if opt.env and opt.env_in_writer and not text:
                text = os.environ.get(opt.env) or None
            if opt.required and not text and not _not_needed(opt, given):
                raise ConfigError(f"option {opt.name!r} is required: {_required_doc(opt)}")
            raw[opt.name] = text if text is not None else (opt.default or "")
        # The url's userinfo must agree with a user/password given another way.
        creds = merge_url_credentials(
            raw["url"], given.get("user") or None, raw["password"] or None
        )
        raw["url"] = creds.url
        raw["password"] = creds.password or ""
        if creds.user is not None:
            raw["user"] = creds.user
        values = {name: OPTIONS[name].parse(text) for name, text in raw.items()}
        values["settings"] = _merge_settings(values["settings"], per_setting)
        _check_shards(values)
        _check_create(values)
        return WriterConfig(**values)

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
            if f.name == "settings":  # one option per setting: a value may hold a comma
                out.update((f"settings.{k}", v) for k, v in value)
                continue
            if isinstance(value, bool):
                value = "true" if value else "false"
            elif isinstance(value, tuple):
                value = ",".join(value)
            out[f.name] = str(value)
        return out


def _resolve_aliases(given: dict[str, str]) -> dict[str, str]:
    """Options given by an alias (:data:`txsink.options.ALIASES`) under their own name; an
    alias and its option both given with different values are refused, naming both."""
    out = {k: v for k, v in given.items() if k not in ALIASES}
    for alias, name in ALIASES.items():
        if alias not in given:
            continue
        value = given[alias]
        if out.get(name, value) != value:
            raise ConfigError(
                f"option {alias!r} is another name for {name!r}, and they were given "
                f"different values ({value!r}, {out[name]!r}): give one of them"
            )
        out[name] = value
    return out


def _closest(unknown: str) -> str | None:
    """The option (or alias) a user gives that an unknown one most looks like, if any is
    close; internal options are never suggested."""
    match = closest(unknown, [*user_options(), *ALIASES])
    if match is None:
        return None
    return match if match in OPTIONS else f"{match} ({ALIASES[match]})"


def _split_settings(given: dict[str, str]) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``given`` without the options that each pass one ClickHouse setting
    (:data:`~txsink.options.SETTING_PREFIXES`), and those as setting -> (value, the
    option's key). One setting under two keys with different values is refused."""
    rest: dict[str, str] = {}
    found: dict[str, tuple[str, str]] = {}
    for key, value in given.items():
        prefix = next((p for p in SETTING_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            rest[key] = value
            continue
        name = setting_name(key, key[len(prefix) :])
        if name in found and found[name][0] != value:
            raise ConfigError(
                f"ClickHouse setting {name} is given twice with different values "
                f"({found[name][1]}={found[name][0]!r}, {key}={value!r}): give it once"
            )
        found[name] = (value, key)
    return rest, found


def _merge_settings(
    listed: tuple[tuple[str, str], ...], per_setting: Mapping[str, tuple[str, str]]
) -> tuple[tuple[str, str], ...]:
    """The option ``settings`` (a list) and the ``settings.<name>`` options as one sorted
    tuple; the same setting in both with different values, and every setting txsink must
    own (:func:`txsink.clickhouse.insert_settings.refused_setting`), refused."""
    merged = dict(listed)
    for name, (value, key) in per_setting.items():
        if merged.get(name, value) != value:
            raise ConfigError(
                f"ClickHouse setting {name} is given twice with different values "
                f"(settings: {name}={merged[name]!r}, {key}={value!r}): give it once"
            )
        merged[name] = value
    refused = [(name, why) for name in sorted(merged) if (why := refused_setting(name))]
    if refused:
        raise ConfigError(
            "refused ClickHouse setting(s) for txsink's inserts; nothing was written:\n  - "
            + "\n  - ".join(f"settings.{name}: {why}" for name, why in refused)
            + "\nRemove them (docs/options.md#clickhouse-settings lists what is refused "
            "and why)"
        )
    return tuple(sorted(merged.items()))


def _not_needed(opt: Option, given: Mapping[str, str]) -> bool:
    """``keeper`` is required unless the state lives in ClickHouse."""
    state = given.get("state") or os.environ.get("TXSINK_STATE") or ""
    return opt.name == "keeper" and state.strip().lower() == "clickhouse"


def _required_doc(opt: Option) -> str:
    return f"{opt.doc} (env {opt.env})" if opt.env and opt.env_in_writer else opt.doc


def _check_shards(values: Mapping[str, Any]) -> None:
    """The rules between url, shards, shard_by and shard_http_port."""
    shards, url = values["shards"], values["url"]
    if shards and url not in shards:
        raise ConfigError(
            f"option 'url' ({redact_url(url)}) is not one of the shards "
            f"({', '.join(shards)}); leave url out with shards, or name one of them"
        )
    if values["shard_by"] and not shards:
        raise ConfigError(
            "option 'shard_by' needs 'shards' (the shard URLs); a Distributed table "
            "given as table= brings its own sharding key"
        )
    if values["shard_http_port"] and shards:
        raise ConfigError(
            "option 'shard_http_port' is for shards discovered from a Distributed table; "
            "with 'shards' each URL carries its port"
        )


def _check_create(values: Mapping[str, Any]) -> None:
    """The table-creation options are well-formed (checked even while the target exists:
    a mistake should not wait for the day the table is missing)."""
    from txsink.clickhouse.target_ddl import check_options

    check_options(
        engine=values["engine"],
        order_by=values["order_by"],
        partition_by=values["partition_by"],
        table_settings=values["table_settings"],
    )
