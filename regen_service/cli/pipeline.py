"""CLI commands of the pipeline: enqueue, worker, status, resume, retry-failed, flower, demo.

Each command reads Settings from the environment once and passes it down; the library does the work.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import click

from regen_service.cli.base import main, run_id_param
from regen_service.errors import ConfigError
from regen_service.settings import Settings, redact_url
from schemas.mix import MixError


def _settings() -> Settings:
    try:
        return Settings.from_env()
    except ValueError as e:
        raise click.ClickException(f"bad environment settings: {e}") from None


def _setup_logging(settings: Settings) -> None:
    from regen_service.client.auth import install_log_scrubber

    install_log_scrubber()  # no log line of this process carries an API key or a URL password
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


@main.command()
@click.argument("mix", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="print a JSON object instead of text")
@click.option(
    "--no-reuse",
    is_flag=True,
    help="ask every prompt, even ones answered by earlier runs with the same settings",
)
def enqueue(mix: str, as_json: bool, no_reuse: bool) -> None:
    """Prepare MIX (a mix YAML) as a run under $REGEN_DATA_ROOT and queue one task per shard.

    The run id comes from the mix's content: enqueueing the same mix again sends nothing and says so.
    """
    from regen_service.producer import enqueue as do_enqueue

    settings = _settings()
    _setup_logging(settings)
    try:
        res = do_enqueue(settings, mix, reuse=not no_reuse)
    except (MixError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _print_json(res.as_dict())
        return
    click.echo(res.run_id)
    click.echo(res.message, err=True)


def read_api_key(env_var: str, key_file: str | None):
    """The endpoints' key: from --api-key-file (one line, stripped), else from the variable if set."""
    from regen_service.client.auth import load_api_key

    try:
        if key_file:
            return load_api_key(file=key_file)
        return load_api_key(env_var=env_var) if os.environ.get(env_var) else None
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.option(
    "--endpoint", "endpoints", multiple=True, required=True, help="SGLang base URL; repeat for several"
)
@click.option(
    "--concurrency",
    type=int,
    default=2,
    show_default=True,
    help="shards worked on at once (the next shard fills the pool while one drains its tail)",
)
@click.option(
    "--max-inflight-per-endpoint",
    type=int,
    default=None,
    help="requests outstanding per endpoint [default: from the server's max_running_requests]",
)
@click.option(
    "--api-key-env",
    default="REGEN_ENDPOINT_API_KEY",
    show_default=True,
    help="environment variable holding the endpoints' API key (sent as Bearer)",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="file holding the endpoints' API key (beats --api-key-env)",
)
@click.option("--no-stream", is_flag=True, help="use non-streaming requests")
@click.option(
    "--engine",
    type=click.Choice(["auto", "sglang", "vllm"]),
    default="auto",
    show_default=True,
    help="what serves the endpoints: detected from their info paths, or forced (behind a proxy)",
)
@click.option("--stall-timeout-s", type=float, default=60.0, show_default=True)
@click.option("--request-timeout-s", type=float, default=3600.0, show_default=True,
              help="one request attempt, end to end; 0 for no limit")  # fmt: skip
@click.option("--max-reply-bytes", type=int, default=16 << 20, show_default=True,
              help="a larger non-streaming reply, error body or stream line is cut (retryable)")  # fmt: skip
@click.option("--stream-slack-events", type=int, default=256, show_default=True,
              help="a stream is cut once it sent this many events past max_new_tokens")  # fmt: skip
@click.option("--max-attempts", type=int, default=6, show_default=True)
@click.option("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
@click.option("--metrics-address", default="127.0.0.1", show_default=True,
              help="address the metrics server binds (0.0.0.0: every interface)")  # fmt: skip
@click.option("--hostname", default=None, help="Celery node name [default: regen@<host>-<pid>]")
def worker(endpoints, concurrency, max_inflight_per_endpoint, api_key_env, api_key_file, no_stream, engine,
           stall_timeout_s, request_timeout_s, max_reply_bytes, stream_slack_events, max_attempts,
           metrics_port, metrics_address, hostname) -> None:  # fmt: skip
    """Run a Celery worker that answers shards against the given SGLang or vLLM endpoints."""
    import socket

    from regen_service.runtime import WorkerConfig
    from workers import celery_app

    settings = _settings()
    _setup_logging(settings)
    node = hostname or f"regen@{socket.gethostname()}-{os.getpid()}"
    try:
        config = WorkerConfig(
            endpoints=list(endpoints), num_shards_in_parallel=concurrency,
            api_key=read_api_key(api_key_env, api_key_file), max_inflight_per_endpoint=max_inflight_per_endpoint,
            stream=not no_stream, engine=engine, stall_timeout_s=stall_timeout_s, max_attempts=max_attempts,
            request_timeout_s=request_timeout_s or None, max_reply_bytes=max_reply_bytes,
            stream_slack_events=stream_slack_events,
            metrics_port=metrics_port, hostname=node,
        )  # fmt: skip
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_address)
    logging.getLogger("regen.worker").info(
        "worker %s: broker %s, queue %s, endpoints %s", node, settings.redis_url_redacted, settings.queue_name,
        ", ".join(redact_url(e) for e in endpoints),
    )  # fmt: skip
    celery_app.configure(settings, config)
    celery_app.app.worker_main(
        ["worker", "--pool=threads", f"--concurrency={concurrency}", "-Q", settings.queue_name, "-E",
         "--without-gossip", "--without-mingle", "-n", node, f"--loglevel={settings.log_level}"]
    )  # fmt: skip


@main.command()
@click.argument("run_id", required=False, callback=run_id_param)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", type=float, default=None, help="refresh every N seconds until the run is done")
def status(run_id: str | None, as_json: bool, watch: float | None) -> None:
    """Progress of RUN_ID (or of every run): shards, prompts, tokens, tokens/s, ETA, per source."""
    from regen_service.ledger import Ledger
    from regen_service.status import render, run_status

    ledger = Ledger(_settings())
    while True:
        ids = [run_id] if run_id else ledger.run_ids()
        statuses = [s for s in (run_status(ledger, r) for r in ids) if s]
        if run_id and not statuses:
            raise click.ClickException(
                f"run {run_id!r} is not in the ledger; if Redis was wiped, `regen resume {run_id}` rebuilds it"
            )
        if as_json:
            _print_json(statuses[0] if run_id else {"runs": statuses})
        else:
            render(statuses)
        if not watch or all(s["state"] in ("done", "failed") for s in statuses):
            return
        time.sleep(watch)


@main.command()
@click.argument("run_id", callback=run_id_param)
@click.option("--json", "as_json", is_flag=True)
def resume(run_id: str, as_json: bool) -> None:
    """Rebuild RUN_ID's ledger from the data root and queue its unfinished shards (safe to repeat)."""
    from regen_service.resume import resume_run

    try:
        res = resume_run(_settings(), run_id)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _print_json(res.as_dict())
    else:
        click.echo(
            f"{run_id}: {res.shards_done}/{res.shards_total} shards done; queued {len(res.shards_sent)}, "
            f"{len(res.shards_leased)} held by live workers, {len(res.shards_already_queued)} already queued"
            + ("; ledger rebuilt from storage" if res.ledger_rebuilt else "")
        )


@main.command("retry-failed")
@click.argument("run_id", callback=run_id_param)
@click.option("--include-terminal", is_flag=True, help="also re-ask rows with terminal errors (e.g. 4xx)")
def retry_failed_cmd(run_id: str, include_terminal: bool) -> None:
    """Send rows of RUN_ID that exhausted their retries back through the queue."""
    from regen_service.resume import retry_failed

    _print_json(retry_failed(_settings(), run_id, include_terminal=include_terminal))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--port", type=int, default=5555, show_default=True)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="address to listen on (0.0.0.0: every interface, e.g. inside a container)",
)
@click.option(
    "--basic-auth",
    envvar="FLOWER_BASIC_AUTH",
    default=None,
    help="user:password (env FLOWER_BASIC_AUTH); required unless --no-auth",
)
@click.option("--no-auth", is_flag=True, help="serve without authentication (local use only)")
@click.pass_context
def flower(ctx: click.Context, port: int, address: str, basic_auth: str | None, no_auth: bool) -> None:
    """Start Flower on the same broker settings as the workers (one visibility timeout for all).

    Every route but /healthcheck (including /metrics and the API) demands the credentials."""
    from regen_service.flower_guard import check_basic_auth, guard_every_route
    from workers import celery_app

    settings = _settings()
    if not basic_auth and not no_auth:
        raise click.ClickException(
            "Flower needs --basic-auth user:password (or FLOWER_BASIC_AUTH), or --no-auth"
        )
    if basic_auth:
        try:
            check_basic_auth(basic_auth)
        except ConfigError as e:
            raise click.ClickException(str(e)) from None
    guard_every_route()
    celery_app.configure(settings, None)  # type: ignore[arg-type]
    args = ["flower", f"--port={port}", f"--address={address}", *ctx.args]
    if basic_auth:
        args.append(f"--basic-auth={basic_auth}")
    celery_app.app.start(args)


@main.command()
@click.option(
    "--mix",
    "mix_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="mix to run [default: the bundled sample mix]",
)
@click.option("--timeout-s", type=float, default=300.0, show_default=True)
def demo(mix_path: str | None, timeout_s: float) -> None:
    """Run the whole pipeline locally: simulator, one worker, the bundled mix, on the Redis already running."""
    from regen_service.demo import run_demo

    try:
        code = run_demo(_settings(), mix_path=mix_path, timeout_s=timeout_s)
    except (ConfigError, MixError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
