"""CLI commands of the drafter: `regen train` and `regen make-tiny-target` (export/validate commands are
added by their owners).

torch and transformers are imported inside the command, so `regen --help` stays fast and works on
hosts without them.
"""

from __future__ import annotations

import json
import logging
import sys

import click

from regen_service.cli.base import main, quiet_drivers, run_id_param


@main.command("train")
@click.option(
    "--run", "run_id", required=True, callback=run_id_param, help="Run id whose output shards to train on."
)
@click.option(
    "--target", "target_path", required=True, help="Local Hugging Face directory of the target model."
)
@click.option("--out", "out_dir", required=True, help="Output directory (checkpoints/, metrics.jsonl).")
@click.option(
    "--follow", is_flag=True, help="Keep training as shards land; stop when the run is done and consumed."
)
@click.option("--config", "config_path", default=None, help="train.yaml (TrainConfig fields).")
@click.option(
    "--group",
    default="trainer",
    show_default=True,
    help="Redis consumer group shared by cooperating trainers.",
)
@click.option(
    "--consumer", default=None, help="Consumer name in the group (default: derived from host and --out)."
)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option(
    "--target-backend",
    type=click.Choice(["hf", "vllm"]),
    default=None,
    help="target states from a local HF copy, or from a vLLM engine holding the target [config: hf]",
)
@click.option("--target-endpoint", default=None, help="the vLLM engine's URL (--target-backend vllm)")
@click.option(
    "--target-states-dir",
    default=None,
    help="the folder that engine writes states to (its launch-vllm --hidden-states DIR); only it is read",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    default=None,
    help="Let the target folder's own Python code run (auto_map, e.g. Kimi-K2.5's tokenizer).",
)
@click.option(
    "--report-to",
    default=None,
    help="Trackers, comma-separated: tensorboard (OUT/tb), wandb, mlflow, or none [config: tensorboard].",
)
def train_cmd(
    run_id,
    target_path,
    out_dir,
    follow,
    config_path,
    group,
    consumer,
    device,
    target_backend,
    target_endpoint,
    target_states_dir,
    trust_remote_code,
    report_to,
) -> None:
    """Train the EAGLE-3 draft from RUN's output shards (under torchrun: data-parallel over all ranks)."""
    from regen_service.errors import ConfigError, RegenError
    from regen_service.settings import Settings
    from regen_service.state.ledger import check_reachable
    from regen_service.state.storage import check_data_root
    from regen_service.train.config import TrainConfig
    from regen_service.train.loop import train_from_run

    settings = Settings.from_env()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_drivers(settings.log_level)
    try:
        check_reachable(settings)  # one line each, before any weight is loaded
        check_data_root(settings.data_root_resolved)
        cfg = TrainConfig.load(
            config_path,
            target_backend=target_backend,
            target_endpoint=target_endpoint,
            target_states_dir=target_states_dir,
            trust_remote_code=trust_remote_code or None,
            report_to=[t.strip() for t in report_to.split(",") if t.strip()] if report_to else None,
        )
        summary = train_from_run(
            settings,
            run_id,
            target_path,
            out_dir,
            cfg,
            follow=follow,
            group=group,
            consumer=consumer,
            device=device,
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    except RegenError as e:  # e.g. the vLLM target backend's EngineStateError: a message, not a traceback
        raise click.ClickException(str(e)) from None
    if summary.get("eval"):  # rank 0's summary carries the eval; the table goes to stderr, the JSON to stdout
        from regen_service.train.evaluate import format_table

        click.echo(format_table(summary["eval"], summary.get("best")), err=True)
    click.echo(json.dumps(summary, default=str))
    sys.stdout.flush()
    if summary.get("unannounced_shards"):
        # Not "done": the ledger lost these shards' events, so this trainer never saw them.
        raise click.ClickException(
            f"shards {summary['unannounced_shards']} of run {run_id} are finished in storage but were never "
            f"on its event stream (Redis lost them): run `regen resume {run_id}`, then train again"
        )


@main.command("make-tiny-target")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--layers", type=int, default=4, show_default=True, help="decoder layers (EAGLE-3 needs >= 4)")
@click.option("--hidden", type=int, default=128, show_default=True, help="hidden size")
@click.option("--heads", type=int, default=4, show_default=True, help="attention heads")
@click.option("--kv-heads", type=int, default=2, show_default=True, help="key/value heads")
@click.option("--seed", type=int, default=0, show_default=True)
def make_tiny_target_cmd(
    out_dir: str, layers: int, hidden: int, heads: int, kv_heads: int, seed: int
) -> None:
    """Write a tiny random Llama target (the demo tokenizer) to OUT_DIR, for CPU dry runs of `regen train`
    and of vLLM's CPU build (which needs hidden/heads >= 32: the defaults give 32)."""
    from regen_service.train.fixtures import make_tiny_target

    if layers < 4 or hidden % heads or heads % kv_heads:
        raise click.ClickException(
            "--layers must be >= 4, --heads must divide --hidden and --kv-heads must divide --heads"
        )
    path = make_tiny_target(out_dir, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=seed)
    config = json.loads((path / "config.json").read_text())
    click.echo(
        f"tiny target in {path}: {layers} layers, hidden {hidden}, head_dim {hidden // heads}, vocabulary "
        f"{config['vocab_size']}, max_position_embeddings {config['max_position_embeddings']}; train on it "
        f"with e.g. draft_vocab_size: 512 and max_length: 256 in train.yaml"
    )
