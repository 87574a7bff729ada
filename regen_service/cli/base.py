"""The `regen` click group; command modules attach their commands to it, and the run id check they share.

Operational faults any command can meet (Redis unreachable or lost mid-command, a data root that
cannot be used) become one-line
errors here, in one place, instead of tracebacks.
"""

from __future__ import annotations

import logging

import click
import redis

from regen_service import __version__
from regen_service.errors import DataRootUnreachableError, LedgerUnreachableError


class RegenGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (LedgerUnreachableError, DataRootUnreachableError) as e:
            raise click.ClickException(str(e)) from None
        except redis.ConnectionError as e:
            raise click.ClickException(
                f"lost the connection to Redis ({e}); check that it runs and that REGEN_REDIS_URL points at it"
            ) from None


@click.group(
    cls=RegenGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@click.version_option(__version__, prog_name="regen")
def main() -> None:
    """regen: regenerate EAGLE-3 draft training data with the target model, through Redis and Celery."""


def quiet_drivers(level: str) -> None:
    """The object store's SDK says at INFO where it found credentials, on every process start: noise
    beside regen's own lines (and a line a one-line error must not gain). DEBUG keeps it."""
    if level != "DEBUG":
        for name in ("aiobotocore", "botocore", "s3fs"):
            logging.getLogger(name).setLevel(logging.WARNING)


def run_id_param(_ctx, _param, value: str | None) -> str | None:
    """Click callback: a RUN_ID argument or --run option must be one the producer could have made."""
    from regen_service.state.storage import BadRunIdError, check_run_id

    if value is None:
        return None
    try:
        return check_run_id(value)
    except BadRunIdError as e:
        raise click.BadParameter(str(e)) from None
