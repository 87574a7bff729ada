"""The SGLang-compatible simulator behind `regen sim` (see docs/simulator.md).

config (SimConfig) -> engine (prompt -> deterministic answer -> run) over capacity (scheduler),
faults and stats; native and openai_api shape SGLang's responses; server wires the aiohttp app,
info and admin add the read-only and /sim endpoints, outage kills and revives the listener.
"""
