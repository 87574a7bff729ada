"""CLI commands: deploy (being written)."""

from regen_service.cli.base import main  # noqa: F401
