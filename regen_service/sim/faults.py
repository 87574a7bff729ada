"""Fault decisions, one per request attempt, from an RNG of their own.

The fault RNG is seeded from the server seed but is separate from the answer RNG, so faults never
change what an answer says, and each attempt draws afresh, so a retry of a failed prompt can
succeed. A plan says what happens and at which token; the routes carry it out (drop the connection,
send an error event, finish with abort) and the scheduler carries out stalls. Outages (the server
going away) are in outage.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from regen_service.sim.config import SimConfig

FaultKind = Literal["none", "503", "disconnect", "error_event", "abort"]

QUEUE_FULL_MESSAGE = "The request queue is full."
ERROR_EVENT_MESSAGE = "Internal server error: the scheduler lost this request (simulated)."
ABORT_MESSAGE = "Request aborted by the server (simulated)."


@dataclass(frozen=True)
class FaultPlan:
    kind: FaultKind = "none"
    at_token: int = 0  # disconnect / error_event / abort happen once this many tokens are out
    stall_at: int | None = None  # the stream goes silent for stall_s once this many tokens are out

    def num_stop(self, num_tokens: int) -> int:
        """How many tokens the request produces before it ends (normally, or by this fault)."""
        if self.kind in ("disconnect", "error_event", "abort"):
            return min(self.at_token, num_tokens)
        return num_tokens


NO_FAULT = FaultPlan()


class FaultDecider:
    def __init__(self, seed: int) -> None:
        self._rng = random.Random(f"regen-sim-faults:{seed}")

    def decide(self, cfg: SimConfig, num_tokens: int) -> FaultPlan:
        if not (
            cfg.fault_503_rate
            or cfg.fault_disconnect_rate
            or cfg.fault_stall_rate
            or cfg.fault_error_event_rate
            or cfg.fault_abort_rate
        ):
            return NO_FAULT
        r = self._rng
        u503, udisc, uerr, uabort, ustall = (r.random() for _ in range(5))
        # mid-way: after at least one token when the answer has two or more
        at = r.randint(1, num_tokens - 1) if num_tokens > 1 else 0
        stall_at = r.randint(1, num_tokens - 1) if num_tokens > 1 else 0
        if u503 < cfg.fault_503_rate:
            return FaultPlan(kind="503")
        kind: FaultKind = "none"
        if udisc < cfg.fault_disconnect_rate:
            kind = "disconnect"
        elif uerr < cfg.fault_error_event_rate:
            kind = "error_event"
        elif uabort < cfg.fault_abort_rate:
            kind = "abort"
        stall = stall_at if ustall < cfg.fault_stall_rate else None
        if stall is not None and kind != "none" and stall >= at:
            stall = None
        return FaultPlan(kind=kind, at_token=at, stall_at=stall)
