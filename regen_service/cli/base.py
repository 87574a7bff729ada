"""The `regen` click group; command modules attach their commands to it."""

from __future__ import annotations

import click

from regen_service import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="regen")
def main() -> None:
    """regen: regenerate EAGLE-3 draft training data with the target model, through Redis and Celery."""
