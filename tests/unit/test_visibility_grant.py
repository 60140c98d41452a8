"""visibility=auto asks the server whether the writer may run the batch publish's ATTACH
before it chooses batch: a user whose grants allow MOVE PARTITION but not ``ATTACH
PARTITION ... FROM`` (ClickHouse asks ALTER DELETE on the target for it) used to get
batch, PREPARE, and an ATTACH that failed after the prepare (recover could not finish it
either). Decisions on the in-memory twin; the real server is
tests/integration/test_visibility_grant.py."""

from __future__ import annotations

import logging

import pytest

from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.ids import batch_claim_name, batch_staging_name, staging_prefix
from txsink.protocol.visibility import grant_refusal
from txsink.spark import validate

TARGET = "db.t"
BASE = {"url": "http://h:8123", "keeper": "k:2181", "table": TARGET, "job": "j", "user": "etl"}


def config(visibility: str, **extra: str) -> WriterConfig:
    return WriterConfig.from_options({**BASE, "visibility": visibility, **extra})


def twin(*, denied: bool) -> MemoryWarehouse:
    wh = MemoryWarehouse()
    wh.add_table(TARGET, partition_by="p")
    if denied:
        wh.attach_denied.add(TARGET)
    return wh


def choose(visibility: str, wh: MemoryWarehouse, **extra: str) -> str:
    cfg = config(visibility, **extra)
    return validate.chosen_visibility(cfg, wh.target_info(TARGET), "attach", wh)


@pytest.fixture(autouse=True)
def settings_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin has no system.settings: the profile check (validate_settings) passes;
    every test asks its own twin (the grants cache is per process)."""
    monkeypatch.setattr(validate, "check_insert_settings", lambda *a, **k: None)
    monkeypatch.setattr(validate, "_grant_cache", {})


def test_auto_without_the_attach_grant_publishes_by_partition_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wh = twin(denied=True)
    with caplog.at_level(logging.INFO, logger="txsink.spark.validate"):
        assert choose("auto", wh) == "partition"
    said = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "visibility=auto chose partition for db.t" in said, said
    assert "ALTER DELETE" in said and "GRANT ALTER DELETE, INSERT ON db.t TO etl" in said, said
    assert wh.staging == {} and wh.target_ids(TARGET) == []  # the probe changed nothing


def test_auto_with_the_attach_grant_still_chooses_batch() -> None:
    assert choose("auto", twin(denied=False)) == "batch"


def test_an_explicit_batch_without_the_grant_is_refused_naming_table_privilege_and_grant() -> None:
    wh = twin(denied=True)
    with pytest.raises(ConfigError) as refused:
        choose("batch", wh)
    text = str(refused.value)
    assert refused.value.code == 497
    assert text.startswith("job j: visibility=batch publishes into db.t"), text
    assert "the privilege ALTER DELETE on db.t" in text, text
    assert "GRANT ALTER DELETE, INSERT ON db.t TO etl" in text, text
    assert "or use visibility=partition" in text and text.endswith("Nothing was written"), text
    assert wh.staging == {} and not wh.staging_db_created  # nothing staged


def test_the_grants_are_asked_once_not_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every probe is a statement the server refuses and logs as an error: a stream that
    revalidates each micro-batch asks again only after GRANT_CACHE_SECONDS."""
    wh = twin(denied=False)
    asked: list[str] = []
    probe = wh.attach_refusal
    monkeypatch.setattr(wh, "attach_refusal", lambda t: asked.append(t) or probe(t))
    assert [choose("auto", wh) for _ in range(3)] == ["batch"] * 3
    assert asked == [TARGET]
    clock = validate.time.monotonic() + validate.GRANT_CACHE_SECONDS + 1
    monkeypatch.setattr(validate.time, "monotonic", lambda: clock)
    assert choose("auto", wh) == "batch" and asked == [TARGET, TARGET]


def test_partition_visibility_never_probes() -> None:
    wh = twin(denied=True)
    wh.fail_next("attach_refusal", ConfigError("must not be asked"))
    assert choose("partition", wh) == "partition"


def test_the_twin_refuses_an_attach_without_the_grant_before_anything_lands() -> None:
    """What a batch PREPARED for such a user met at its publish (and at every recover)."""
    wh = twin(denied=True)
    task = f"{staging_prefix('j')}__b1__r0000000a_p0_a0_t1"
    wh.stage(task, {"1": [1, 2]})
    batch = batch_staging_name(staging_prefix("j"), "b1", TARGET)
    wh.create_batch_staging(batch, task, TARGET)
    wh.copy_into_batch(batch, [(task, "")])
    claimed = batch_claim_name(batch, "a1b2c3d4")
    wh.claim_staging(batch, claimed)
    with pytest.raises(ConfigError, match=r"Missing permissions: ALTER DELETE ON db\.t") as denied:
        wh.attach_all(claimed, TARGET, tag="txsink attach b1")
    assert denied.value.code == 497
    assert wh.target_ids(TARGET) == [] and wh.query_log == {}


def test_the_grant_statement_quotes_a_user_name_that_needs_it() -> None:
    said = grant_refusal("db.t", "etl-writer", "txsink_staging", "denied")
    assert "GRANT ALTER DELETE, INSERT ON db.t TO `etl-writer`" in said
    assert "SELECT on txsink_staging.*" in said
