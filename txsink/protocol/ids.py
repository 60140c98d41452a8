"""Stable identifiers: every id derives from job, batch, partition and attempt.

A retry of any step recomputes the same ids and so finds what a lost earlier attempt
created (STYLE item 4). Staging names are parsed back by recovery, so the format below
is part of the on-disk contract::

    <prefix>__<xid>__r<run>_p<spark partition>_a<attempt>_t<task attempt id>[_s<shard>]

    prefix = tx_<job, sanitised, at most 40 chars>_<8 hex of sha1(namespace/job)>
    xid    = b<batch>   for a streaming batch, a foreachBatch call or a txn_version save
             u<12 hex>  for a batch save without txn_version
    run    = 8 hex: the writer run (Spark query run, or one batch save); Spark task
             attempt ids restart at 0 in a new run, so the run keeps names unique
    shard  = a sharded job's shard index (its place in the job's pinned shard list): the
             server that holds the table; no suffix = the job's only server (shard 0)

A *batch staging* table (``visibility=batch``) gathers every task's staging of one xid
for one target before the single ``ATTACH PARTITION ALL`` that publishes it::

    <prefix>__<xid>__all_<8 hex of sha1(target)>

``namespace`` is the coordination store's own id (a random id kept at ``<keeper_root>/
namespace``): two jobs of the same name under different Keeper roots or ensembles that
share one ClickHouse get different prefixes, so neither's recovery can see, let alone
drop, the other's staging.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_STAGING_RE = re.compile(
    r"^(?P<prefix>tx_[a-z0-9_]*_[0-9a-f]{8})__(?P<xid>[bu][0-9a-f]+)"
    r"__(?:r(?P<run>[0-9a-f]{8})_p(?P<part>\d+)_a(?P<attempt>\d+)_t(?P<tid>\d+)"
    r"(?:_s(?P<shard>\d+))?"
    r"|all_(?P<tag>[0-9a-f]{8})(?:_c(?P<claim>[0-9a-f]{8}))?)$"
)


def valid_job(job: str) -> bool:
    return bool(JOB_RE.match(job))


def staging_prefix(job: str, namespace: str = "") -> str:
    """``tx_<slug>_<hash>``: the hash covers the namespace, so equal job names of two
    Keeper roots/ensembles never share a prefix (``namespace=""``: pre-namespace names)."""
    slug = re.sub(r"[^a-z0-9]+", "_", job.lower()).strip("_")[:40]
    key = f"{namespace}/{job}" if namespace else job
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]  # noqa: S324 - a name, not security
    return f"tx_{slug}_{digest}"


def batch_xid(batch: int) -> str:
    if batch < 0:
        raise ValueError(f"batch id must be >= 0, got {batch}")
    return f"b{batch}"


def adhoc_xid(token: str) -> str:
    """xid of a batch save without txn_version; ``token`` is random hex from the driver."""
    return f"u{token[:12]}"


def xid_batch(xid: str) -> int | None:
    return int(xid[1:]) if xid.startswith("b") else None


@dataclass(frozen=True)
class StagingName:
    prefix: str
    xid: str
    run: str
    partition: int
    attempt: int
    task_attempt_id: int
    target_tag: str = ""  # set for a batch staging table (then run etc. are empty)
    shard: int | None = None  # a sharded job's shard index (None: not sharded, shard 0)
    claim: str = ""  # a batch staging table claimed by one finisher (visibility=batch)

    @property
    def batch(self) -> bool:
        """Whether this is a batch staging table (``visibility=batch``)."""
        return bool(self.target_tag)

    @property
    def table(self) -> str:
        if self.target_tag:
            claimed = f"_c{self.claim}" if self.claim else ""
            return f"{self.prefix}__{self.xid}__all_{self.target_tag}{claimed}"
        return (
            f"{self.prefix}__{self.xid}__r{self.run}_p{self.partition}"
            f"_a{self.attempt}_t{self.task_attempt_id}"
            + ("" if self.shard is None else f"_s{self.shard}")
        )

    @property
    def shard_index(self) -> int:
        """The shard that holds this table (0 for a job without shards)."""
        return self.shard or 0


def run_tag(run_id: str) -> str:
    """8 hex chars naming a writer run in staging names."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:8]  # noqa: S324 - a name, not security


def staging_name(
    job: str,
    xid: str,
    run: str,
    partition: int,
    attempt: int,
    task_attempt_id: int,
    namespace: str = "",
    shard: int | None = None,
) -> StagingName:
    return StagingName(
        staging_prefix(job, namespace),
        xid,
        run,
        partition,
        attempt,
        task_attempt_id,
        shard=shard,
    )


def parse_staging(table: str) -> StagingName | None:
    """The parts of a staging table name, or None if the name is not txsink's."""
    m = _STAGING_RE.match(table)
    if not m:
        return None
    if m["tag"]:
        return StagingName(m["prefix"], m["xid"], "", -1, -1, -1, m["tag"], claim=m["claim"] or "")
    return StagingName(
        m["prefix"],
        m["xid"],
        m["run"],
        int(m["part"]),
        int(m["attempt"]),
        int(m["tid"]),
        shard=None if m["shard"] is None else int(m["shard"]),
    )


def shard_of(table: str) -> int:
    """The shard index a staging table lives on (0 for names without one, and for
    names that are not txsink's)."""
    parsed = parse_staging(table)
    return parsed.shard_index if parsed is not None else 0


def batch_staging_name(prefix: str, xid: str, target: str) -> str:
    """The batch staging table of ``xid`` for ``target`` (``db.table``)."""
    tag = hashlib.sha1(target.encode()).hexdigest()[:8]  # noqa: S324 - a name, not security
    return StagingName(prefix, xid, "", -1, -1, -1, tag).table


def batch_claim_name(batch_staging: str, token: str) -> str:
    """The name one finisher renames a batch staging table (claimed or not) to before
    its ATTACH (``token``: random hex of that finisher): RENAME is atomic, so exactly one
    finisher holds the table under its own name at a time."""
    name = parse_staging(batch_staging)
    if name is None or not name.batch:
        raise ValueError(f"{batch_staging} is not a batch staging table")
    return replace(name, claim=token[:8]).table


def seal_tag(prefix: str, xid: str) -> str:
    """The row the commit of dedup xid ``xid`` of the job with staging prefix ``prefix``
    (:func:`staging_prefix`) writes into the server's seal table before
    COMMITTED: every block insert of the xid checks, on the server, that it is absent
    (:mod:`txsink.clickhouse.dedup_insert`); the text is also how the commit finds an
    insert of the xid still running (``system.processes``)."""
    return f"txsink-seal:{prefix}:{xid}/"  # "/" ends it: b1's is no part of b10's


def dedup_token(job: str, xid: str, partition: int, block: int) -> str:
    """The ``insert_deduplication_token`` of one deterministic block in dedup mode."""
    return f"txsink:{job}:{xid}:p{partition}:k{block}"
