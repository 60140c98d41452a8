"""What a writer needs from the Spark it runs on, refused on the driver before anything
is created (issue 41: on pyspark 3.5 without pandas the first batch failed after the
target table had been created)."""

from __future__ import annotations

import pytest

from txsink.errors import ConfigError
from txsink.spark import multi


@pytest.mark.parametrize(
    ("version", "pandas", "refused"),
    [("3.5.6", False, True), ("3.5.6", True, False), ("4.0.1", False, False)],
)
def test_mapinarrow_on_pyspark_3_needs_pandas(version: str, pandas: bool, refused: bool) -> None:
    why = multi.arrow_map_refusal(version, pandas)
    assert bool(why) is refused
    if refused:
        assert f"pyspark {version}" in why and "pip install 'pandas" in why


def test_foreach_batch_refuses_before_the_query_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyspark

    import txsink

    monkeypatch.setattr(pyspark, "__version__", "3.5.6")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="only with pandas installed"):
        txsink.foreach_batch(url="http://ch:8123", table="db.t", keeper="zk:2181", job="j")
