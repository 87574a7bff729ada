"""The API key for SGLang endpoints: read from an environment variable or a file, never logged.

SGLang's `--api-key K` wants `Authorization: Bearer K` on every path but /health* and /metrics.
The key lives in a pydantic SecretStr so repr(), logs and error messages show '**********'; only
`auth_headers` unwraps it, right where the header is built. Choosing where the key comes from (a
CLI flag naming the variable or file) is the worker's job.
"""

from __future__ import annotations

import os
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
        if not value:
            raise ConfigError(f"the API key file {path} is empty")
        return SecretStr(value.splitlines()[0].strip())
    return None


def auth_headers(api_key: SecretStr | None) -> dict[str, str]:
    if api_key is None:
        return {}
    return {"Authorization": f"Bearer {api_key.get_secret_value()}"}


def scrub(text: str, api_key: SecretStr | None) -> str:
    """`text` with the key replaced, for messages that quote server or library output."""
    if api_key is None:
        return text
    secret = api_key.get_secret_value()
    return text.replace(secret, "***") if secret else text
