"""Flower behind basic auth on every route: credentials checked, then every handler guarded.

Flower 2 checks basic auth only in the handlers that ask for a user: `/metrics` (Prometheus, listing
run ids through task names) and the API's `prepare` path are served to anyone. `guard_every_route`
wraps `prepare` of every Flower handler so a request without the right credentials gets 401 before
any handler runs; `/healthcheck` (a bare "OK", for liveness probes) is the one exception.
`check_basic_auth` refuses credentials with an empty user or password. Starting Flower is the CLI's job.

The credentials never travel on a command line: `/proc/<pid>/cmdline` (what `ps` shows) is readable by
every user of the host. `read_basic_auth_file` takes them from a file (a Docker secret), and
`hand_to_flower` gives them to Flower through FLOWER_BASIC_AUTH, which Flower 2.2.0 reads itself
(flower/command.py `apply_env_options`: every FLOWER_<option> variable, a `multiple` option such as
basic_auth split on ','), in this process's environment: Flower runs in-process, no child is spawned,
and a variable set at run time is not in `/proc/<pid>/environ` (that is the environment at exec).
"""

from __future__ import annotations

import os
from pathlib import Path

from regen_service.errors import ConfigError

FLOWER_ENV = "FLOWER_BASIC_AUTH"


def check_basic_auth(value: str) -> str:
    """`user:password[,user:password...]` with neither part empty in any pair; else ConfigError."""
    pairs = value.split(",")
    for pair in pairs:
        user, sep, password = pair.partition(":")
        if not sep or not user.strip() or not password.strip():
            raise ConfigError(
                "Flower's basic auth must be user:password with both parts non-empty (several pairs are "
                "separated by ','); got an empty user or password. Fix FLOWER_BASIC_AUTH or the --basic-auth-file"
            )
    return value


def read_basic_auth_file(path: str) -> str:
    """The credentials in PATH: one line `user:password[,user:password...]` (a final newline is allowed)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"--basic-auth-file {path}: cannot read it ({e}); give a file holding user:password"
        ) from None
    value = text.removesuffix("\n").removesuffix("\r")
    if "\n" in value or "\r" in value:
        raise ConfigError(
            f"--basic-auth-file {path}: expected one line user:password (several pairs separated by ','), "
            "got several lines"
        )
    return check_basic_auth(value)


def hand_to_flower(value: str) -> None:
    """Give Flower (started in this process next) the credentials without putting them in any argv."""
    os.environ[FLOWER_ENV] = check_basic_auth(value)


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
