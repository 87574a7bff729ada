"""The API key for SGLang endpoints: read from an environment variable or a file, never logged.

SGLang's `--api-key K` wants `Authorization: Bearer K` on every path but /health* and /metrics.
The key lives in a pydantic SecretStr so repr(), logs and error messages show '**********'; only
`auth_headers` unwraps it, right where the header is built. A server may still quote the key back
(an error body echoing the Authorization header), so every key in use is registered here and
`scrub_secrets` is the ONE function applied wherever an error text is built (http.status_error,
the pool's and endpoint's log lines, row errors): it replaces every registered secret and any
credentials inside URLs. Choosing where the key comes from (a CLI flag) is the worker's job.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from pydantic import SecretStr

from regen_service.errors import ConfigError


def load_api_key(env_var: str | None = None, file: str | None = None) -> SecretStr | None:
    """The key from `env_var` (its name, not its value) or from `file` (first line); None if neither given."""
    if env_var and file:
        raise ConfigError("give the API key through an environment variable or a file, not both")
    if env_var:
        value = os.environ.get(env_var)
        if not value:
            raise ConfigError(f"environment variable {env_var} (API key) is unset or empty")
        return SecretStr(value.strip())
    if file:
        path = Path(file).expanduser()
        try:
            value = path.read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the API key file {path}: {e.strerror}") from None
        lines = [line.strip() for line in value.splitlines() if line.strip()]
        if not lines:
            raise ConfigError(f"the API key file {path} is empty")
        if len(lines) > 1:
            raise ConfigError(
                f"the API key file {path} has {len(lines)} non-empty lines; it must hold the key alone "
                "on one line (remove the others)"
            )
        return SecretStr(lines[0])
    return None


_SECRETS: set[str] = set()
_LOCK = threading.Lock()
# user:password@ inside any URL in a text (http://u:p@host, redis://:p@host). The scheme's length is
# bounded: unbounded, a long run of letters costs quadratic time, and whole error bodies (up to
# max_reply_bytes) are scrubbed before they are cut.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]{0,31}://)(?P<user>[^\s/@:]*):[^\s/@]*@")
# What a scrubbed secret reads as.
MARKER = "***"


def register_secret(secret: SecretStr | str | None) -> None:
    """Remember a secret so that scrub_secrets removes it from every text from now on."""
    value = secret.get_secret_value() if isinstance(secret, SecretStr) else secret
    if value and len(value) >= 4:  # a 1-3 character "key" would mangle ordinary text
        with _LOCK:
            _SECRETS.add(value)


def scrub_secrets(text: str) -> str:
    """`text` with every registered secret and every URL password replaced by '***'. Scrub whole
    texts, before any cut (server_text.py): a cut first keeps the first characters of a key."""
    text = _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MARKER}@", text)
    return scrub_registered(text)[0]


def scrub_registered(text: str) -> tuple[str, int]:
    """`text` with every registered secret (not URL credentials) replaced by '***', and how many."""
    found = 0
    for secret in sorted(_SECRETS, key=len, reverse=True):
        if secret in text:
            found += text.count(secret)
            text = text.replace(secret, MARKER)
    return text, found


def install_log_scrubber() -> None:
    """Scrub every log record of this process (message, arguments and traceback) as it is created,
    whichever handler (ours, Celery's) writes it later. Idempotent."""
    old = logging.getLogRecordFactory()
    if getattr(old, "_regen_scrubs", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = old(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # a bad format string: let logging report it as usual
            return record
        record.msg, record.args = scrub_secrets(text), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub_secrets(logging.Formatter().formatException(record.exc_info))
        return record

    factory._regen_scrubs = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


def auth_headers(api_key: SecretStr | None) -> dict[str, str]:
    if api_key is None:
        return {}
    register_secret(api_key)
    return {"Authorization": f"Bearer {api_key.get_secret_value()}"}


def scrub(text: str, api_key: SecretStr | None = None) -> str:
    """`text` with the key (and every registered secret, URL credentials) replaced."""
    register_secret(api_key)
    return scrub_secrets(text)
