"""Flower behind basic auth on every route: credentials checked, then every handler guarded.

Flower 2 checks basic auth only in the handlers that ask for a user: `/metrics` (Prometheus, listing
run ids through task names) and the API's `prepare` path are served to anyone. `guard_every_route`
wraps `prepare` of every Flower handler so a request without the right credentials gets 401 before
any handler runs; `/healthcheck` (a bare "OK", for liveness probes) is the one exception.
`check_basic_auth` refuses credentials with an empty user or password. Starting Flower is the CLI's job.
"""

from __future__ import annotations

from regen_service.errors import ConfigError


def check_basic_auth(value: str) -> str:
    """`user:password[,user:password...]` with neither part empty in any pair; else ConfigError."""
    pairs = value.split(",")
    for pair in pairs:
        user, sep, password = pair.partition(":")
        if not sep or not user.strip() or not password.strip():
            raise ConfigError(
                "Flower's basic auth must be user:password with both parts non-empty (several pairs are "
                "separated by ','); got an empty user or password. Set FLOWER_BASIC_AUTH or --basic-auth"
            )
    return value


def guard_every_route() -> None:
    """Make every Flower handler but /healthcheck demand the configured credentials. Idempotent."""
    import flower.urls  # noqa: F401  (imports every handler class)
    from flower.views import BaseHandler
    from flower.views.monitor import Healthcheck

    def wrap(cls) -> None:
        original = cls.__dict__.get("prepare")
        if original is None or getattr(original, "_regen_guard", False):
            return

        def prepare(self):
            if not isinstance(self, Healthcheck) and self.application.options.basic_auth:
                self.get_current_user()  # raises HTTPError(401) on missing or wrong credentials
            return original(self)

        prepare._regen_guard = True  # type: ignore[attr-defined]
        cls.prepare = prepare

    if "prepare" not in BaseHandler.__dict__:
        BaseHandler.prepare = lambda self: None  # tornado's default does nothing either
    stack = [BaseHandler]
    while stack:
        cls = stack.pop()
        wrap(cls)
        stack.extend(cls.__subclasses__())
