"""The kazoo session under :class:`~txsink.keeper.kazoo_registry.KazooRegistry`.

Owns the :class:`KazooClient` (starting it, creating a missing chroot, authenticating a
reused client, stopping it), the mapping of every kazoo error onto :mod:`txsink.errors`,
and the node-level primitives the registry is built from: JSON reads, creates with
parents and the job ACL, and multi-op transactions. Together with
:mod:`txsink.keeper.kazoo_registry` it is the only place that imports kazoo.

Invariants:

- :meth:`KazooConn.wait` is bounded by the timeout: a request queued while kazoo
  reconnects would otherwise wait forever.
- Inside :meth:`KazooConn.mapped`, a lost connection, an expired session or an unanswered
  request is :class:`UnavailableError` (the outcome is unknown, the caller re-runs the
  idempotent step), a denied one is :class:`ConfigError`, any other kazoo failure is
  :class:`TxSinkError`; nothing kazoo-specific escapes.
- With ``auth="user:password"`` every node created here gets an ACL that gives that digest
  identity ALL and everyone else READ.
- :meth:`KazooConn.retrying` re-runs a whole registry step while Keeper is unavailable
  (connection lost, session expired, request unanswered), with exponential back-off, for
  at most ``retry_s`` seconds from the first failure; then the UnavailableError
  propagates. Only steps that are safe to re-run from the start are wrapped: each one
  re-reads what it needs, so a re-run after a lost reply finds what landed.
- :meth:`KazooConn.close` stops only a client this object started.
- The digest ``auth`` never reaches a message or a log line: error texts pass
  :func:`txsink.credentials.scrub`, and :class:`RedactAuthFilter` on kazoo's logger
  masks the auth packet kazoo logs at DEBUG ("Sending request(xid=-4): Auth(...)").
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import tenacity
from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionDropped,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    SessionMovedError,
)
from kazoo.exceptions import (
    ConnectionLoss as KazooConnectionLoss,
)
from kazoo.protocol.serialization import Auth
from kazoo.security import make_acl, make_digest_acl

from txsink.credentials import MASK, scrub, secrets_of
from txsink.errors import ConfigError, TxSinkError, UnavailableError

NEXT_STEP = "is ZooKeeper running? `txsink embedded status`"
DEFAULT_RETRY_S = 30.0

T = TypeVar("T")
log = logging.getLogger(__name__)
# tenacity 9.1 renamed the first wait ``multiplier``; the floor (8.2) calls it ``initial``
_FIRST_WAIT = (
    "multiplier"
    if "multiplier" in inspect.signature(tenacity.wait_exponential_jitter).parameters
    else "initial"
)

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    KazooConnectionLoss,
    SessionExpiredError,  # includes ConnectionClosedError
    SessionMovedError,
    OperationTimeoutError,
    ConnectionDropped,
)

# Results of the ops of a failed multi-op that did not cause the failure.
_NOT_THE_CAUSE = (RolledBackError, RuntimeInconsistency)


def encode(value: dict[str, Any]) -> bytes:
    """Node data for ``value`` (canonical JSON)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _decode(data: bytes) -> dict[str, Any] | None:
    """Node data as a dict; an empty node (a parent made by ``makepath``) is ``None``."""
    if not data:
        return None
    value = json.loads(data.decode())
    if not isinstance(value, dict):
        raise ValueError(f"holds a JSON {type(value).__name__}, expected an object")
    return value


class RedactAuthFilter(logging.Filter):
    """Masks the credential of kazoo ``Auth`` packets in log records (kazoo logs every
    request it sends at DEBUG, the digest ``user:password`` included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, Auth) for a in args):
            record.args = tuple(a._replace(auth=MASK) if isinstance(a, Auth) else a for a in args)
        return True


_AUTH_FILTER = RedactAuthFilter()


def _redacting_logger() -> logging.Logger:
    """kazoo's client logger (it logs through exactly this one) with the filter on."""
    logger = logging.getLogger("kazoo.client")
    if _AUTH_FILTER not in logger.filters:
        logger.addFilter(_AUTH_FILTER)
    return logger


def decode_node(path: str, data: bytes) -> dict[str, Any] | None:
    """:func:`_decode` of the node at ``path``; a node that is not JSON is a TxSinkError."""
    try:
        return _decode(data)
    except ValueError as exc:  # not JSON: someone else wrote this node
        raise TxSinkError(f"Keeper node {path} does not hold txsink's JSON: {exc}") from exc


def _split_connect_string(keeper: str) -> tuple[str, str]:
    """``host:port[,host:port...][/chroot]`` -> (hosts, chroot or "")."""
    hosts, sep, chroot = keeper.partition("/")
    if not hosts.strip():
        raise ConfigError(f"option keeper={keeper!r}: expected host:port[,host:port...][/chroot]")
    return hosts, (sep + chroot).rstrip("/")


class KazooConn:
    """One Keeper session (started here or passed in) and the primitives run on it."""

    def __init__(
        self,
        keeper: str,
        *,
        auth: str | None,
        timeout: float,
        client: KazooClient | None,
        retry_s: float = DEFAULT_RETRY_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.keeper = keeper
        self.timeout = timeout
        self.retry_s = retry_s
        self._sleep = sleep
        self._depth = threading.local()  # steps under way in this thread
        self._secrets = secrets_of(auth)
        self.acl: list[Any] | None = None
        if auth is not None:
            user, _, password = auth.partition(":")
            self.acl = [
                make_digest_acl(user, password, all=True),
                make_acl("world", "anyone", read=True),
            ]
        # Paths known to exist, so ensure() skips the round trip; callers that delete
        # nodes drop them from here.
        self.known_paths: set[str] = set()
        self._owns_client = client is None
        self._closed = False
        self.client: Any = None
        self.client = client if client is not None else self._connect(keeper, auth, timeout)
        try:
            if client is not None and auth is not None:
                logger = getattr(client, "logger", None)
                if isinstance(logger, logging.Logger) and _AUTH_FILTER not in logger.filters:
                    logger.addFilter(_AUTH_FILTER)
                with self.mapped("authenticate"):
                    self.wait(client.add_auth_async("digest", auth))
        except TxSinkError:
            self.close()
            raise

    # -- connection and error mapping ------------------------------------------------

    def _connect(self, keeper: str, auth: str | None, timeout: float) -> KazooClient:
        hosts, chroot = _split_connect_string(keeper)
        if chroot:
            self._ensure_chroot(hosts, chroot, timeout)
        try:
            client = KazooClient(
                hosts=keeper,
                timeout=timeout,
                auth_data=[("digest", auth)] if auth else None,
                connection_retry={"max_tries": -1, "max_delay": 2.0},
                logger=_redacting_logger(),
            )
        except ValueError as exc:
            raise ConfigError(
                f"option keeper={keeper!r}: {scrub(str(exc), self._secrets)}"
            ) from exc
        self._start(client, timeout)
        return client

    def _start(self, client: KazooClient, timeout: float) -> None:
        try:
            client.start(timeout=timeout)
        except client.handler.timeout_exception as exc:
            # kazoo has already stopped and closed the client.
            raise UnavailableError(
                f"cannot connect to Keeper at {self.keeper} within {timeout:g}s; {NEXT_STEP}"
            ) from exc

    def _ensure_chroot(self, hosts: str, chroot: str, timeout: float) -> None:
        """kazoo does not create a missing chroot; create it from a chroot-less session."""
        boot = KazooClient(hosts=hosts, timeout=timeout)
        self._start(boot, timeout)
        try:
            with self.mapped(f"create chroot {chroot}"):
                boot.ensure_path_async(chroot).get(timeout=timeout)
        finally:
            boot.stop()
            boot.close()

    @contextmanager
    def mapped(self, what: str) -> Iterator[None]:
        """Map kazoo's errors onto txsink's for the operation ``what``."""
        try:
            yield
        except _CONNECTION_ERRORS as exc:
            raise UnavailableError(
                f"Keeper at {self.keeper} lost the connection or session during {what} "
                f"({type(exc).__name__}); the outcome is unknown: re-run the step, it is "
                f"idempotent; {NEXT_STEP}"
            ) from exc
        except NoAuthError as exc:
            raise ConfigError(
                f"Keeper at {self.keeper} denied {what} (NoAuth): the node belongs to another "
                "identity; pass the job's `auth` (user:password)"
            ) from exc
        except KazooException as exc:
            detail = scrub(repr(exc), self._secrets)
            raise TxSinkError(f"Keeper at {self.keeper} failed {what}: {detail}") from exc
        except self._timeout_exception() as exc:
            raise UnavailableError(
                f"Keeper at {self.keeper} did not answer {what} within {self.timeout:g}s; "
                f"the outcome is unknown: re-run the step, it is idempotent; {NEXT_STEP}"
            ) from exc

    def retrying(self, what: str, step: Callable[[], T]) -> T:
        """Run ``step``; while it raises :class:`UnavailableError` run it again, backing
        off from 0.1 s to 2 s, until ``retry_s`` seconds have passed since the first try.

        Why: kazoo reconnects by itself (a ZooKeeper restart, a leader election, a new
        session after an expiry take seconds), but every request in flight meanwhile
        fails; without this a two-second outage fails the Spark batch. Nested calls (a
        step that calls another step) retry only at the outermost level."""
        if getattr(self._depth, "n", 0) or self.retry_s <= 0:
            return step()

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "Keeper unavailable during %s (attempt %d, %.1fs so far), retrying: %s",
                what,
                state.attempt_number,
                state.seconds_since_start or 0.0,
                exc,
            )

        def guarded() -> T:
            self._depth.n = 1
            try:
                return step()
            finally:
                self._depth.n = 0

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(UnavailableError),
            stop=tenacity.stop_after_delay(self.retry_s),
            wait=tenacity.wait_exponential_jitter(**{_FIRST_WAIT: 0.1}, max=2.0, jitter=0.1),
            sleep=self._sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(guarded)

    def _timeout_exception(self) -> type[BaseException]:
        if self.client is None:
            return _NeverRaised
        exc: type[BaseException] = self.client.handler.timeout_exception
        return exc

    def wait(self, async_result: Any) -> Any:
        # Bounded: a request queued while kazoo reconnects would otherwise wait forever.
        return async_result.get(timeout=self.timeout)

    def reusable(self) -> bool:
        """Whether the session can serve another borrower (:mod:`txsink.driver`'s pool):
        open, connected now. Paths remembered as existing are forgotten: another process
        may have deleted them since."""
        if self._closed or self.client is None or not self.client.connected:
            return False
        self.known_paths.clear()
        return True

    def close(self) -> None:
        """Stop the session if this object started it (a reused client stays open)."""
        if self._closed:
            return
        self._closed = True
        client = self.client
        if client is not None and self._owns_client:
            client.stop()
            client.close()

    # -- primitive reads and writes (callers wrap them in mapped) -----------------------

    def sync(self, path: str) -> None:
        """Make this session's next reads at least as new as every write the ensemble
        acknowledged before now: ZooKeeper's ``sync`` goes through the leader, and the
        session's server answers it only once it has applied everything up to that
        point. One round trip to the leader; it fails (UnavailableError, in
        :meth:`mapped`) rather than return while the server is cut off from it."""
        self.wait(self.client.sync_async(path))

    def read(self, path: str, asked: Any = None) -> tuple[dict[str, Any] | None, Any] | None:
        """(decoded data, stat) of ``path``, or None if the node does not exist.
        ``asked``: its ``get_async`` sent earlier (reads in flight together)."""
        try:
            data, stat = self.wait(self.client.get_async(path) if asked is None else asked)
        except NoNodeError:
            return None
        return decode_node(path, data), stat

    def read_json(self, path: str, asked: Any = None) -> tuple[dict[str, Any], Any] | None:
        """Like :meth:`read`, but an empty node counts as absent."""
        found = self.read(path, asked)
        if found is None or found[0] is None:
            return None
        return found[0], found[1]

    def ensure(self, path: str) -> None:
        """Make sure ``path`` and its parents exist (job nodes get the job ACL)."""
        if path in self.known_paths:
            return
        self.wait(self.client.ensure_path_async(path, acl=self.acl))
        self.known_paths.add(path)

    def create(self, path: str, value: dict[str, Any]) -> Any:
        """Create ``path`` (and parents); returns the path. NodeExistsError propagates.

        A missing parent (a dedup record's ``dedup/<xid>``, made by the first task of the
        xid and deleted once it committed) is created together with the node in one
        multi-op: one round trip instead of a look-up and a create. Should the parent
        appear meanwhile (a sibling task made it), or its own parent be missing, the
        node is created the long way: the parent ensured (never trusted from
        :attr:`known_paths`), then the node.
        """
        data = encode(value)
        try:
            return self.wait(self.client.create_async(path, data, acl=self.acl))
        except NoNodeError:
            pass
        parent = path.rsplit("/", 1)[0]
        self.known_paths.discard(parent)

        def both(txn: Any) -> None:
            txn.create(parent, b"", acl=self.acl)
            txn.create(path, data, acl=self.acl)

        ok, results = self.commit_txn(both)
        if ok:
            self.known_paths.add(parent)
            return path
        if results[0] is None:  # the parent was made, the node refused: its error
            raise results[1]
        if isinstance(results[0], NodeExistsError):  # a sibling made the parent meanwhile
            with suppress(NoNodeError):  # ...unless it is gone again: the long way
                return self.wait(self.client.create_async(path, data, acl=self.acl))
        self.ensure(parent)
        return self.wait(self.client.create_async(path, data, acl=self.acl))

    def commit_txn(self, ops: Callable[[Any], None]) -> tuple[bool, list[Any]]:
        """Run one multi-op; returns (all applied, per-op results).

        In a failed multi-op only the failing op carries its real error: ZooKeeper reports
        the ops before it as rolled back and those after it as not attempted. Both become
        ``None`` here, so ``isinstance(results[i], Exception)`` names the culprit.
        """
        txn = self.client.transaction()
        ops(txn)
        raw: list[Any] = self.wait(txn.commit_async())
        ok = not any(isinstance(r, Exception) for r in raw)
        return ok, [None if isinstance(r, _NOT_THE_CAUSE) else r for r in raw]


class _NeverRaised(Exception):
    """Placeholder for the handler's timeout exception before a client exists."""
