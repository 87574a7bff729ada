"""The worker's in-flight budget follows the pool's target as endpoints leave and come back."""

from __future__ import annotations

import asyncio

from regen_service.work.runtime import InflightBudget


def test_budget_follows_the_target_up_and_down():
    async def main() -> list[int]:
        target = [4]
        budget = InflightBudget(lambda: target[0])
        active = peak = 0

        async def job() -> None:
            nonlocal active, peak
            async with budget:
                active += 1
                peak = max(peak, active)
                await asyncio.sleep(0.005)
                active -= 1

        peaks = []
        for size in (4, 10, 2, 5):  # an endpoint back, two ejected, one back
            target[0] = size
            peak = 0
            await asyncio.gather(*[job() for _ in range(40)])
            peaks.append(peak)
        return peaks

    assert asyncio.run(main()) == [4, 10, 2, 5]
