"""Leases: one worker at a time holds a shard (`SET NX PX`), renewing it from its heartbeat; a holder that
dies lets it expire. The Ledger has these methods (LeaseKeys is one of its bases); the owner token names
the worker's node, so status and the dead-holder sweep (state/reclaim.py) can tell a dead holder.

    P:lease:<rid>:<shard>           string: owner token, with a TTL renewed by the holder's heartbeat
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable

# Release a lease only if we still hold it; extend likewise (compare-and-set in one round trip).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"
_EXTEND = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"


def owner_token(node: str | None = None) -> str:
    """A lease holder's token: its worker's node name (what presence lists), its pid, a nonce."""
    return f"{node or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def owner_node(token: str) -> str:
    """The node name of the worker an owner_token names."""
    return token.rsplit("-", 2)[0]


class LeaseKeys:
    """The lease half of the Ledger (it provides self.r, self.p and self.settings)."""

    def _init_leases(self) -> None:
        self._release = self.r.register_script(_RELEASE)
        self._extend = self.r.register_script(_EXTEND)

    def lease_key(self, run_id: str, shard_id: int) -> str:
        return f"{self.p}:lease:{run_id}:{shard_id}"

    def acquire_lease(self, run_id: str, shard_id: int, owner: str) -> bool:
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        return bool(self.r.set(self.lease_key(run_id, shard_id), owner, nx=True, px=ttl_ms))

    def extend_lease(self, run_id: str, shard_id: int, owner: str) -> bool:
        ttl_ms = int(self.settings.lease_ttl_s * 1000)
        return bool(self._extend(keys=[self.lease_key(run_id, shard_id)], args=[owner, ttl_ms]))

    def release_lease(self, run_id: str, shard_id: int, owner: str) -> None:
        self._release(keys=[self.lease_key(run_id, shard_id)], args=[owner])

    def lease_holder(self, run_id: str, shard_id: int) -> str | None:
        return self.r.get(self.lease_key(run_id, shard_id))

    def leases(self, run_id: str, shard_ids: Iterable[int]) -> dict[int, tuple[str, float | None]]:
        """Holder and seconds left of every lease held among `shard_ids`, in one round trip (left is
        None for a lease without a TTL); shards nobody holds are absent."""
        ids = list(shard_ids)
        pipe = self.r.pipeline(transaction=False)
        for sid in ids:
            pipe.get(self.lease_key(run_id, sid))
            pipe.pttl(self.lease_key(run_id, sid))
        got = pipe.execute()
        out = {}
        for sid, holder, ttl_ms in zip(ids, got[::2], got[1::2], strict=True):
            if holder is not None:
                out[sid] = (holder, ttl_ms / 1000 if ttl_ms > 0 else None)
        return out

    def lease_left_s(self, run_id: str, shard_id: int) -> float | None:
        """Seconds until the shard's lease runs out by itself; None when no lease is held."""
        ttl_ms = self.r.pttl(self.lease_key(run_id, shard_id))
        return ttl_ms / 1000 if ttl_ms > 0 else None
