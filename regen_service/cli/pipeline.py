"""CLI commands: pipeline (being written)."""

from regen_service.cli.base import main  # noqa: F401
