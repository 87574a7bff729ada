"""The event loop regen's long-lived processes run on: uvloop's where installed, else asyncio's.

uvloop roughly halves the loop's own share of a request, which matters to a worker pushing a thousand
prompts a second and to the simulator answering them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # not on Windows, or not installed
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine) -> None:
    """asyncio.run on the loop above (asyncio.run's loop_factory needs Python 3.12)."""
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
