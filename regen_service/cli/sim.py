"""CLI command: `regen sim`, the SGLang-compatible simulator (see docs/simulator.md).

Only parses flags into a SimConfig and runs regen_service.sim.server; aiohttp and the tokenizer
are imported inside the command so `regen --help` stays fast.
"""

from __future__ import annotations

import click

from regen_service.cli.base import main


def _accept_rules(_ctx, _param, values: tuple[str, ...]) -> dict[str, float]:
    rules = {}
    for v in values:
        text, sep, length = v.rpartition("=")
        try:
            rules[text] = float(length)
        except ValueError:
            sep = ""
        if not sep or not text:
            raise click.BadParameter(f"{v!r}: write TEXT=L, e.g. integral=3.5")
    return rules


@main.command("sim")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=int, default=30000, show_default=True, help="TCP port (0 = any free port).")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Answers are a pure function of (seed, prompt)."
)
@click.option(
    "--model",
    default="moonshotai/Kimi-K2.5",
    show_default=True,
    help="Model name reported by the info endpoints.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    help="Local Hugging Face tokenizer dir (never downloaded). Default: built-in synthetic word vocabulary.",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Let --tokenizer run Python code shipped in its folder (auto_map, e.g. Kimi's tiktoken tokenizer). "
    "Off by default: such a folder is refused without this flag.",
)
@click.option(
    "--hf-model",
    "hf_model_path",
    default=None,
    help="Local causal LM dir: answer with its greedy decoding instead of filler (slow; CPU dry runs). "
    "Needs --tokenizer of the same model.",
)
@click.option(
    "--api-key", default=None, help="Require 'Authorization: Bearer KEY' on all but /health* and /metrics."
)
@click.option(
    "--context-length", type=int, default=262144, show_default=True, help="Context length in tokens."
)
@click.option(
    "--incremental-streaming-output",
    is_flag=True,
    help="/generate streams text and output_ids as deltas (default: cumulative).",
)
@click.option(
    "--reasoning-parser",
    type=click.Choice(["kimi_k2", "none"]),
    default="kimi_k2",
    show_default=True,
    help="kimi_k2: chat splits thinking into reasoning_content; none: it stays in content.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(["kimi_k2", "none"]),
    default="kimi_k2",
    show_default=True,
    help="kimi_k2: chat returns tool_calls; none: the raw tool-call section stays in content.",
)
@click.option(
    "--answer-len-dist",
    type=click.Choice(["lognormal", "uniform", "fixed"]),
    default="lognormal",
    show_default=True,
    help="Distribution of answer lengths (tokens).",
)
@click.option(
    "--answer-len-mean", type=int, default=256, show_default=True, help="Mean answer length, tokens."
)
@click.option(
    "--answer-len-max", type=int, default=4096, show_default=True, help="Longest answer drawn, tokens."
)
@click.option(
    "--think-prob",
    type=float,
    default=0.5,
    show_default=True,
    help="Probability an answer has a thinking part.",
)
@click.option(
    "--tool-call-prob",
    type=float,
    default=0.3,
    show_default=True,
    help="Probability of a tool call when tools are offered and the last turn is the user's.",
)
@click.option(
    "--max-running-requests", type=int, default=64, show_default=True, help="R: requests decoding at once."
)
@click.option(
    "--max-queued-requests",
    type=int,
    default=4096,
    show_default=True,
    help="Q: waiting requests; beyond R+Q in the system -> 503 'The request queue is full.'",
)
@click.option(
    "--decode-tok-s",
    type=float,
    default=40.0,
    show_default=True,
    help="D: per-request decode speed at batch size 1, tok/s (0 = answer instantly, no scheduler).",
)
@click.option(
    "--batch-slowdown",
    type=float,
    default=0.01,
    show_default=True,
    help="A: per-request speed = D / (1 + A*(running-1)).",
)
@click.option(
    "--prefill-tok-s",
    type=float,
    default=0.0,
    show_default=True,
    help="Prefill speed for TTFT, tok/s (0 = no prefill delay).",
)
@click.option("--tick-s", type=float, default=0.015, show_default=True, help="Scheduler tick, seconds.")
@click.option(
    "--image-token-px",
    type=int,
    default=28,
    show_default=True,
    help="Side in pixels of the square one image token covers (Kimi-K2.5: 14 px patches merged 2x2).",
)
@click.option(
    "--spec-accept-length",
    type=float,
    default=0.0,
    show_default=True,
    help="Speculative mode: accept length L (0 = off).",
)
@click.option(
    "--spec-accept-rule",
    "spec_accept_rules",
    multiple=True,
    callback=_accept_rules,
    metavar="TEXT=L",
    help="Repeatable: a prompt containing TEXT reports accept length L (others: --spec-accept-length).",
)
@click.option(
    "--spec-speedup",
    type=float,
    default=None,
    help="Speculative decode speed factor. [default: max(1, 0.8*L)]",
)
@click.option(
    "--fault-503-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Probability a request gets 503 queue-full.",
)
@click.option(
    "--fault-disconnect-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Probability the connection drops mid-request.",
)
@click.option(
    "--fault-stall-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Probability a request goes silent mid-way.",
)
@click.option("--stall-s", type=float, default=5.0, show_default=True, help="Length of a stall, seconds.")
@click.option(
    "--fault-error-event-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Probability of a mid-stream error event (503).",
)
@click.option(
    "--fault-abort-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Probability of finish_reason abort mid-way.",
)
@click.option(
    "--log-level", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), default="INFO", show_default=True
)
def sim(log_level: str, **flags) -> None:
    """Serve an SGLang-compatible simulator of the target model (capacity model, deterministic answers, faults)."""
    import logging

    from pydantic import ValidationError

    from regen_service.sim.config import SimConfig
    from regen_service.sim.server import run

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = SimConfig(**flags)
    except ValidationError as e:
        raise click.UsageError(str(e)) from e
    from regen_service.errors import ConfigError

    try:
        run(cfg)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
