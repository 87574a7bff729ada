"""The `regen` command line. Each module below owns a group of commands; heavy imports stay inside them."""

from regen_service.cli import deploy, evaldraft, pipeline, runs, sim, train  # noqa: F401  (registers commands)
from regen_service.cli.base import main

__all__ = ["main"]
