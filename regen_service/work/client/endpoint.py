"""One SGLang or vLLM endpoint: health, engine and model checks, limits, one request attempt, its breaker.

`check` runs /health, finds the engine (engines.py), the model check (/get_model_info, /v1/models) and
reads SGLang's limits from /get_server_info (vLLM reports none). `send` makes one attempt on either API
(token-exact: SGLang's /generate, vLLM's /v1/completions with token ids) and returns a Completion
or raises a classified error (http.py; replies of the wrong shape: replies.py). Every attempt is
bounded: `request_timeout_s` end to end, `max_reply_bytes` per body, stream line or stream event, a
stream past max_new_tokens + `stream_slack_events` events is cut, one that completes no event for
`stall_timeout_s` too (all retryable; sse.py). Server text reaches errors and logs only through
server_text.py (scrubbed, cut, escaped), and answers quoting the API key are scrubbed before return.
The breaker ejects the endpoint after `breaker_failure_threshold` consecutive retryable failures, or at
once on a refused connection, and probes /health with exponential backoff; a probe that passes re-runs
`check` before the endpoint takes traffic again. Routing and retries across endpoints are pool.py's job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from regen_service.errors import EndpointTerminalError, RowTerminalError
from regen_service.settings import redact_url
from regen_service.work.client import metrics
from regen_service.work.client.auth import auth_headers, register_secret
from regen_service.work.client.config import PoolConfig
from regen_service.work.client.engines import (
    VLLM_COMPLETIONS_PATH,
    CompletionsStream,
    engine_from,
    vllm_completions_body,
)
from regen_service.work.client.http import (
    Completion,
    ConnectionRefusedRetryable,
    RetryableError,
    StreamModeError,
    dump_body,
    make_session,
    raise_for_status,
    read_limited,
)
from regen_service.work.client.replies import SHAPE_ERRORS, check_shape, malformed, max_events, parse_reply
from regen_service.work.client.server_text import redact_answer, server_text
from regen_service.work.client.sse import read_sse
from regen_service.work.client.streams import ChatStream, GenerateStream, Timer

log = logging.getLogger(__name__)


class WrongModelError(EndpointTerminalError):
    """The endpoint serves another model than the mix's target: the pool refuses to start."""


def _same_model(served: str, target: str) -> bool:
    # A local checkpoint path (/models/Kimi-K2.5) serves the same model as its hub id (org/Kimi-K2.5).
    return served == target or served.rstrip("/").rsplit("/", 1)[-1] == target.rstrip("/").rsplit("/", 1)[-1]


class Endpoint:
    def __init__(
        self, url: str, config: PoolConfig, target_model: str, on_change: Callable[[], Awaitable[None]]
    ) -> None:
        self.url = url
        self._target = target_model
        self.label = redact_url(url)
        self.config = config
        self._on_change = on_change
        self._headers = {"Content-Type": "application/json", **auth_headers(config.api_key)}
        self.limit = config.max_inflight_per_endpoint or config.default_inflight_per_endpoint
        self._generate_url = f"{url}/generate"
        self._chat_url = f"{url}/v1/chat/completions"
        # "sglang" | "vllm": forced by the config, else detected by `check` (engines.py)
        self.engine: str | None = None if config.engine == "auto" else config.engine
        self.context_length: int | None = None
        self.max_input_len: int | None = None
        self.server_info: dict = {}
        # /generate stream mode: the config's, or (auto) /server_info's, or "auto" = detect per stream
        self.stream_mode: str = config.incremental_stream
        self.inflight = 0
        self.healthy = False
        self.ejected = False
        self.stopped_reason: str | None = None
        self.consecutive_failures = 0
        self.errors: Counter[str] = Counter()
        self._control: aiohttp.ClientSession | None = None
        self._data: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task | None = None
        # Proxy settings from the environment (HTTP_PROXY, NO_PROXY...), read once as httpx did.
        try:
            self._proxy, self._proxy_auth = get_env_proxy_for_url(URL(url))
        except LookupError:
            self._proxy, self._proxy_auth = None, None
        # Prometheus children, looked up once instead of per request.
        self._m_inflight = metrics.INFLIGHT.labels(self.label)
        self._m_answered = metrics.PROMPTS_ANSWERED.labels(self.label)
        self._m_out_tokens = metrics.OUTPUT_TOKENS.labels(self.label)
        self._m_prompt_tokens = metrics.PROMPT_TOKENS.labels(self.label)
        self._m_ttft = metrics.TTFT.labels(self.label)

    # --- state -------------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        return self.stopped_reason is not None

    @property
    def usable(self) -> bool:
        return self.healthy and not self.ejected and not self.stopped

    def snapshot(self) -> dict:
        return {
            "url": self.label,
            "healthy": self.healthy,
            "ejected": self.ejected,
            "stopped": self.stopped_reason,
            "inflight": self.inflight,
            "limit": self.limit,
            "engine": self.engine,
            "context_length": self.context_length,
            "errors": dict(self.errors),
        }

    def _health_metric(self) -> None:
        metrics.HEALTH.labels(self.label).set(-1 if self.stopped else (1 if self.usable else 0))
        metrics.INFLIGHT_LIMIT.labels(self.label).set(self.limit)

    def count_error(self, error_class: str) -> None:
        self.errors[error_class] += 1
        metrics.ERRORS.labels(self.label, error_class).inc()

    def stop(self, reason: str) -> None:
        """Never use this endpoint again (401, wrong model)."""
        if self.stopped:
            return
        self.stopped_reason = self._clean(reason)
        log.error("endpoint %s stopped: %s", self.label, self.stopped_reason)
        self._health_metric()

    # --- lifecycle ---------------------------------------------------------------------------
    async def open(self) -> None:
        c = self.config
        # A small separate pool for health probes: they must not queue behind saturated data traffic.
        self._control = make_session(
            self._headers, connections=2, connect_s=c.connect_timeout_s, read_s=c.control_timeout_s
        )
        self._data = self._data_client()

    def _data_client(self) -> aiohttp.ClientSession:
        # Sized to the in-flight limit (+2 spare), HTTP/1.1 keep-alive: one socket per outstanding request.
        c = self.config
        return make_session(
            self._headers, connections=self.limit + 2, connect_s=c.connect_timeout_s, read_s=c.read_timeout_s
        )

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        for client in (self._control, self._data):
            if client is not None:
                await client.close()

    async def _get(self, path: str) -> bytes | None:
        """GET a control path: its body; None when it does not exist (404); errors classified."""
        try:
            async with self._control.get(
                self.url + path, proxy=self._proxy, proxy_auth=self._proxy_auth
            ) as resp:
                status, body = resp.status, await read_limited(resp, self.config.max_reply_bytes, self.label)
        except aiohttp.ClientConnectorError as e:
            raise ConnectionRefusedRetryable(
                f"{self.label}{path}: cannot connect ({self._clean(e)})",
                endpoint=self.label,
            ) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RetryableError(
                f"{self.label}{path}: {type(e).__name__} {self._clean(e)}".strip(),
                endpoint=self.label,
            ) from None
        if status == 404:
            return None
        raise_for_status(status, body, f"{self.label}{path}")
        return body

    async def check(self, target_model: str) -> None:
        """Health, served model and limits. Raises EndpointTerminalError (and stops) on a wrong model or key."""
        try:
            await self._get("/health")
            if self.config.engine == "auto":
                self.engine = await self._detect_engine()
            served = await self._served_models()
            if served and not any(_same_model(s, target_model) for s in served):
                raise WrongModelError(
                    f"{self.label} serves {server_text(sorted(served))}, not the target model {target_model!r}",
                    endpoint=self.label,
                )
            await self._read_limits()
        except EndpointTerminalError as e:
            self.stop(str(e))
            raise
        self.healthy = True
        self._health_metric()

    async def _served_models(self) -> set[str]:
        served: set[str] = set()
        for path in ("/get_model_info", "/model_info"):
            body = await self._get(path)
            if body is not None:
                info = _json_body(body)
                served.add(info.get("served_model_name") or info.get("model_path") or "")
                break
        body = await self._get("/v1/models")
        if body is not None:
            for m in _json_body(body).get("data") or []:
                served.add(m.get("id") or "")
                self.context_length = self.context_length or m.get("max_model_len")
        return {s for s in served if s}

    async def _detect_engine(self) -> str:
        info = await self._get("/get_server_info") or await self._get("/server_info")
        if info is not None:
            return engine_from(info, None, None, self.label)
        return engine_from(None, await self._get("/version"), await self._get("/v1/models"), self.label)

    async def _read_limits(self) -> None:
        if self.engine == "vllm":
            # vLLM reports no max_num_seqs (0.32: not in any info path or /metrics); its scheduler queues
            # what exceeds it, so the configured (or default) limit only decides how many wait there.
            log.info(
                "%s is vLLM: in-flight limit %d (vLLM reports no max_num_seqs; set "
                "--max-inflight-per-endpoint to about twice the server's --max-num-seqs)",
                self.label,
                self.limit,
            )
            return
        info: dict = {}
        for path in ("/get_server_info", "/server_info"):
            body = await self._get(path)
            if body is not None:
                info = _json_body(body)
                break
        self.server_info = info
        self.stream_mode = self._stream_mode(info)
        self.context_length = info.get("context_length") or self.context_length
        self.max_input_len = info.get("max_req_input_len")
        running = info.get("max_running_requests")
        if self.config.max_inflight_per_endpoint is None and isinstance(running, int) and running > 0:
            limit = int(running * self.config.inflight_factor)
            queued = info.get("max_queued_requests")
            if isinstance(queued, int) and queued >= 0:
                limit = min(limit, running + queued)  # never provoke "queue full" ourselves
            if limit != self.limit:
                self.limit = max(1, limit)
                old, self._data = self._data, self._data_client()
                if old is not None:
                    await old.close()

    def _stream_mode(self, info: dict) -> str:
        """SGLang's /server_info lists its server args, `incremental_streaming_output` among them."""
        if self.config.incremental_stream != "auto":
            return self.config.incremental_stream
        flag = info.get("incremental_streaming_output")
        return ("incremental" if flag else "cumulative") if isinstance(flag, bool) else "auto"

    # --- breaker -----------------------------------------------------------------------------
    def record_success(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, exc: RetryableError) -> None:
        if exc.status_code in (429, 503):
            # Overload ("queue full"): the server is alive and answering; backoff handles it, and
            # ejecting it would only idle a working server.
            return
        self.consecutive_failures += 1
        if (
            isinstance(exc, ConnectionRefusedRetryable)
            or self.consecutive_failures >= self.config.breaker_failure_threshold
        ):
            self.eject(str(exc))

    def eject(self, why: str) -> None:
        if self.ejected or self.stopped:
            return
        self.ejected = True
        why = self._clean(why)
        log.warning("endpoint %s ejected after %d failure(s): %s", self.label, self.consecutive_failures, why)
        self._health_metric()
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        delay = self.config.breaker_probe_initial_s
        while not self.stopped:
            await asyncio.sleep(delay)
            try:
                await self.check(self._target)
            except EndpointTerminalError:
                break
            except Exception as e:  # any failure to answer means: still down
                log.debug("probe of %s failed: %s", self.label, self._clean(e))
                delay = min(delay * 2, self.config.breaker_probe_max_s)
                continue
            self.ejected = False
            self.consecutive_failures = 0
            log.warning("endpoint %s is back", self.label)
            self._health_metric()
            break
        self._probe = None
        await self._on_change()

    def start_probing(self, why: str) -> None:
        """For an endpoint found down at start: eject it and let the probe bring it in."""
        self.eject(f"down at start: {why}")

    # --- one attempt -------------------------------------------------------------------------
    async def send(
        self, api: str, payload: dict, *, stream: bool, prompt_len: int | None = None
    ) -> Completion:
        if prompt_len is not None:
            self._check_length(prompt_len)
        url = self._generate_url if api == "generate" else self._chat_url
        if api == "generate" and self.engine == "vllm":
            api, url = "completions", self.url + VLLM_COMPLETIONS_PATH
            payload = vllm_completions_body(payload, self._target)
        body = {**payload, "stream": stream}
        if stream and api != "generate":
            body["stream_options"] = {"include_usage": True}
        coro = self._stream(url, api, body) if stream else self._once(url, api, body)
        try:
            timeout = self.config.request_timeout_s
            done = await (coro if timeout is None else asyncio.wait_for(coro, timeout))
        except aiohttp.ClientConnectorError as e:
            raise ConnectionRefusedRetryable(
                f"{self.label}: cannot connect ({self._clean(e)})", endpoint=self.label
            ) from None
        except aiohttp.ClientError as e:  # read timeouts, resets, disconnects mid-body
            raise RetryableError(
                f"{self.label}: {type(e).__name__} {self._clean(e)}".strip(), endpoint=self.label
            ) from None
        except asyncio.TimeoutError:
            raise RetryableError(
                f"{self.label} took longer than request_timeout_s", endpoint=self.label
            ) from None
        except OSError as e:  # a socket error aiohttp did not wrap
            raise RetryableError(
                f"{self.label}: {type(e).__name__} {self._clean(e)}".strip(), endpoint=self.label
            ) from None
        redact_answer(done, self.label)  # a server quoting the key back must not put it in a row
        return done

    def _clean(self, text: object) -> str:
        """Text that may hold the server's words, fit for a log line or an error (server_text.py): not
        cut again, since the errors regen builds cut the server's part already."""
        register_secret(self.config.api_key)
        return server_text(text, None)

    def _check_length(self, n: int) -> None:
        # SGLang rejects input_len >= context_length (and > max_req_input_len): do it without a request.
        ctx, cap = self.context_length, self.max_input_len
        if (ctx and n >= ctx) or (cap and n > cap):
            raise RowTerminalError(
                f"The input ({n} tokens) is longer than the model's context length ({ctx or cap} tokens) "
                f"reported by {self.label}; not sent",
                status_code=400,
            )

    async def _once(self, url: str, api: str, body: dict) -> Completion:
        t0 = time.monotonic()
        async with self._data.post(
            url, data=dump_body(body), proxy=self._proxy, proxy_auth=self._proxy_auth
        ) as resp:
            status, raw = resp.status, await read_limited(resp, self.config.max_reply_bytes, self.label)
        raise_for_status(status, raw, self.label)
        c = parse_reply(api, raw, self.label)
        c.latency_s = time.monotonic() - t0
        if c.completion_tokens and c.latency_s > 0:
            c.decode_tok_s = c.completion_tokens / c.latency_s
        return c

    async def _stream(self, url: str, api: str, body: dict) -> Completion:
        c = self.config
        if api == "generate":
            acc = GenerateStream(self.label, self.stream_mode, max_bytes=c.max_reply_bytes)
        elif api == "completions":
            acc = CompletionsStream(self.label, Timer())
        else:
            acc = ChatStream(self.label, max_bytes=c.max_reply_bytes)

        def feed(event: dict) -> None:
            try:
                acc.feed(event)
            except SHAPE_ERRORS as e:  # an event of the wrong shape (classified errors pass through)
                raise malformed(e, self.label) from None

        try:
            async with self._data.post(
                url, data=dump_body(body), proxy=self._proxy, proxy_auth=self._proxy_auth
            ) as resp:
                if resp.status != 200:
                    raise_for_status(
                        resp.status, await read_limited(resp, c.max_reply_bytes, self.label), self.label
                    )
                await read_sse(resp.content, c.stall_timeout_s, self.label, feed, max_event_bytes=c.max_reply_bytes,
                               max_events=max_events(body, c.stream_slack_events))  # fmt: skip
        except StreamModeError:
            # The server's mode is not what we believed (restarted with another flag): detect it from
            # the chunks from now on; the retry then folds the stream right.
            if c.incremental_stream == "auto":
                self.stream_mode = "auto"
            raise
        try:
            done = acc.result()
            check_shape(done)
        except SHAPE_ERRORS as e:
            raise malformed(e, self.label) from None
        return done


def _json_body(raw: bytes):
    """A 2xx body as JSON (a body that is not JSON raises ValueError, as httpx's `.json()` did)."""
    return json.loads(raw)
