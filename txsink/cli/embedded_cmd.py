"""``txsink embedded up|down|status``: the local ClickHouse (chdb) + ZooKeeper stack.

``up`` starts the services detached (they outlive the command) and waits until they
answer; ``--shards N`` starts N independent ClickHouse endpoints (a cluster of shards) and
one ZooKeeper. ``--json`` prints ``{"url": <first shard>, "shards": [...], "keeper": ...}``
plus pids and dir. ``down`` stops exactly what ``up`` started, every shard included.
``status`` exits 0 only when every service runs and answers, else 5 (unreachable).
"""

from __future__ import annotations

import argparse
from typing import Any

from txsink.cli.output import Exit, Output, finding, kv_table
from txsink.embedded import stack
from txsink.errors import UnavailableError


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("embedded", help="start/stop the local ClickHouse + ZooKeeper")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, func, text in (
        ("up", _up, "start the stack and wait until both services answer"),
        ("down", _down, "stop the processes `up` started"),
        ("status", _status, "show pids and health; exit 5 when not up"),
    ):
        sub = actions.add_parser(name, help=text)
        sub.add_argument(
            "--dir",
            default=None,
            help="stack directory (default: $TXSINK_EMBEDDED_DIR or ./.txsink/embedded)",
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "up":
            sub.add_argument("--clickhouse-port", type=int, default=None, help="default 18123")
            sub.add_argument("--zookeeper-port", type=int, default=None, help="default 12181")
            sub.add_argument("--timeout", type=float, default=stack.DEFAULT_TIMEOUT)
            sub.add_argument(
                "--shards",
                type=int,
                default=None,
                help="ClickHouse endpoints to run, each its own engine, data dir and port "
                "(the ClickHouse port + k for shard k); default 1, or what already runs",
            )
            sub.add_argument(
                "--replicated",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="give ClickHouse the ZooKeeper and macros {shard}/{replica}, so "
                "Replicated*MergeTree tables can be created (DDL and Keeper paths only: "
                "chdb keeps them read-only); applies to endpoints started now",
            )
        else:  # accepted for symmetry; the pid files know the ports
            sub.add_argument("--clickhouse-port", type=int, default=None, help=argparse.SUPPRESS)
            sub.add_argument("--zookeeper-port", type=int, default=None, help=argparse.SUPPRESS)
        sub.set_defaults(func=func)


def _up(args: argparse.Namespace, out: Output) -> int:
    out.progress("starting the embedded stack (chdb ClickHouse endpoint(s) + ZooKeeper)...")
    info = stack.up(
        args.dir,
        args.clickhouse_port,
        args.zookeeper_port,
        args.timeout,
        shards=args.shards,
        replicated=args.replicated,
    )
    payload: dict[str, Any] = {
        "url": info.url,
        "shards": list(info.shards),
        "keeper": info.keeper,
        "dir": info.dir,
        "clickhouse_pid": info.clickhouse_pid,
        "zookeeper_pid": info.zookeeper_pid,
        "shard_pids": list(info.shard_pids),
    }
    shown = {
        **payload,
        "shards": ",".join(info.shards),
        "shard_pids": ",".join(map(str, info.shard_pids)),
    }
    text = kv_table(shown) + (
        f"\n\nexport TXSINK_URL={info.url} TXSINK_KEEPER={info.keeper}"
        f"\nstop with: txsink embedded down --dir {info.dir}"
    )
    return out.result(Exit.OK, text, **payload)


def _down(args: argparse.Namespace, out: Output) -> int:
    stopped = stack.down(args.dir)
    payload: dict[str, Any] = {"stopped_pids": stopped}
    text = f"stopped pids: {', '.join(map(str, stopped))}" if stopped else "not running"
    return out.result(Exit.OK, text, **payload)


def _status(args: argparse.Namespace, out: Output) -> int:
    st = stack.status(args.dir)
    lines = [f"dir  {st.dir}", f"up   {st.up}"]
    for svc in (*(st.shards or (st.clickhouse,)), st.zookeeper):
        lines.append(
            f"{svc.name:<13}  pid={svc.pid}  alive={svc.alive}  answering={svc.answering}"
            f"  {svc.address or ''}"
        )
    if not st.up:
        message = f"the embedded stack in {st.dir} is not up: run `txsink embedded up`"
        if not out.json_mode:
            out.emit(None, "\n".join(lines))
            raise UnavailableError(message)
        return out.result(
            Exit.UNREACHABLE,
            "",
            findings=[finding("stack-down", "error", message)],
            **dict[str, Any](st.as_dict()),
        )
    return out.result(Exit.OK, "\n".join(lines), **dict[str, Any](st.as_dict()))
