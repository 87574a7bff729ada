"""A server that dies and comes back: close the listening socket, drop every connection, reopen later.

`POST /sim/outage {"duration_s": N}` lands here. During the outage new connections are refused by
the kernel (nothing listens), in-flight and idle keep-alive connections are aborted, and every
request in the scheduler is lost, as with a crashed SGLang process. After N seconds the same port
listens again with an empty scheduler. The HTTP route and its validation are in admin.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from regen_service.sim.capacity import Scheduler

log = logging.getLogger("regen.sim")


class Outage:
    def __init__(self, scheduler: Scheduler, host: str) -> None:
        self._scheduler = scheduler
        self._host = host
        self._runner: web.AppRunner | None = None
        self._port = 0
        self._until = 0.0
        self._task: asyncio.Task | None = None

    def attach(self, runner: web.AppRunner, port: int) -> None:
        """The runner exists only after the app (which holds this object) is frozen."""
        self._runner, self._port = runner, port

    @property
    def active(self) -> bool:
        return time.monotonic() < self._until

    def schedule(self, duration_s: float, delay_s: float = 0.05) -> None:
        """Begin after `delay_s` so the admin response itself still reaches its caller."""
        self._until = time.monotonic() + delay_s + duration_s
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = asyncio.get_running_loop().create_task(self._run(duration_s, delay_s))

    async def _run(self, duration_s: float, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        assert self._runner is not None, "attach() runs before the server accepts requests"
        log.warning("outage: not listening for %.1f s", duration_s)
        for site in list(self._runner.sites):
            await site.stop()
        server = self._runner.server
        if server is not None:
            for conn in server.connections:
                if conn.transport is not None:
                    conn.transport.abort()
        self._scheduler.cancel_all()
        # a newer outage cancels this sleep and reopens the port itself, when its own time is up
        await asyncio.sleep(duration_s)
        self._until = 0.0
        if not self._runner.sites:
            await web.TCPSite(self._runner, self._host, self._port, reuse_address=True).start()
            log.warning("outage over: listening again on %s:%d", self._host, self._port)


OUTAGE = web.AppKey("outage", Outage)
