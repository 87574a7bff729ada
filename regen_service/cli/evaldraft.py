"""`regen eval-draft`: accept length and tokens/s of a served draft per source, on a run's held-out
prompts or a prompts file. Thin: the prompts come from regen_service.state.heldout_prompts or
deploy.evaldraft.load_source_prompts, the measuring is deploy.evaldraft's, the chart deploy.evalplot's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from regen_service.cli.base import main, run_id_param
from regen_service.errors import ConfigError

DEFAULT_FRACTION, DEFAULT_SEED = 0.05, 0


def recorded_split(path: str) -> tuple[float, int] | None:
    """(eval_fraction, eval_seed) recorded by the trainer: an exported draft's config.json ("regen" or
    its train_config) or a checkpoint's train_config; None when the folder records none."""
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        regen = json.loads(cfg_file.read_text()).get("regen") or {}
        found = regen.get("train_config") or regen
    else:
        from regen_service.draft.checkpoint import load_checkpoint
        from regen_service.draft.export import resolve_checkpoint

        found = load_checkpoint(resolve_checkpoint(path) / "state.pt", mmap=True).get("train_config") or {}
    if found.get("eval_fraction") is None:
        return None
    return float(found["eval_fraction"]), int(found.get("eval_seed") or 0)


def _run_prompts(run_id: str, fraction: float, seed: int, max_per_source: int):
    from regen_service.cli.pipeline import _settings
    from regen_service.deploy.spec_client import Prompt
    from regen_service.state.heldout_prompts import load_held_out
    from regen_service.state.storage import RunLayout, Storage
    from schemas.heldout import HeldOutSplit

    layout = RunLayout(Storage(_settings().data_root), run_id)
    try:
        held = load_held_out(layout, HeldOutSplit(fraction=fraction, seed=seed), max_per_source)
    except FileNotFoundError:
        raise ConfigError(
            f"run {run_id} has no manifest under the data root; check --run and REGEN_DATA_ROOT"
        ) from None
    if not held.by_source:
        raise ConfigError(
            f"run {run_id}: its held-out split (fraction {fraction}, seed {seed}) holds no chat prompt "
            f"({held.num_rows} rows read); pass the fraction and seed the draft was trained with "
            "(--heldout-fraction/--heldout-seed, or --draft DIR), or evaluate with --prompts FILE"
        )
    if held.missing:
        click.echo(
            f"warning: run {run_id}: no held-out prompts for {', '.join(held.missing)} (too few prompts "
            f"at fraction {fraction}); carrying on with the others. Use --prompts FILE to evaluate them",
            err=True,
        )
    prompts = {s: [Prompt(**row) for row in rows] for s, rows in held.by_source.items()}
    return prompts, held.missing, held.temperature


@main.command("eval-draft")
@click.option("--endpoint", required=True, help="SGLang or vLLM server serving the target WITH the draft.")
@click.option("--baseline", help="The same target without a draft, for the speed-up.")
@click.option("--run", "run_id", callback=run_id_param, help="Evaluate on this run's held-out prompts.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help="JSONL: `messages` or `prompt`, and a `source` or `category` field.")  # fmt: skip
@click.option("--source-field", help="The prompts file's field naming each row's source.")
@click.option("--draft", "draft_dir", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint or exported draft: its recorded held-out fraction/seed win over the flags.")  # fmt: skip
@click.option(
    "--heldout-fraction", type=float, help=f"Held-out share of the run.  [default: {DEFAULT_FRACTION}]"
)
@click.option("--heldout-seed", type=int, help=f"Held-out split seed.  [default: {DEFAULT_SEED}]")
@click.option("--temperature", "temperatures", multiple=True, type=float,
              help="Repeatable. [default: 0 and the run's sampling temperature, else 1.0]")  # fmt: skip
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--max-per-source", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per request, s.")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[PATH]",
              help="JSON report to PATH, or stdout when no PATH is given.")  # fmt: skip
@click.option(
    "--plot", "plot_path", help="PNG chart.  [default: beside the --json file, else ./eval-draft.png]"
)
def eval_draft_cmd(endpoint, baseline, run_id, prompts_file, source_field, draft_dir, heldout_fraction,
                   heldout_seed, temperatures, max_new_tokens, concurrency, max_per_source, timeout_s,
                   json_out, plot_path):  # fmt: skip
    """Accept length and tokens/s of a served draft per source (greedy and sampled): which data pays."""
    from regen_service.deploy.evaldraft import evaluate, format_table, load_source_prompts
    from regen_service.deploy.evalplot import MissingPlotLibrary, plot_report
    from regen_service.deploy.launch import api_key_from_env

    if (run_id is None) == (prompts_file is None):
        raise click.UsageError("give exactly one of --run RUN (its held-out prompts) or --prompts FILE")
    try:
        heldout, missing, run_temp = None, [], None
        if run_id:
            fraction = DEFAULT_FRACTION if heldout_fraction is None else heldout_fraction
            seed = DEFAULT_SEED if heldout_seed is None else heldout_seed
            if draft_dir and (recorded := recorded_split(draft_dir)) and recorded != (fraction, seed):
                if heldout_fraction is not None or heldout_seed is not None:
                    click.echo(f"note: {draft_dir} was trained with held-out fraction/seed {recorded}; "
                               "using those over the flags", err=True)  # fmt: skip
                fraction, seed = recorded
            prompts, missing, run_temp = _run_prompts(run_id, fraction, seed, max_per_source)
            heldout = {"run": run_id, "fraction": fraction, "seed": seed}
        else:
            prompts = {
                s: p[:max_per_source] for s, p in load_source_prompts(prompts_file, source_field).items()
            }
        temps = list(dict.fromkeys(temperatures or (0.0, run_temp if run_temp is not None else 1.0)))
        report = asyncio.run(
            evaluate(endpoint.rstrip("/"), prompts, temps, baseline=baseline.rstrip("/") if baseline else None,
                     max_new_tokens=max_new_tokens, concurrency=concurrency, api_key=api_key_from_env(),
                     timeout_s=timeout_s)
        )  # fmt: skip
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    report.missing_sources, report.heldout = missing, heldout
    if plot_path is None:
        plot_path = (
            str(Path(json_out).with_suffix(".png")) if json_out not in (None, "-") else "eval-draft.png"
        )
    try:
        plotted = str(plot_report(report, plot_path))
    except MissingPlotLibrary as e:
        plotted = None
        click.echo(f"warning: {e}", err=True)
    data = {**report.model_dump(mode="json"), "plot": plotted}
    if json_out == "-":
        click.echo(json.dumps(data, indent=2))
    else:
        if json_out:
            Path(json_out).write_text(json.dumps(data, indent=2) + "\n")
        click.echo(format_table(report) + (f"\nchart: {plotted}" if plotted else ""))
