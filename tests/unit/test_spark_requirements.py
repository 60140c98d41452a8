"""What a writer needs from the Spark it runs on, refused on the driver before anything
is created (issue 41: on pyspark 3.5 without pandas the first batch failed after the
target table had been created; pyspark 4.x needs pandas 2.2 for mapInArrow too)."""

from __future__ import annotations

import pytest

from txsink.errors import ConfigError


def test_foreach_batch_and_transaction_refuse_where_pyspark_s_own_check_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyspark.sql.pandas import utils

    import txsink

    def missing() -> None:
        raise ImportError("Pandas >= 2.2.0 must be installed; however, it was not found.")

    monkeypatch.setattr(utils, "require_minimum_pandas_version", missing)
    with pytest.raises(ConfigError, match=r"mapInArrow.*Pandas >= 2.2.0 must be installed"):
        txsink.foreach_batch(url="http://ch:8123", table="db.t", keeper="zk:2181", job="j")
    with pytest.raises(ConfigError, match="nothing was created or written"):
        txsink.transaction(None, 1, url="http://ch:8123", keeper="zk:2181", job="j")  # type: ignore[arg-type]


def test_nothing_is_refused_where_pyspark_s_checks_pass() -> None:
    from txsink.spark.multi import require_arrow_map

    require_arrow_map()  # this venv has what pyspark asks for
