"""One shard's answering, while its lease holds: the prompts still to ask, each answered row made durable.

`ShardSession` is what the shard runner hands over once the shard is leased and its earlier rows are
loaded: the ledger and lease owner (to keep the lease alive), the shard log and progress (where rows
go), the regenerator and the endpoints' semaphore (how prompts are asked). `answer_all(todo)` asks every
pending prompt concurrently, appends each row to the shard log as it finishes, heartbeats the lease and
the progress report, and stops without finalizing when the lease is lost or an endpoint gives up for
good. `num_answered` counts the rows it added (the intake's accounting). Choosing which prompts are
pending and writing the final shard are shard_runner.py's; talking to endpoints is the Regenerator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import redis

from regen_service.errors import LeaseLostError
from regen_service.state.ledger import Ledger
from regen_service.state.progress import Progress, take_report, write_report
from regen_service.state.shard_log import ShardLog
from regen_service.work.metrics import count_row
from regen_service.work.regenerate import Regenerator
from regen_service.work.runtime import InflightBudget, WorkerRuntime
from schemas.conversation import PromptRecord

log = logging.getLogger(__name__)


@dataclass
class ShardSession:
    runtime: WorkerRuntime
    ledger: Ledger
    run_id: str
    shard_id: int
    owner: str  # the lease token
    progress: Progress
    shard_log: ShardLog
    regenerator: Regenerator
    budget: InflightBudget  # the endpoints' capacity, shared by every shard of this worker
    num_answered: int = 0
    lost: asyncio.Event = field(init=False)  # the lease expired or was taken over (made on the loop)

    async def answer_all(self, todo: list[PromptRecord]) -> None:
        """Answer every prompt in `todo`; raises LeaseLostError, or the first prompt's terminal error."""
        self.lost = asyncio.Event()
        hb = asyncio.create_task(self._heartbeat())
        try:
            tasks = [asyncio.create_task(self._answer(r)) for r in todo]
            waiter = asyncio.gather(*tasks)
            lost_wait = asyncio.create_task(self.lost.wait())
            await asyncio.wait({waiter, lost_wait}, return_when=asyncio.FIRST_COMPLETED)
            if waiter.done() and waiter.exception() is not None:
                # One prompt raised (EndpointTerminalError): stop the others before the shard is handed back.
                lost_wait.cancel()
                await _cancel_all(tasks)
                raise waiter.exception()
            if self.lost.is_set():
                await _cancel_all(tasks)
                raise LeaseLostError(
                    f"lease on {self.run_id}/{self.shard_id} expired or was taken over; stopping without finalizing"
                )
            lost_wait.cancel()
            waiter.result()
        finally:
            hb.cancel()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.runtime.settings.heartbeat_s)
            try:
                ok = await asyncio.to_thread(self.ledger.extend_lease, self.run_id, self.shard_id, self.owner)
            except redis.RedisError as e:
                # Redis down or restarting: keep answering (rows go to the shard log, on storage) and
                # try again next beat; if the lease ran out meanwhile, the next renewal says so.
                log.warning(
                    "shard %s/%05d: lease not renewed (%s); trying again", self.run_id, self.shard_id, e
                )
                continue
            if not ok:
                self.lost.set()
                return
            report = take_report(self.progress)  # here, on the loop that mutates progress
            # counters are set, not added: a report lost to an outage is carried by the next one
            with contextlib.suppress(redis.RedisError):
                await asyncio.to_thread(write_report, self.ledger, self.run_id, self.shard_id, report)

    async def _answer(self, record: PromptRecord) -> None:
        if record.input_ids is not None:
            row = await self.regenerator.regenerate(record)
        else:
            async with self.budget:
                if self.lost.is_set():
                    return
                row = await self.regenerator.regenerate(record)
        if self.lost.is_set():
            return
        row.run_id = self.run_id
        self.shard_log.append(row)
        self.progress.add(row, new=True)
        count_row(row)
        self.num_answered += 1
        self.runtime.intake.prompt_answered()  # may let the worker take its next shard


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
