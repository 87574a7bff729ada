"""EndpointPool: every SGLang endpoint of one worker process, kept saturated, with retries and failover.

Routing: least outstanding requests among usable endpoints, never above an endpoint's in-flight limit
(the worker keeps `inflight_target` requests outstanding, so an endpoint's queue never runs dry).
Retries: tenacity, exponential backoff with jitter, `max_attempts` in all; the next attempt prefers
another endpoint than the one that just failed. A request whose endpoint dies goes to a live one.
When every endpoint is ejected, a request waits up to `backoff_max_s` per attempt for one to come
back (so an outage is bounded by the retry policy, not failed at once). A 401 stops that endpoint
and the request moves on without backoff. Row-level errors (context length, other 4xx) are raised
at once as RowTerminalError. Building the payloads and rows is regenerate.py's job.

Start: each endpoint is checked (endpoint.py). A wrong model raises EndpointTerminalError naming both
models; an endpoint down or unreachable at start is ejected and probed; a 401 stops it; start raises
if no endpoint is usable at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_exponential_jitter

from regen_service.errors import (
    EndpointTerminalError,
    NoEndpointAvailableError,
    RetriesExhaustedError,
    RetryableError,
    RowTerminalError,
)
from regen_service.work.client import metrics
from regen_service.work.client.config import PoolConfig
from regen_service.work.client.endpoint import Endpoint, WrongModelError
from regen_service.work.client.http import Completion, UncodedStreamError
from regen_service.work.client.server_text import server_text

log = logging.getLogger(__name__)


class _Attempt:
    """What carries over between attempts of one request."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.number = 0
        self.last: Endpoint | None = None


class EndpointPool:
    def __init__(self, config: PoolConfig, target_model: str) -> None:
        self.config = config
        self.target_model = target_model
        self._cond = asyncio.Condition()
        self._waiting = 0  # requests waiting in _acquire (release only notifies when there are some)
        self.endpoints = [Endpoint(url, config, target_model, self._notify) for url in config.endpoints]
        self._backoff = wait_exponential_jitter(
            multiplier=config.backoff_initial_s, max=config.backoff_max_s, jitter=config.backoff_jitter_s
        )

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        for ep in self.endpoints:
            await ep.open()
        if not self.config.health_check_on_start:
            for ep in self.endpoints:
                ep.healthy = True
                ep._health_metric()
            return
        results = await asyncio.gather(
            *(ep.check(self.target_model) for ep in self.endpoints), return_exceptions=True
        )
        wrong_model = None
        for ep, res in zip(self.endpoints, results, strict=True):
            if isinstance(res, WrongModelError):
                wrong_model = wrong_model or res
            elif isinstance(res, EndpointTerminalError):
                pass  # stopped (401), logged by the endpoint
            elif isinstance(res, BaseException):
                why = server_text(res)
                log.warning("endpoint %s is down at start (%s); probing it", ep.label, why)
                ep.start_probing(why)
        if wrong_model is not None:
            await self.close()
            raise wrong_model
        if not any(ep.usable for ep in self.endpoints):
            reasons = "; ".join(f"{ep.label}: {ep.stopped_reason or 'down'}" for ep in self.endpoints)
            await self.close()
            raise EndpointTerminalError(f"no usable endpoint at start ({reasons})")

    async def close(self) -> None:
        await asyncio.gather(*(ep.close() for ep in self.endpoints))

    async def __aenter__(self) -> EndpointPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- state -------------------------------------------------------------------------------
    @property
    def inflight_target(self) -> int:
        live = [ep.limit for ep in self.endpoints if ep.usable]
        if not live:  # all ejected: keep the non-stopped ones' worth waiting, so work resumes at once
            live = [ep.limit for ep in self.endpoints if not ep.stopped]
        return max(1, sum(live))

    @property
    def inflight(self) -> int:
        return sum(ep.inflight for ep in self.endpoints)

    def snapshot(self) -> dict:
        return {
            "target_model": self.target_model,
            "inflight_target": self.inflight_target,
            "inflight": self.inflight,
            "endpoints": [ep.snapshot() for ep in self.endpoints],
        }

    @property
    def max_input_len(self) -> int | None:
        """The smallest prompt limit any usable endpoint reported (None: unknown)."""
        limits = [ep.context_length for ep in self.endpoints if ep.context_length and not ep.stopped]
        return min(limits) if limits else None

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    # --- routing -----------------------------------------------------------------------------
    def _pick(self, avoid: Endpoint | None) -> Endpoint | None:
        """A usable endpoint under its limit, least outstanding first (ties at random); takes its slot.
        Synchronous: no other coroutine runs between the choice and the increment."""
        free = [ep for ep in self.endpoints if ep.inflight < ep.limit and ep.usable]
        if not free:
            return None
        if len(free) > 1 and avoid in free:
            free.remove(avoid)
        if len(free) == 1:
            ep = free[0]
        else:
            low = min(ep.inflight for ep in free)
            ep = random.choice([e for e in free if e.inflight == low])
        ep.inflight += 1
        ep._m_inflight.set(ep.inflight)
        return ep

    async def _acquire(self, avoid: Endpoint | None) -> Endpoint:
        ep = self._pick(avoid)
        if ep is not None:
            return ep
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.config.backoff_max_s, 1.0)
        async with self._cond:
            while True:
                alive = [ep for ep in self.endpoints if not ep.stopped]
                if not alive:
                    reasons = "; ".join(f"{ep.label}: {ep.stopped_reason}" for ep in self.endpoints)
                    raise EndpointTerminalError(f"every endpoint is stopped ({reasons})")
                ep = self._pick(avoid)
                if ep is not None:
                    return ep
                self._waiting += 1
                try:
                    if any(ep.usable for ep in alive):  # all busy: ordinary backpressure, wait for a slot
                        await self._cond.wait()
                        continue
                    left = deadline - loop.time()
                    if left <= 0:
                        raise NoEndpointAvailableError(
                            "every endpoint is ejected (being probed); none came back in time"
                        )
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._cond.wait(), left)
                finally:
                    self._waiting -= 1

    async def _release(self, ep: Endpoint) -> None:
        ep.inflight -= 1
        ep._m_inflight.set(ep.inflight)
        if self._waiting:
            async with self._cond:
                self._cond.notify_all()

    # --- requests ----------------------------------------------------------------------------
    async def complete(self, api: str, payload: dict, *, prompt_len: int | None = None) -> Completion:
        """One answered request (api 'generate' or 'chat'); raises RowTerminalError,
        RetriesExhaustedError or EndpointTerminalError (every endpoint stopped)."""
        state = _Attempt(self.config.stream)
        try:
            try:
                # Fast path: the first attempt runs bare; tenacity takes over only once it failed.
                result = await self._attempt(state, api, payload, prompt_len)
            except Exception as first:
                if not self._retry_after(first) or self.config.max_attempts <= 1:
                    raise
                result = await self._retry(state, api, payload, prompt_len, first)
        except RetryableError as e:
            metrics.RETRIES_EXHAUSTED.inc()
            raise RetriesExhaustedError(
                f"gave up after {state.number} attempt(s): {e}", attempts=state.number
            ) from e
        result.attempts = state.number
        return result

    async def _retry(
        self, state: _Attempt, api: str, payload: dict, prompt_len: int | None, first: Exception
    ) -> Completion:
        """Attempts 2..max_attempts under tenacity, after the first attempt failed with `first`: the
        same policy as one AsyncRetrying over all attempts (tenacity's attempt k is attempt k + 1)."""
        delay = self._delay(first, 1)
        if delay:
            await asyncio.sleep(delay)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts - 1),
            wait=lambda rs: self._delay(
                rs.outcome.exception() if rs.outcome else None, rs.attempt_number + 1
            ),
            retry=self._should_retry,
            reraise=True,
        )
        return await retrying(self._attempt, state, api, payload, prompt_len)

    def _retry_after(self, exc: BaseException | None) -> bool:
        if isinstance(exc, RetryableError):
            return True
        # A stopped endpoint is not the row's fault: try the others while any is left.
        return isinstance(exc, EndpointTerminalError) and any(not ep.stopped for ep in self.endpoints)

    def _should_retry(self, rs: RetryCallState) -> bool:
        return self._retry_after(rs.outcome.exception() if rs.outcome else None)

    def _delay(self, exc: BaseException | None, attempt_number: int) -> float:
        """Seconds to wait after attempt `attempt_number` (1-based) failed with `exc`."""
        if isinstance(exc, (EndpointTerminalError, NoEndpointAvailableError)):
            return 0.0  # move on at once (acquire itself waited for an endpoint to come back)
        return self._backoff(_AttemptNumber(attempt_number))

    async def _attempt(self, state: _Attempt, api: str, payload: dict, prompt_len: int | None) -> Completion:
        state.number += 1
        ep = await self._acquire(state.last)
        state.last = ep
        try:
            result = await ep.send(api, payload, stream=state.stream, prompt_len=prompt_len)
        except RetryableError as e:
            ep.count_error("retryable")
            ep.record_failure(e)
            if isinstance(e, UncodedStreamError):
                # SGLang's native stream reports even a 400 (context length) as an uncoded event:
                # the next attempt goes non-streaming, where the same failure carries its status.
                state.stream = False
            # DEBUG: at 5% 503s a busy worker would log hundreds of these a minute; the counts are in the
            # metrics (regen_client_errors_total) and each row's `attempts`, ejections log at WARNING.
            log.debug("attempt %d on %s failed: %s", state.number, ep.label, server_text(e, None))
            raise
        except RowTerminalError:
            ep.count_error("terminal_row")
            raise
        except EndpointTerminalError as e:
            ep.count_error("terminal_endpoint")
            ep.stop(str(e))
            raise
        finally:
            await self._release(ep)
        ep.record_success()
        ep._m_answered.inc()
        ep._m_out_tokens.inc(result.completion_tokens or 0)
        ep._m_prompt_tokens.inc(result.prompt_tokens or 0)
        if result.ttft_s is not None:
            ep._m_ttft.observe(result.ttft_s)
        return result


class _AttemptNumber:
    """What tenacity's wait strategies read from a RetryCallState."""

    __slots__ = ("attempt_number",)

    def __init__(self, n: int) -> None:
        self.attempt_number = n
