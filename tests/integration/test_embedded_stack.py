"""The embedded ClickHouse endpoint speaks enough HTTP for stock clickhouse-connect:
types round-trip through Native and Arrow, compression works both ways, errors keep
their server code, settings/params/sessions apply, and bad input never kills it."""

from __future__ import annotations

import datetime as dt
import http.client
import ipaddress
import socket
import uuid
from decimal import Decimal
from zoneinfo import ZoneInfo

import pyarrow as pa
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from tests.integration.conftest import client_for
from txsink.embedded.stack import StackInfo

COLUMNS = [
    ("id", "UInt32"),
    ("i8", "Int8"),
    ("i16", "Int16"),
    ("i32", "Int32"),
    ("i64", "Int64"),
    ("i128", "Int128"),
    ("i256", "Int256"),
    ("u8", "UInt8"),
    ("u16", "UInt16"),
    ("u64", "UInt64"),
    ("u256", "UInt256"),
    ("f32", "Float32"),
    ("f64", "Float64"),
    ("d9", "Decimal(9, 2)"),
    ("d18", "Decimal(18, 6)"),
    ("d38", "Decimal(38, 10)"),
    ("d76", "Decimal(76, 20)"),
    ("s", "String"),
    ("fs", "FixedString(4)"),
    ("lc", "LowCardinality(String)"),
    ("ns", "Nullable(String)"),
    ("ni", "Nullable(Int64)"),
    ("b", "Bool"),
    ("d", "Date"),
    ("d32", "Date32"),
    ("dt", "DateTime('Europe/Berlin')"),
    ("dt64", "DateTime64(3, 'Asia/Tokyo')"),
    ("dt64u", "DateTime64(6, 'UTC')"),
    ("arr", "Array(Int32)"),
    ("arrs", "Array(Nullable(String))"),
    ("m", "Map(String, UInt64)"),
    ("tup", "Tuple(Int32, String)"),
    ("u", "UUID"),
    ("e", "Enum8('red' = 1, 'green' = 2)"),
    ("ip", "IPv4"),
]
NAMES = [c for c, _ in COLUMNS]
BERLIN, TOKYO, UTC = ZoneInfo("Europe/Berlin"), ZoneInfo("Asia/Tokyo"), dt.UTC


def sample_rows() -> list[list[object]]:
    big = 2**200 + 12345
    return [
        [
            1,
            -128,
            -32768,
            -(2**31),
            -(2**63),
            -(2**127),
            -big,
            255,
            65535,
            2**64 - 1,
            big,
            1.5,
            -2.25,
            Decimal("1234567.89"),
            Decimal("-123456789012.123456"),
            Decimal("1234567890123456789012345678.0123456789"),
            Decimal("12345678901234567890123456789012345678901234567890.12345678901234567890"),
            "héllo\t\n'\"\\",
            b"ab\x00z",
            "low",
            None,
            None,
            True,
            dt.date(2024, 2, 29),
            dt.date(1900, 1, 1),
            dt.datetime(2024, 3, 31, 2, 30, tzinfo=UTC).astimezone(BERLIN),
            dt.datetime(2024, 1, 1, 9, 0, 0, 123000, tzinfo=TOKYO),
            dt.datetime(2030, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
            [1, -2, 3],
            ["a", None],
            {"k": 1, "z": 2**63},
            (7, "seven"),
            uuid.UUID("12345678-1234-5678-1234-567812345678"),
            "red",
            ipaddress.IPv4Address("10.1.2.3"),
        ],
        [
            2,
            127,
            32767,
            2**31 - 1,
            2**63 - 1,
            2**127 - 1,
            big,
            0,
            0,
            0,
            0,
            0.0,
            1e300,
            Decimal("0.01"),
            Decimal("0.000001"),
            Decimal("0"),
            Decimal("-1"),
            "",
            b"\x00\x00\x00\x00",
            "",
            "x",
            42,
            False,
            dt.date(1970, 1, 1),
            dt.date(2299, 12, 31),
            dt.datetime(2024, 10, 27, 0, 30, tzinfo=UTC).astimezone(BERLIN),
            dt.datetime(1999, 12, 31, 23, 59, 59, tzinfo=TOKYO),
            dt.datetime(1970, 1, 1, tzinfo=UTC),
            [],
            [],
            {},
            (0, ""),
            uuid.UUID(int=0),
            "green",
            ipaddress.IPv4Address("255.255.255.255"),
        ],
    ]


def create_table(ch: Client, db: str, name: str) -> str:
    cols = ", ".join(f"`{c}` {t}" for c, t in COLUMNS)
    ch.command(f"CREATE TABLE {db}.{name} ({cols}) ENGINE = MergeTree ORDER BY id")
    return f"{db}.{name}"


def normalize(value: object) -> object:
    if isinstance(value, dt.datetime):
        return value.astimezone(UTC)
    if isinstance(value, bytes):
        return value.rstrip(b"\x00")
    if isinstance(value, str) and len(value) <= 4 and value.isascii():
        return value  # FixedString may come back as str depending on settings
    return value


def test_native_insert_and_query_round_trip_every_common_type(ch: Client, fresh_db: str) -> None:
    table = create_table(ch, fresh_db, "types")
    rows = sample_rows()
    ch.insert(table, rows, column_names=NAMES)
    got = ch.query(f"SELECT * FROM {table} ORDER BY id").result_rows
    assert len(got) == len(rows)
    for want, have in zip(rows, got, strict=True):
        for name, w, h in zip(NAMES, want, have, strict=True):
            got = h.encode() if name == "fs" and isinstance(h, str) else h
            assert normalize(got) == normalize(w), name


def test_arrow_round_trip_is_lossless(ch: Client, fresh_db: str) -> None:
    source = create_table(ch, fresh_db, "src")
    target = create_table(ch, fresh_db, "dst")
    ch.insert(source, sample_rows(), column_names=NAMES)
    arrow = ch.query_arrow(f"SELECT * FROM {source} ORDER BY id")
    assert isinstance(arrow, pa.Table) and arrow.num_rows == 2
    ch.insert_arrow(target, arrow)
    diff = ch.command(f"SELECT count() FROM (SELECT * FROM {source} EXCEPT SELECT * FROM {target})")
    assert diff == 0
    assert ch.command(f"SELECT count() FROM {target}") == 2
    assert ch.query_df(f"SELECT id, s FROM {target} ORDER BY id")["s"].tolist() == [
        "héllo\t\n'\"\\",
        "",
    ]


@pytest.mark.parametrize("codec", ["lz4", "zstd", "gzip"])
def test_compressed_requests_and_responses(stack: StackInfo, fresh_db: str, codec: str) -> None:
    client = client_for(stack, compress=codec)
    try:
        client.command(
            f"CREATE TABLE {fresh_db}.c (a UInt64, s String) ENGINE = MergeTree ORDER BY a"
        )
        data = [[i, f"row {i}" * 3] for i in range(50_000)]
        client.insert(f"{fresh_db}.c", data)  # Native body, Content-Encoding: codec
        client.raw_insert(f"{fresh_db}.c", ["a", "s"], b"50000\tlast\n", fmt="TabSeparated")
        client.insert_arrow(
            f"{fresh_db}.c", pa.table({"a": pa.array([60_000], pa.uint64()), "s": ["arrow"]})
        )
        result = client.query(f"SELECT a, s FROM {fresh_db}.c ORDER BY a")
        assert result.row_count == 50_002
        assert result.result_rows[-2:] == [(50_000, "last"), (60_000, "arrow")]
        assert client.query_arrow(f"SELECT * FROM {fresh_db}.c").num_rows == 50_002
    finally:
        client.close()
    # the endpoint really compresses when asked (and only then)
    conn = http.client.HTTPConnection("127.0.0.1", int(stack.url.rsplit(":", 1)[1]), timeout=30)
    query = f"SELECT * FROM {fresh_db}.c FORMAT TabSeparated"
    conn.request(
        "POST", "/?enable_http_compression=1", body=query, headers={"Accept-Encoding": codec}
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Encoding") == codec
    resp.read()
    conn.close()


@pytest.mark.parametrize(
    ("sql", "code"),
    [
        ("SELEC 1", 62),
        ("SELECT * FROM db_that_is_not.nope", 81),
        ("SELECT * FROM default.table_that_is_not_there", 60),
        ("SELECT toUInt8('not a number')", 6),
        ("SELECT 1 + 'a'", 43),
    ],
)
def test_errors_arrive_as_database_error_with_server_code(ch: Client, sql: str, code: int) -> None:
    with pytest.raises(DatabaseError) as info:
        ch.query(sql)
    assert f"Code: {code}." in str(info.value)
    assert getattr(info.value, "code", code) == code


def test_type_mismatch_on_insert_is_a_server_error(ch: Client, fresh_db: str) -> None:
    ch.command(f"CREATE TABLE {fresh_db}.m (a UInt32) ENGINE = MergeTree ORDER BY a")
    with pytest.raises(DatabaseError, match="Code: 27"):
        ch.raw_insert(f"{fresh_db}.m", ["a"], b"not-a-number\n", fmt="TabSeparated")
    assert ch.command(f"SELECT count() FROM {fresh_db}.m") == 0
    assert ch.command("SELECT 1") == 1  # the endpoint still serves


def test_an_insert_the_table_refuses_is_an_error_not_a_silent_zero_row_success(
    ch: Client, fresh_db: str
) -> None:
    """chdb's streaming insert reports TOO_MANY_PARTS as success with 0 rows written; the
    endpoint must answer the error (code 252, which writers retry) or the rows are lost."""
    ch.command(
        f"CREATE TABLE {fresh_db}.busy (a UInt64) ENGINE = MergeTree ORDER BY a SETTINGS "
        "parts_to_delay_insert = 1, parts_to_throw_insert = 2, "
        "max_bytes_to_merge_at_max_space_in_pool = 1, max_bytes_to_merge_at_min_space_in_pool = 1"
    )
    for i in range(2):
        ch.insert_arrow(f"{fresh_db}.busy", pa.table({"a": pa.array([i], pa.uint64())}))
    with pytest.raises(DatabaseError, match="Code: 252"):
        ch.insert_arrow(f"{fresh_db}.busy", pa.table({"a": pa.array([9], pa.uint64())}))
    with pytest.raises(DatabaseError, match="Code: 252"):
        ch.insert(f"{fresh_db}.busy", [[9]])  # Native
    assert ch.command(f"SELECT count() FROM {fresh_db}.busy") == 2
    # a deduplicated repeat is a 0-row success and must stay one
    ch.command(f"ALTER TABLE {fresh_db}.busy MODIFY SETTING parts_to_throw_insert = 100")
    ch.command(
        f"ALTER TABLE {fresh_db}.busy MODIFY SETTING non_replicated_deduplication_window = 10"
    )
    block = pa.table({"a": pa.array([5], pa.uint64())})
    for _ in range(2):
        ch.insert_arrow(f"{fresh_db}.busy", block, settings={"insert_deduplication_token": "t"})
    assert ch.command(f"SELECT count() FROM {fresh_db}.busy") == 3


# (what, table definition, the Arrow block, the code a ClickHouse server answers)
REFUSED_WHEN_WRITTEN = [
    (
        "CHECK constraint",
        "(a Int64, CONSTRAINT positive CHECK a > 0) ENGINE = MergeTree ORDER BY a",
        pa.table({"a": pa.array([1, -1], pa.int64())}),
        469,  # VIOLATED_CONSTRAINT
    ),
    (
        "unequal Nested lengths",
        "(id Int64, n Nested(x Int32, y String)) ENGINE = MergeTree ORDER BY id",
        pa.table(
            {
                "id": pa.array([1], pa.int64()),
                "n.x": pa.array([[1, 2]], pa.list_(pa.int32())),
                "n.y": pa.array([["a"]], pa.list_(pa.string())),
            }
        ),
        190,  # SIZES_OF_ARRAYS_DONT_MATCH
    ),
    (
        "too many partitions in one block",
        "(a Int64) ENGINE = MergeTree PARTITION BY a ORDER BY a",
        pa.table({"a": pa.array(range(150), pa.int64())}),
        252,  # TOO_MANY_PARTS ("Too many partitions for single INSERT block")
    ),
]


@pytest.mark.parametrize(
    ("what", "ddl", "block", "code"), REFUSED_WHEN_WRITTEN, ids=[r[0] for r in REFUSED_WHEN_WRITTEN]
)
def test_an_insert_the_engine_refuses_when_writing_is_answered_with_the_servers_code(
    ch: Client, fresh_db: str, what: str, ddl: str, block: pa.Table, code: int
) -> None:
    """chdb reports these inserts as written (``written_rows`` = rows sent) with nothing
    stored; the endpoint answers the code a ClickHouse server answers for the same
    statement, so no writer (and no test) takes a refused insert for a success."""
    ch.command(f"CREATE TABLE {fresh_db}.r {ddl}")
    with pytest.raises(DatabaseError, match=f"Code: {code}"):
        ch.insert_arrow(f"{fresh_db}.r", block)
    assert ch.command(f"SELECT count() FROM {fresh_db}.r") == 0, what
    assert ch.command("SELECT 1") == 1  # the endpoint still serves


def test_insert_deduplication_token_dedups_a_repeated_insert(ch: Client, fresh_db: str) -> None:
    ch.command(
        f"CREATE TABLE {fresh_db}.d (a UInt64) ENGINE = MergeTree ORDER BY a "
        "SETTINGS non_replicated_deduplication_window = 100"
    )
    block = pa.table({"a": pa.array(range(10), pa.uint64())})
    for _ in range(3):
        ch.insert_arrow(f"{fresh_db}.d", block, settings={"insert_deduplication_token": "tok-1"})
    ch.insert(f"{fresh_db}.d", [[1]], settings={"insert_deduplication_token": "tok-2"})
    ch.insert(f"{fresh_db}.d", [[1]], settings={"insert_deduplication_token": "tok-2"})
    assert ch.command(f"SELECT count() FROM {fresh_db}.d") == 11
    # without a token, identical data is deduplicated by content hash; a new token inserts
    ch.insert_arrow(f"{fresh_db}.d", block, settings={"insert_deduplication_token": "tok-3"})
    assert ch.command(f"SELECT count() FROM {fresh_db}.d") == 21


def test_url_settings_apply_to_that_query_only(ch: Client) -> None:
    assert (
        ch.command("SELECT getSetting('max_block_size')", settings={"max_block_size": 1234}) == 1234
    )
    assert ch.command("SELECT getSetting('max_block_size')") != 1234
    with pytest.raises(DatabaseError, match="Code: 115"):
        ch.command("SELECT 1", settings={"no_such_setting_xyz": 1})
    assert ch.command("SELECT 1") == 1


def test_mutations_sync_setting_makes_the_mutation_visible(ch: Client, fresh_db: str) -> None:
    ch.command(f"CREATE TABLE {fresh_db}.mu (a UInt64) ENGINE = MergeTree ORDER BY a")
    ch.insert(f"{fresh_db}.mu", [[i] for i in range(100)])
    ch.command(f"ALTER TABLE {fresh_db}.mu DELETE WHERE a < 50", settings={"mutations_sync": 2})
    assert ch.command(f"SELECT count() FROM {fresh_db}.mu") == 50


def test_param_binding_including_identifiers(ch: Client, fresh_db: str) -> None:
    ch.command(f"CREATE TABLE {fresh_db}.p (a UInt64, s String) ENGINE = MergeTree ORDER BY a")
    ch.insert(f"{fresh_db}.p", [[1, "x"], [2, "y"], [3, "it's"]])
    result = ch.query(
        "SELECT a FROM {db:Identifier}.{t:Identifier} WHERE s = {s:String} OR a > {n:UInt8}",
        parameters={"db": fresh_db, "t": "p", "s": "it's", "n": 1},
    )
    assert sorted(r[0] for r in result.result_rows) == [2, 3]
    # big parameters travel as multipart/form-data fields
    big = "x" * 50_000
    assert ch.command("SELECT length({big:String})", parameters={"big": big}) == 50_000
    # client-side binding (%(x)s) works as well
    assert ch.command("SELECT %(v)s", parameters={"v": "two words"}) == "two words"


def test_session_set_persists_for_that_session_only(stack: StackInfo) -> None:
    one, two = client_for(stack), client_for(stack)
    try:
        one.command("SET max_threads = 3")
        one.command("SET max_block_size = 777")
        assert one.command("SELECT getSetting('max_block_size')") == 777
        assert one.command("SELECT getSetting('max_threads')") == 3
        assert two.command("SELECT getSetting('max_block_size')") != 777
        assert (
            one.command("SELECT getSetting('max_block_size')", settings={"max_block_size": 5}) == 5
        )
        assert one.command("SELECT getSetting('max_block_size')") == 777
    finally:
        one.close()
        two.close()


def test_database_parameter_and_headers(stack: StackInfo, fresh_db: str) -> None:
    client = client_for(stack, database=fresh_db)
    try:
        assert client.command("SELECT currentDatabase()") == fresh_db
        summary = client.command(
            "CREATE TABLE h (a UInt8) ENGINE = MergeTree ORDER BY a", settings={"query_id": "qid-1"}
        )
        assert client.command("EXISTS TABLE h") == 1
        assert summary is not None
    finally:
        client.close()
    port = int(stack.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/?query_id=my-query&default_format=JSONEachRow", body="SELECT 1 AS x")
    resp = conn.getresponse()
    assert resp.read() == b'{"x":1}\n'
    assert resp.getheader("X-ClickHouse-Query-Id") == "my-query"
    assert resp.getheader("X-ClickHouse-Format") == "JSONEachRow"
    assert resp.getheader("X-ClickHouse-Timezone")
    assert resp.getheader("X-ClickHouse-Server-Display-Name")
    assert resp.getheader("X-ClickHouse-Summary")
    conn.request("GET", "/ping")
    assert conn.getresponse().read() == b"Ok.\n"
    conn.close()


def test_large_results_stream(ch: Client) -> None:
    total = 0
    with ch.query_row_block_stream("SELECT number FROM numbers(2000000)") as stream:
        for block in stream:
            total += len(block)
    assert total == 2_000_000


# ---------------------------------------------------------------- bad HTTP input


def raw_http(port: int, payload: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
        return b"".join(chunks)


def test_bad_input_gets_an_error_and_the_endpoint_survives(
    stack: StackInfo, ch: Client, fresh_db: str
) -> None:
    port = int(stack.url.rsplit(":", 1)[1])
    ch.command(f"CREATE TABLE {fresh_db}.g (a UInt32) ENGINE = MergeTree ORDER BY a")

    def post(
        path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, str | None]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, data, resp.getheader("X-ClickHouse-Exception-Code")

    # garbage body as a query, and as Native/Arrow data of an insert
    status, data, code = post("/", b"\x00\xff\xfe garbage \x01")
    assert status >= 400 and code and data.startswith(b"Code: ")
    q = f"INSERT INTO {fresh_db}.g FORMAT Native"
    status, data, code = post(f"/?query={q.replace(' ', '%20')}", b"\xff" * 5000)
    assert status >= 400 and code, data
    status, data, code = post(
        f"/?query={q.replace('Native', 'Arrow').replace(' ', '%20')}", b"ARROW1 not really"
    )
    assert status >= 400 and code, data
    # a body claiming a compression it does not have
    status, data, code = post("/", b"SELECT 1", {"Content-Encoding": "zstd"})
    assert status >= 400 and code
    status, data, code = post("/", b"SELECT 1", {"Content-Encoding": "rot13"})
    assert status >= 400 and code
    # unknown setting, unknown handler, malformed URL and request line
    status, data, code = post("/?this_setting_does_not_exist=1", b"SELECT 1")
    assert status == 400 and code == "115"
    status, data, code = post("/no/such/handler", b"SELECT 1")
    assert status == 404 and code
    status, data, code = post("/?query=%ZZ%%&&=", b"SELECT 1")
    assert status in (200, 400, 500)
    reply = raw_http(port, b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 501 " in reply.split(b"\r\n", 1)[0] and b"Code: 1. " in reply
    reply = raw_http(port, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert b"Code: " in reply or reply == b""
    bad_chunks = (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"ZZ\r\nSELECT 1\r\n0\r\n\r\n"
    )
    reply = raw_http(port, bad_chunks)
    assert b"Code: " in reply
    # a client that hangs up in the middle of an insert body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = (
            f"POST /?query={q.replace(' ', '%20').replace('Native', 'TabSeparated')} HTTP/1.1\r\n"
            "Host: x\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        sock.sendall(head + b"1\n2\n3\n")
    # nothing half-written became visible, and the endpoint still answers
    assert ch.command(f"SELECT count() FROM {fresh_db}.g") == 0
    ch.insert(f"{fresh_db}.g", [[7]])
    assert ch.command(f"SELECT sum(a) FROM {fresh_db}.g") == 7
    assert ch.ping()
