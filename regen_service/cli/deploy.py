"""CLI commands that get a draft from a checkpoint onto a server: export, validate-draft, convert-draft,
launch-sglang, launch-vllm, bench-spec. Thin: the logic lives in regen_service.train and regen_service.deploy,
imported inside each command so `regen --help` starts without torch."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import click

from regen_service.cli.base import main
from regen_service.errors import ConfigError


def _target(path: str | None):
    if path is None:
        return None
    from regen_service.draft.sglang_format import load_target_info

    try:
        return load_target_info(path)
    except (FileNotFoundError, ValueError) as e:
        raise click.UsageError(str(e)) from None


def _report_out(report, as_json: bool, extra: dict | None = None) -> None:
    from regen_service.draft.validate import format_report

    if as_json:
        click.echo(json.dumps({"ok": report.ok, **report.model_dump(), **(extra or {})}, indent=2))
    else:
        click.echo(format_report(report))


def _refused(e, as_json: bool) -> None:
    _report_out(e.report, as_json, {"refused": str(e), "kept": str(e.kept) if e.kept else None})
    click.echo(f"error: {e}" + (f" (files kept in {e.kept})" if e.kept else ""), err=True)
    sys.exit(1)


_out = click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Output directory.")
_overwrite = click.option("--overwrite", is_flag=True, help="Replace a non-empty --out.")
_keep = click.option("--keep-failed", is_flag=True, help="Keep a refused result in a temp dir to inspect.")
_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
_dtypes = click.Choice(["bfloat16", "float16", "float32", "keep"])
_engine = click.option(
    "--engine",
    type=click.Choice(["sglang", "vllm"]),
    default="sglang",
    show_default=True,
    help="The engine that serves the draft: the two read eagle_aux_hidden_state_layer_ids differently.",
)


@main.command("export")
@click.argument("ckpt", type=click.Path(exists=True))
@_out
@click.option(
    "--target-config", type=click.Path(exists=True), help="Target's config.json (or folder) to check against."
)
@click.option("--dtype", type=_dtypes, default="bfloat16", show_default=True, help="Float tensor dtype.")
@_engine
@_overwrite
@_keep
@_json
def export_cmd(ckpt, out, target_config, dtype, engine, overwrite, keep_failed, as_json):
    """Export a trainer checkpoint (step dir, or the trainer's --out via checkpoints/latest) for SGLang or
    vLLM (--engine)."""
    from regen_service.draft.export import ExportRefused, export_checkpoint

    try:
        report = export_checkpoint(
            ckpt,
            out,
            target=_target(target_config),
            dtype=dtype,
            overwrite=overwrite,
            keep_failed=keep_failed,
            engine=engine,
        )
    except ExportRefused as e:
        _refused(e, as_json)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    _report_out(report, as_json)


@main.command("validate-draft")
@click.argument("draft", type=click.Path())
@click.option("--target-config", type=click.Path(exists=True), help="Target's config.json or its folder.")
@_engine
@_json
def validate_draft_cmd(draft, target_config, engine, as_json):
    """Check that the engine loads DRAFT correctly for the target; exit 1 listing every problem and its fix."""
    from regen_service.draft.validate import validate_draft

    report = validate_draft(draft, _target(target_config), engine)
    if target_config is None:
        report.add(
            "no_target",
            "no --target-config: fc width, vocab_size and aux layer ranges were not checked against the target",
            "pass --target-config PATH (the target's config.json or its folder)",
            severity="warning",
        )
    _report_out(report, as_json)
    sys.exit(0 if report.ok else 1)


@main.command("convert-draft")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@_out
@click.option("--target-config", type=click.Path(exists=True), help="Target's config.json (recommended).")
@click.option("--dtype", type=_dtypes, default="keep", show_default=True)
@_overwrite
@_keep
@_json
def convert_draft_cmd(src, out, target_config, dtype, overwrite, keep_failed, as_json):
    """Convert a speculators-format EAGLE-3 draft (layers.0.*, Eagle3Speculator) to SGLang's format."""
    from regen_service.draft.convert import convert_draft
    from regen_service.draft.export import ExportRefused

    try:
        report, notes = convert_draft(
            src, out, target=_target(target_config), dtype=dtype, overwrite=overwrite, keep_failed=keep_failed
        )
    except ExportRefused as e:
        _refused(e, as_json)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if not as_json:
        for n in notes:
            click.echo(f"note: {n}")
    _report_out(report, as_json, {"notes": notes})


def _print_or_exec(build, print_only: bool) -> None:
    """Build a server's launch (its preflight may refuse it, with the report), then print or exec it."""
    from pydantic import ValidationError

    from regen_service.deploy.launch import DraftPreflightError
    from regen_service.draft.validate import format_report

    try:
        launch = build()
    except ValidationError as e:
        raise click.UsageError(
            "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        ) from None
    except DraftPreflightError as e:
        click.echo(format_report(e.report), err=True)
        raise click.ClickException(f"{e}. Fix the draft (see above) and run again.") from None
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if print_only:
        click.echo(launch.shell())
        return
    click.echo(f"exec: {launch.shell()}", err=True)
    os.execvpe(launch.argv[0], launch.argv, {**os.environ, **launch.env})


@main.command("launch-sglang")
@click.option("--target", required=True, help="Target model directory (its config.json checks the draft).")
@click.option("--draft", type=click.Path(), help="EAGLE-3 draft directory; validated before launch.")
@click.option(
    "--speculative-algorithm", "algo", help="Default EAGLE3; EAGLE is refused for an EAGLE-3 draft."
)
@click.option("--spec-steps", type=int, default=3, show_default=True, help="--speculative-num-steps")
@click.option("--spec-topk", type=int, default=1, show_default=True, help="--speculative-eagle-topk")
@click.option("--spec-draft-tokens", type=int, help="--speculative-num-draft-tokens [steps+1 when topk is 1]")
@click.option("--tp", type=int, default=8, show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--extra", multiple=True, help="Extra SGLang argument (repeatable; shell-split).")
@click.option("--print", "print_only", is_flag=True, help="Print the command instead of running it.")
def launch_sglang_cmd(
    target, draft, algo, spec_steps, spec_topk, spec_draft_tokens, tp, port, host, extra, print_only
):
    """Launch SGLang for the target (Kimi-K2.5 flags, metrics on), refusing a draft it would serve wrong.
    The API key comes from REGEN_ENDPOINT_API_KEY (or REGEN_ENDPOINT_API_KEY_FILE) and is never printed."""
    import shlex

    from regen_service.deploy.launch import LaunchSpec, SpecParams, api_key_from_env, build_launch

    def build():
        params = SpecParams(
            num_steps=spec_steps,
            eagle_topk=spec_topk,
            num_draft_tokens=spec_draft_tokens if spec_draft_tokens is not None else spec_steps + 1,
        )
        spec = LaunchSpec(
            target=target,
            draft=draft,
            speculative_algorithm=algo,
            spec=params,
            tp=tp,
            port=port,
            host=host,
            api_key=api_key_from_env(),
            extra=[a for e in extra for a in shlex.split(e)],
        )
        return build_launch(spec)

    _print_or_exec(build, print_only)


@main.command("launch-vllm")
@click.option("--target", required=True, help="Target model directory (its config.json checks the draft).")
@click.option("--served-model-name", help="Name the server answers to [default: the target folder's name].")
@click.option(
    "--draft", type=click.Path(), help="EAGLE-3 draft directory (exported --engine vllm); validated."
)
@click.option("--spec-tokens", type=int, default=3, show_default=True, help="num_speculative_tokens")
@click.option(
    "--hidden-states",
    "hidden_states_dir",
    type=click.Path(file_okay=False),
    help="Serve the trainer's target states (regen train --target-backend vllm), written to this folder.",
)
@click.option("--aux-layers", help="Captured layer inputs with --hidden-states, e.g. 2,30,58 [default rule].")
@click.option("--tp", type=int, default=1, show_default=True, help="--tensor-parallel-size")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--max-model-len", type=int)
@click.option("--gpu-memory-gib", type=float, help="Memory per GPU, for the fit check [default: GPU 0's].")
@click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--python", "python_exe", help="The engine environment's python [default: this one].")
@click.option("--extra", multiple=True, help="Extra vLLM argument (repeatable; shell-split).")
@click.option("--print", "print_only", is_flag=True, help="Print the command instead of running it.")
def launch_vllm_cmd(target, served_model_name, draft, spec_tokens, hidden_states_dir, aux_layers, tp, port,
                    host, max_model_len, gpu_memory_gib, gpu_memory_utilization, python_exe, extra,
                    print_only):  # fmt: skip
    """Launch vLLM's OpenAI server for the target: plain, with an EAGLE-3 draft (validated for vLLM), or
    capturing the trainer's hidden states. The API key comes from REGEN_ENDPOINT_API_KEY and is never printed."""
    import shlex

    from regen_service.deploy.launch import api_key_from_env
    from regen_service.deploy.launch_vllm import VllmLaunchSpec, build_vllm_launch

    try:
        layers = [int(x) for x in aux_layers.split(",")] if aux_layers else None
    except ValueError:
        raise click.UsageError(
            f"--aux-layers {aux_layers!r}: give comma-separated layer numbers, e.g. 2,30,58"
        ) from None

    def build():
        spec = VllmLaunchSpec(
            target=target, served_model_name=served_model_name, draft=draft, num_speculative_tokens=spec_tokens,
            hidden_states_dir=hidden_states_dir, aux_layer_ids=layers, tp=tp, host=host, port=port,
            max_model_len=max_model_len, gpu_memory_gib=gpu_memory_gib,
            gpu_memory_utilization=gpu_memory_utilization, api_key=api_key_from_env(),
            extra=[a for e in extra for a in shlex.split(e)], **({"python": python_exe} if python_exe else {}),
        )  # fmt: skip
        return build_vllm_launch(spec)

    _print_or_exec(build, print_only)


@main.command("bench-spec")
@click.option("--endpoint", required=True, help="Speculative SGLang or vLLM server base URL.")
@click.option("--baseline", help="Server without speculation, for the speed-up.")
@click.option("--prompts", "prompts_file", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--concurrency", multiple=True, type=int, default=(1,), show_default=True, help="Repeatable.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--limit", type=int, help="Use only the first N prompts.")
@click.option(
    "--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per request, seconds."
)
@_json
def bench_spec_cmd(endpoint, baseline, prompts_file, concurrency, max_new_tokens, limit, timeout_s, as_json):
    """Accept length, tokens/s and speed-up of a speculative endpoint; exit 1 when speculation collapsed."""
    from regen_service.deploy.benchspec import bench, format_bench, load_prompts
    from regen_service.deploy.launch import api_key_from_env

    try:
        prompts = load_prompts(prompts_file, limit)
        report = asyncio.run(
            bench(
                endpoint.rstrip("/"),
                prompts,
                sorted(set(concurrency)),
                baseline=baseline.rstrip("/") if baseline else None,
                max_new_tokens=max_new_tokens,
                api_key=api_key_from_env(),
                timeout_s=timeout_s,
            )
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    click.echo(report.model_dump_json(indent=2) if as_json else format_bench(report))
    sys.exit(1 if report.collapsed else 0)
