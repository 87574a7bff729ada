"""One worker process's long-lived state: its event loop, endpoint pools, tokenizers and in-flight budget.

Celery runs shard tasks in threads; all HTTP work happens on one asyncio loop owned by this runtime.
Every shard a worker holds draws request slots from ONE budget that follows the pool's in-flight target,
so when one shard drains its tail the next shard's prompts already fill the freed slots: a server never
idles at shard boundaries while the queue holds work. How many shards are held is regen_service.work.intake's
decision (from the prompts in hand against this budget); whether the worker is alive and can serve is
published by regen_service.state.presence. The loop is uvloop's where uvloop is installed
(several times less loop overhead per request), asyncio's otherwise. What a shard does is
regen_service.work.shard_runner's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future

from regen_service.errors import ConfigError, EndpointTerminalError, NoUsableEndpointError
from regen_service.loops import new_event_loop
from regen_service.remote_code import load_tokenizer
from regen_service.settings import Settings
from regen_service.state.storage import RunLayout
from regen_service.work.client.pool import EndpointPool
from regen_service.work.images import RunImages
from regen_service.work.intake import Intake
from regen_service.work.regenerate import Regenerator
from regen_service.work.worker_config import WorkerConfig
from schemas.mix import MixSpec

log = logging.getLogger(__name__)


class InflightBudget:
    """A FIFO semaphore whose size follows the pool's in-flight target as endpoints leave and come back.

    The pool enforces per-endpoint limits itself; this budget keeps the waiting in one FIFO queue (one
    wake-up per freed slot) instead of every waiting prompt contending inside the pool.
    """

    def __init__(self, target) -> None:
        self._target = target
        self._size = max(1, target())
        self._sem = asyncio.Semaphore(self._size)

    def _grow(self) -> None:
        while self._size < max(1, self._target()):
            self._size += 1
            self._sem.release()

    async def __aenter__(self) -> None:
        self._grow()
        while True:
            await self._sem.acquire()
            if self._size <= max(1, self._target()):
                return
            self._size -= 1  # a slot beyond the (shrunk) target: retire it and wait for another

    async def __aexit__(self, *exc) -> None:
        if self._size > max(1, self._target()):
            self._size -= 1  # shrink by keeping this slot
        else:
            self._sem.release()
        self._grow()


class WorkerRuntime:
    def __init__(self, settings: Settings, config: WorkerConfig):
        self.settings = settings
        self.config = config
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="regen-loop", daemon=True)
        self._thread.start()
        self._pools: dict[str, EndpointPool] = {}
        self._tokenizers: dict[tuple[str, bool], object] = {}
        self._budgets: dict[str, InflightBudget] = {}
        self._lock = threading.Lock()
        self.intake = Intake(
            config.bounds.max_shards_in_hand, config.bounds.max_prompts_in_hand, self.inflight_target
        )

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro):
        return self.submit(coro).result()

    # --- per target model: one pool and one in-flight budget -----------------------------------------
    def pool_for(self, model: str) -> tuple[EndpointPool, InflightBudget]:
        with self._lock:
            if model not in self._pools:
                pool = EndpointPool(self.config.pool, target_model=model)
                try:
                    self.call(pool.start())  # nothing is registered when no endpoint can serve
                except EndpointTerminalError as exc:
                    raise NoUsableEndpointError(str(exc), model=model) from exc
                self.call(self._make_budget(model, pool))
                self._pools[model] = pool
                log.info("endpoint pool for %s ready: in-flight target %d", model, pool.inflight_target)
            return self._pools[model], self._budgets[model]

    async def _make_budget(self, model: str, pool: EndpointPool) -> None:
        self._budgets[model] = InflightBudget(lambda: pool.inflight_target)

    def check_mix(self, mix: MixSpec, where: str) -> None:
        """ConfigError unless this worker may take a run with this stored mix.

        The stored mix (`where`) lies on the shared data root, which every worker host can write: its
        `target.trust_remote_code` is a request, never the permission. Only the worker's own opt-in
        (`regen worker --trust-remote-code`) lets a tokenizer folder's code run in this process.
        """
        loads_tokenizer = mix.target.api == "generate" and bool(mix.target.tokenizer)  # api chat: never
        if loads_tokenizer and mix.target.trust_remote_code and not self.config.trust_remote_code:
            raise ConfigError(
                f"{where} sets target.trust_remote_code, which would run Python code from the tokenizer "
                f"folder {mix.target.tokenizer!r} in this worker, and this worker was not started with "
                "--trust-remote-code. Start workers with `regen worker --trust-remote-code` only if you trust "
                "that folder and everyone who can write the data root, then `regen resume` the run"
            )

    def tokenizer_for(self, mix: MixSpec):
        path = mix.target.tokenizer
        if mix.target.api != "generate" or not path:
            return None
        # Both must agree: the run asks for remote code and the worker was started allowing it.
        trust = mix.target.trust_remote_code and self.config.trust_remote_code
        with self._lock:
            key = (path, trust)
            if key not in self._tokenizers:
                if trust:
                    log.warning("running the code of tokenizer folder %s (--trust-remote-code)", path)
                self._tokenizers[key] = load_tokenizer(
                    path,
                    trust_remote_code=trust,
                    setting="target.trust_remote_code: true in the mix and `regen worker --trust-remote-code`",
                )
            return self._tokenizers[key]

    def regenerator_for(self, mix: MixSpec, layout: RunLayout) -> tuple[Regenerator, InflightBudget]:
        """A Regenerator for one run's shard: its mix, and its image store (`layout`)."""
        pool, sem = self.pool_for(mix.target.model)
        images = RunImages(layout, self.config.bounds.max_request_image_bytes)
        return Regenerator(pool, mix, tokenizer=self.tokenizer_for(mix), images=images), sem

    def inflight_target(self) -> int:
        """Requests this worker keeps outstanding over all its pools (before any pool: one shard's worth)."""
        pools = list(self._pools.values())
        if not pools:
            return self.config.pool.max_inflight_per_endpoint or 1
        return sum(p.inflight_target for p in pools)

    def snapshot(self) -> dict:
        return {model: pool.snapshot() for model, pool in self._pools.items()}

    def close(self) -> None:
        for pool in self._pools.values():
            try:
                self.call(pool.close())
            except Exception:
                log.exception("closing pool")
        self.loop.call_soon_threadsafe(self.loop.stop)
