"""A server older than a statement txsink sends: the probe of the batch publish
(ATTACH PARTITION ALL FROM, ClickHouse 24.9+) on an older server makes visibility=auto
publish by MOVE and visibility=batch refuse naming the version, instead of failing
validation with the server's syntax error (found while writing the ClickHouse-side
guide of issue 41)."""

from __future__ import annotations

import pytest

from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import TxSinkError
from txsink.protocol.visibility import ATTACH_ALL_UNSUPPORTED, grant_refusal


class Refusing:
    url = "http://ch:8123"

    def __init__(self, code: int, text: str) -> None:
        self.code, self.text = code, text
        self.facts: dict[str, float] = {}

    def command(self, sql: str, **_: object) -> None:
        raise TxSinkError(self.text, code=self.code)


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (344, "Code: 344. DB::Exception: Only support DROP/DETACH PARTITION ALL currently"),
        (62, "Code: 62. DB::Exception: Syntax error: failed at position 40 ('ALL')"),
    ],
)
def test_an_older_server_s_answer_to_the_batch_publish_is_not_a_grant_problem(
    code: int, text: str
) -> None:
    wh = ClickHouseWarehouse(Refusing(code, text), "txsink_staging")  # type: ignore[arg-type]
    said = wh.attach_refusal("db.t")
    assert said.startswith(ATTACH_ALL_UNSUPPORTED) and text in said
    why = grant_refusal("db.t", "writer", "txsink_staging", said)
    assert "24.9" in why and "visibility=partition" in why and "GRANT" not in why


def test_another_error_of_the_probe_is_raised() -> None:
    wh = ClickHouseWarehouse(Refusing(999, "Code: 999. something else"), "s")  # type: ignore[arg-type]
    with pytest.raises(TxSinkError, match="something else"):
        wh.attach_refusal("db.t")
