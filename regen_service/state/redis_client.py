"""Connecting to Redis: the one way every regen client (ledger, presence, sweep) opens a connection, and
the preflight that turns an unreachable, password-protected or TLS-misconfigured Redis into one line.

Which options a connection takes (TLS verification, the CA) is Settings'; the broker's Celery side gets
the same from regen_service.state.queue. What the keys hold is the ledger's (state/ledger.py).
"""

from __future__ import annotations

import ssl

import redis

from regen_service.errors import LedgerUnreachableError
from regen_service.settings import Settings


def connect(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(
        settings.redis_url, decode_responses=True, health_check_interval=30, **settings.redis_ssl_options()
    )


def check_reachable(settings: Settings) -> None:
    """Raise LedgerUnreachableError (one line: where, why, how to fix) unless Redis answers a PING."""
    where = settings.redis_url_redacted
    try:
        redis.Redis.from_url(
            settings.redis_url, socket_connect_timeout=3, socket_timeout=3, **settings.redis_ssl_options()
        ).ping()
    except (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError) as e:
        raise LedgerUnreachableError(
            f"Redis at {where} refused the password ({e}); set the one its requirepass/ACL has in "
            "REGEN_REDIS_URL (rediss://:PASSWORD@host:port/db)"
        ) from None
    except redis.RedisError as e:
        if _ssl_cause(e) is not None:
            raise LedgerUnreachableError(
                f"Redis at {where}: TLS failed ({_ssl_cause(e)}); point REGEN_REDIS_CA_CERTS at the CA "
                "that signed the server's certificate, and use the host name the certificate names"
            ) from None
        if isinstance(e, redis.ResponseError) and str(e).split(" ", 1)[0] == "NOAUTH":  # Redis's error code
            raise LedgerUnreachableError(
                f"Redis at {where} wants a password: put it in REGEN_REDIS_URL (redis://:PASSWORD@host:port/db)"
            ) from None
        raise LedgerUnreachableError(
            f"Redis at {where} is not reachable ({e}). Start one "
            '(redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no) or point '
            "REGEN_REDIS_URL at yours"
        ) from None


def _ssl_cause(e: BaseException) -> ssl.SSLError | None:
    """The TLS error under a Redis connection error, if that is what it was."""
    seen = e
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def write_refusal(r: redis.Redis) -> str | None:
    """Why this Redis would refuse writes right now (maxmemory reached under noeviction, or an
    AOF it cannot write), for `regen status`; None when it takes writes. Reads only: INFO."""
    mem = r.info("memory")
    limit, used, policy = (
        int(mem.get("maxmemory", 0)),
        int(mem.get("used_memory", 0)),
        mem.get("maxmemory_policy"),
    )
    if limit and used >= limit and policy == "noeviction":
        return (f"Redis is at its maxmemory ({used} of {limit} bytes, noeviction) and refuses writes: workers "
            "keep answering into the shard logs but cannot renew leases or finish shards until it has "
            "room (raise maxmemory, or free memory)")  # fmt: skip
    pers = r.info("persistence")
    if pers.get("aof_enabled") and pers.get("aof_last_write_status", "ok") != "ok":
        return "Redis cannot write its AOF (disk full or unwritable?) and refuses writes until it can"
    return None
