"""How often and how long the ClickHouse client retries classified transient errors.

Only errors :func:`txsink.clickhouse.error_map.classify` calls transient are retried;
an ambiguous one (the request may have landed) only for operations the caller declares
idempotent. The sleep is injectable, so tests never wait.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from txsink.clickhouse.error_map import Transience, classify, short_text
from txsink.errors import FencedError
from txsink.options import default_of

log = logging.getLogger(__name__)

# the first wait: ``multiplier`` from tenacity 9.1 (``initial`` deprecated), ``initial``
# before (the floor, 8.2, has only that)
FIRST_WAIT = (
    "multiplier"
    if "multiplier" in inspect.signature(tenacity.wait_exponential_jitter).parameters
    else "initial"
)
T = TypeVar("T")

# the writer's defaults (options registry), so the CLI and the writer retry alike
DEFAULT_RETRY_ATTEMPTS: int = default_of("retry_attempts")
DEFAULT_RETRY_MAX_WAIT: float = default_of("retry_max_wait")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry classified transient errors.

    ``sleep`` is injectable (tests pass a recorder); ``attempts`` counts the first try.
    """

    attempts: int = DEFAULT_RETRY_ATTEMPTS
    max_wait: float = DEFAULT_RETRY_MAX_WAIT
    initial_wait: float = 0.2
    sleep: Callable[[float], None] = time.sleep

    def run(
        self,
        fn: Callable[[], T],
        *,
        idempotent: bool,
        what: str,
        secrets: tuple[str, ...] = (),
        resend_ok: Callable[[], bool] | None = None,
    ) -> T:
        """Call ``fn``, retrying classified transient errors (raw, unmapped) per policy.

        ``resend_ok`` is asked before every retry (not the first call): False stops with
        :class:`~txsink.errors.FencedError` (a dedup block whose batch was committed
        meanwhile must not be sent again: its token may have left the window)."""
        tries = 0

        def attempt() -> T:
            nonlocal tries
            tries += 1
            if tries > 1 and resend_ok is not None and not resend_ok():
                raise FencedError(f"{what}: not sent again, its batch was sealed meanwhile")
            return fn()

        def retryable(exc: BaseException) -> bool:
            kind = classify(exc)
            return kind is Transience.REJECTED or (kind is Transience.AMBIGUOUS and idempotent)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "retrying %s after attempt %d/%d: %s",
                what,
                state.attempt_number,
                self.attempts,
                short_text(exc, secrets=secrets) if exc else "?",
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_exponential_jitter(
                **{FIRST_WAIT: self.initial_wait}, max=self.max_wait, jitter=self.initial_wait
            ),
            retry=tenacity.retry_if_exception(retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(attempt)
