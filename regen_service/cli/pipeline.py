"""CLI commands of the pipeline: enqueue, worker, flower, demo (status, runs, resume and retry-failed are
in regen_service.cli.runs).

Each command reads Settings from the environment once and passes it down; the library does the work.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import click
from pydantic import ValidationError

from regen_service.cli.base import main, quiet_drivers
from regen_service.cli.config_options import config_option, config_values
from regen_service.errors import ConfigError
from regen_service.produce.data_report import DEFAULT_MAX_QUARANTINED_FRACTION, format_report, source_warnings
from regen_service.settings import Settings, redact_url
from regen_service.state.ledger import check_reachable
from regen_service.state.storage import check_data_root
from regen_service.work.worker_config import WorkerConfig
from schemas.mix import MixError

_ENV_OF_FIELD = {
    "redis_url": "REGEN_REDIS_URL", "data_root": "REGEN_DATA_ROOT", "key_prefix": "REGEN_KEY_PREFIX",
    "visibility_timeout_s": "REGEN_VISIBILITY_TIMEOUT_S", "lease_ttl_s": "REGEN_LEASE_TTL_S",
    "heartbeat_s": "REGEN_HEARTBEAT_S", "log_level": "REGEN_LOG_LEVEL", "redis_ca_certs": "REGEN_REDIS_CA_CERTS",
}  # fmt: skip


def _settings(*, need_redis: bool = False) -> Settings:
    """Settings from the environment; a bad value or (with need_redis) an unreachable Redis is one line."""
    try:
        settings = Settings.from_env()
    except ValidationError as e:
        problems = []
        for err in e.errors():
            var = _ENV_OF_FIELD.get(str(err["loc"][0]), str(err["loc"][0]))
            msg = str(err["msg"]).removeprefix("Value error, ")
            problems.append(msg if msg.startswith(var) else f"{var}: {msg}")
        problems = "; ".join(problems)
        raise click.ClickException(f"bad environment settings: {problems}") from None
    if need_redis:
        check_reachable(settings)  # LedgerUnreachableError: one line, from the regen group
        check_data_root(settings.data_root_resolved)  # DataRootUnreachableError: likewise
    return settings


def _setup_logging(settings: Settings) -> None:
    from regen_service.work.client.auth import install_log_scrubber

    install_log_scrubber()  # no log line of this process carries an API key or a URL password
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_drivers(settings.log_level)


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
@click.option(
    "--strict",
    is_flag=True,
    help="queue nothing and exit 1 when a source keeps nothing or quarantines too much",
)
@click.option(
    "--max-quarantined-fraction",
    type=click.FloatRange(0, 1),
    default=DEFAULT_MAX_QUARANTINED_FRACTION,
    show_default=True,
    help="warn about a source that quarantines more than this fraction of its rows",
)
@click.option("--redo", is_flag=True, help="this mix was enqueued before: make a new run of it (id <run id>-rN) "
              "that asks every prompt again; the earlier run stays as it is")  # fmt: skip
def enqueue(
    mix: str, as_json: bool, no_reuse: bool, strict: bool, max_quarantined_fraction: float, redo: bool
) -> None:
    """Prepare MIX (a mix YAML) as a run under $REGEN_DATA_ROOT and queue one task per shard.

    The run id comes from the mix's content: enqueueing the same mix again sends nothing and says so.
    Prints what each source kept and quarantined (with the top reasons) and warns about sources that
    keep nothing or quarantine more than --max-quarantined-fraction; with --strict such a run is
    prepared but not queued, and the command exits 1. --no-reuse applies to a new run only.
    """
    from regen_service.produce.producer import enqueue as do_enqueue

    settings = _settings()
    _setup_logging(settings)
    try:
        res = do_enqueue(
            settings,
            mix,
            reuse=not no_reuse,
            strict_fraction=max_quarantined_fraction if strict else None,
            redo=redo,
        )
    except (MixError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    warnings = source_warnings(res.sources, max_quarantined_fraction)
    if as_json:
        _print_json({**res.as_dict(), "warnings": warnings})
    else:
        click.echo(res.run_id)
        click.echo(res.message, err=True)
        click.echo(format_report(res.sources), err=True)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)


def read_api_key(env_var: str, key_file: str | None):
    """The endpoints' key: from --api-key-file (one line, stripped), else from the variable if set."""
    from regen_service.work.client.auth import load_api_key

    try:
        if key_file:
            return load_api_key(file=key_file)
        return load_api_key(env_var=env_var) if os.environ.get(env_var) else None
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@config_option(WorkerConfig, "pool.endpoints", "--endpoint", help="SGLang base URL; repeat for several")
@config_option(WorkerConfig, "bounds.max_shards_in_hand", "--max-shards-in-hand", "--concurrency")
@config_option(WorkerConfig, "bounds.exit_after_no_endpoint_s", "--exit-after-no-endpoint-s")
@config_option(WorkerConfig, "bounds.max_request_image_bytes", "--max-request-image-bytes")
@config_option(WorkerConfig, "pool.max_inflight_per_endpoint", "--max-inflight-per-endpoint")
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
@config_option(WorkerConfig, "pool.stream", "--no-stream", help="use non-streaming requests")
@config_option(WorkerConfig, "pool.engine", "--engine")
@config_option(WorkerConfig, "pool.stall_timeout_s", "--stall-timeout-s")
@config_option(WorkerConfig, "pool.request_timeout_s", "--request-timeout-s",
               help="one request attempt, end to end; 0 for no limit")  # fmt: skip
@config_option(WorkerConfig, "pool.max_reply_bytes", "--max-reply-bytes")
@config_option(WorkerConfig, "pool.stream_slack_events", "--stream-slack-events")
@config_option(WorkerConfig, "pool.max_attempts", "--max-attempts")
@config_option(WorkerConfig, "metrics_port", "--metrics-port")
@config_option(WorkerConfig, "metrics_address", "--metrics-address")
@config_option(WorkerConfig, "hostname", "--hostname")
@config_option(WorkerConfig, "trust_remote_code", "--trust-remote-code")
def worker(api_key_env, api_key_file, **options) -> None:
    """Run a Celery worker that answers shards against the given SGLang or vLLM endpoints."""
    import socket

    from regen_service.work.worker_app import WorkerApp

    settings = _settings()
    _setup_logging(settings)
    values = config_values(options)
    values["hostname"] = values["hostname"] or f"regen@{socket.gethostname()}-{os.getpid()}"
    values["pool"]["request_timeout_s"] = values["pool"]["request_timeout_s"] or None  # 0: no limit
    values["pool"]["api_key"] = read_api_key(api_key_env, api_key_file)
    try:
        config = WorkerConfig.model_validate(values)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    node, endpoints = config.hostname, config.pool.endpoints
    metrics_port, metrics_address = config.metrics_port, config.metrics_address
    check_reachable(settings)
    check_data_root(settings.data_root_resolved)  # before the worker takes any shard
    if metrics_port:
        from prometheus_client import start_http_server

        try:
            start_http_server(metrics_port, addr=metrics_address)
        except OSError as e:
            raise click.ClickException(
                f"--metrics-port {metrics_port}: cannot listen on {metrics_address} ({e.strerror}); pick a free "
                "port or leave --metrics-port out"
            ) from None
    logging.getLogger("regen.worker").info(
        "worker %s: broker %s, queue %s, endpoints %s", node, settings.redis_url_redacted, settings.queue_name,
        ", ".join(redact_url(e) for e in endpoints),
    )  # fmt: skip
    worker_app = WorkerApp(settings, config)
    try:
        worker_app.app.worker_main(
            ["worker", "--pool=threads", f"--concurrency={config.bounds.max_shards_in_hand}", "--prefetch-multiplier=1",
             "-Q", settings.queue_name, "-E", "--without-gossip", "--without-mingle", "-n", node,
             f"--loglevel={settings.log_level}"]
        )  # fmt: skip
    finally:
        if code := worker_app.final_exit_code():
            if not worker_app.exit_code:
                logging.getLogger("regen.worker").error(
                    "the Celery worker stopped on an unrecoverable error (above); exiting %d for the supervisor "
                    "to restart it (`regen status` says what is wrong with Redis, if that is it)", code
                )  # fmt: skip
            sys.exit(code)


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
    help="user:password from env FLOWER_BASIC_AUTH (on the command line it shows in `ps`: use the env or "
    "--basic-auth-file); required unless --basic-auth-file or --no-auth",
)
@click.option(
    "--basic-auth-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="a file holding user:password (e.g. a Docker secret); wins over FLOWER_BASIC_AUTH",
)
@click.option("--no-auth", is_flag=True, help="serve without authentication (local use only)")
@click.pass_context
def flower(
    ctx: click.Context,
    port: int,
    address: str,
    basic_auth: str | None,
    basic_auth_file: str | None,
    no_auth: bool,
) -> None:
    """Start Flower on the same broker settings as the workers (one visibility timeout for all).

    Every route but /healthcheck (including /metrics and the API) demands the credentials, which reach
    Flower through its environment, never a command line."""
    from click.core import ParameterSource

    from regen_service.deploy.flower_guard import (
        check_basic_auth,
        guard_every_route,
        hand_to_flower,
        read_basic_auth_file,
    )
    from regen_service.work.worker_app import WorkerApp

    settings = _settings()
    on_command_line = ctx.get_parameter_source("basic_auth") == ParameterSource.COMMANDLINE
    if on_command_line and basic_auth_file:
        raise click.ClickException("give the credentials once: --basic-auth or --basic-auth-file, not both")
    try:
        if basic_auth_file:
            basic_auth = read_basic_auth_file(basic_auth_file)
        if not basic_auth and not no_auth:
            raise ConfigError(
                "Flower needs credentials: --basic-auth-file PATH (a file holding user:password) or "
                "FLOWER_BASIC_AUTH=user:password, or --no-auth"
            )
        if basic_auth:
            check_basic_auth(basic_auth)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    if on_command_line:
        click.echo(
            "warning: --basic-auth puts the password in this process's command line, which every user of "
            "this host can read (ps, /proc/PID/cmdline); use --basic-auth-file PATH or FLOWER_BASIC_AUTH",
            err=True,
        )
    guard_every_route()
    args = ["flower", f"--port={port}", f"--address={address}", *ctx.args]
    if basic_auth:
        hand_to_flower(basic_auth)
    WorkerApp(settings).app.start(args)


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
    from regen_service.cli.demo import run_demo

    try:
        code = run_demo(_settings(), mix_path=mix_path, timeout_s=timeout_s)
    except (ConfigError, MixError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
