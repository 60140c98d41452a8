"""Driver-side validation of the ClickHouse settings a writer sends: txsink's own insert
settings, those its options ``settings.<name>`` add, and those of the statements after a
PREPARE, each against the writer's user's profile and settings constraints
(``system.settings`` read as that user), before anything is written.

Part of :mod:`txsink.spark.validate` (which calls :func:`check_insert_settings` once the
mode is known); the decisions are :mod:`txsink.clickhouse.insert_settings`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from txsink.clickhouse.insert_settings import (
    DEDUP_INSERT_SETTINGS,
    KEEPERMAP_SETTINGS,
    STAGING_INSERT_SETTINGS,
    after_prepare_settings,
    insert_settings_problems,
    passthrough_problems,
    statement_settings_problems,
)
from txsink.config import WriterConfig
from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)

log = logging.getLogger(__name__)


def check_insert_settings(config: WriterConfig, warehouse: Any, mode: str) -> None:
    """Refuse, before anything is written, a writer whose user cannot run txsink's inserts
    with the settings they rely on, or send the settings of the statements that follow a
    PREPARE (:func:`~txsink.clickhouse.insert_settings.after_prepare_settings`: the
    ATTACH of visibility=batch, the state store's writes with state=clickhouse)
    (:func:`~txsink.clickhouse.insert_settings.insert_settings_problems` over
    ``system.settings`` read as that user), or with the settings its options
    ``settings.<name>`` add (a name the server does not know, with a did-you-mean; a
    value a constraint forbids: :func:`~txsink.clickhouse.insert_settings.passthrough_problems`);
    log the profile defaults txsink overrides (``deduplicate_insert='disable'`` and the
    like)."""
    wanted = STAGING_INSERT_SETTINGS if mode == "attach" else DEDUP_INSERT_SETTINGS
    user = config.user or "default"
    given = dict(config.settings)
    later = after_prepare_settings(mode, config.visibility, config.state)
    for k, server in enumerate(getattr(warehouse, "shards", None) or [warehouse]):
        client = server.client
        # the state store lives on url, the first server; a publish is on every one
        here = [s for s in later if k == 0 or s[2] is not KEEPERMAP_SETTINGS]
        effective = client.effective_settings(
            [*wanted, "readonly", *given, *(n for _, _, names in here for n in names)]
        )
        problems = insert_settings_problems(effective, wanted, user=user, mode=mode)
        if problems:
            raise ConfigError(
                f"job {config.job}: the settings of ClickHouse user {user} on {client.url} "
                f"would break the exactly-once guarantee of {mode} mode for {config.table}; "
                f"nothing was written:\n  - " + "\n  - ".join(problems)
            )
        problems = [
            p
            for sender, fix, settings in here
            for p in statement_settings_problems(
                effective, settings, user=user, sender=sender, fix=fix
            )
        ]
        if problems:
            raise ConfigError(
                f"job {config.job}: ClickHouse user {user} on {client.url} may not send "
                f"settings txsink sends after a batch is PREPARED: every batch into "
                f"{config.table} would stop there, and neither the writer nor `txsink "
                f"recover` could finish it; nothing was written:\n  - " + "\n  - ".join(problems)
            )
        mine = {n: v for n, v in effective.items() if n in given}
        known = client.setting_names() if set(given) - set(mine) else ()
        problems = passthrough_problems(mine, given, user=user, known=known)
        if given and not problems:
            problems = _probe_settings(client, given)
        if problems:
            raise ConfigError(
                f"job {config.job}: ClickHouse on {client.url} would refuse the settings "
                f"given as options for the inserts into {config.table} (user {user}); "
                f"nothing was written:\n  - " + "\n  - ".join(problems)
            )
        overridden = sorted(
            f"{n}={v.value}"
            for n, v in effective.items()
            if n in wanted and v.changed and str(wanted[n]) != v.value
        )
        if overridden:
            log.info(
                "job %s: user %s on %s has %s by default; txsink sends its own values with "
                "every insert",
                config.job, user, client.url, ", ".join(overridden),
            )  # fmt: skip


def _probe_settings(client: Any, given: Mapping[str, str]) -> list[str]:
    """The server's own verdict on the values of ``given`` (a value it cannot parse, one
    its constraints forbid): one statement that reads nothing, sent with them."""
    try:
        client.query_rows(
            "SELECT 1", settings=given, what="try the settings given as options (SELECT 1)"
        )
    except (UnavailableError, RetryableConflict, CommitOutcomeUnknown):
        raise  # no verdict on the settings
    except TxSinkError as exc:
        asked = ", ".join(f"settings.{k}={v!r}" for k, v in given.items())
        return [f"the server refused them ({exc}): {asked}"]
    return []
