"""CLI commands that find and show runs: status, runs, resume, retry-failed. A RUN argument is a run id, an id prefix
or a mix name (regen_service.state.find_runs); rendering is regen_service.cli.status_view's."""

from __future__ import annotations

import click

from regen_service.cli.base import main, run_id_param
from regen_service.cli.pipeline import _print_json, _settings
from regen_service.errors import ConfigError


def _resolve(settings, query: str):
    from regen_service.state.find_runs import resolve_run

    try:
        return resolve_run(settings, query)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@main.command()
@click.argument("run", required=False, callback=run_id_param)  # ids, prefixes, names: one charset
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", type=float, default=None, help="redraw every N seconds until the runs are done")
def status(run: str | None, as_json: bool, watch: float | None) -> None:
    """Progress of RUN (id, id prefix or mix name) or of every run: shards, prompts, tokens, ETA, per source.

    Without RUN it also lists runs under the data root that the ledger lost, and the demo's runs.
    """
    from regen_service.cli.status_view import show
    from regen_service.state.find_runs import list_runs
    from regen_service.state.ledger import Ledger
    from regen_service.state.status import run_status

    settings = _settings(need_redis=True)
    target = _resolve(settings, run) if run else None
    if target is not None and target.settings is None:
        raise click.ClickException(
            f"run {target.run_id} ({target.name}) is under the data root but not in the ledger (Redis lost "
            f"it?); `regen resume {target.run_id}` rebuilds it from storage and queues what is unfinished"
        )

    def fetch() -> tuple[list[dict], list[str]]:
        refs = [target] if target else list_runs(settings)
        statuses = []
        for ref in refs:
            if ref.settings is not None and (st := run_status(Ledger(ref.settings), ref.run_id)):
                if ref.settings.key_prefix != settings.key_prefix:
                    st["key_prefix"] = ref.settings.key_prefix
                statuses.append(st)
        return statuses, [r.run_id for r in refs if r.settings is None]

    if as_json:
        statuses, storage_only = fetch()
        _print_json(statuses[0] if target else {"runs": statuses, "not_in_ledger": storage_only})
        return
    show(fetch, watch)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def runs(as_json: bool) -> None:
    """Every run under the data root or in the ledger (the demo's too): id, mix name, where it is known."""
    from regen_service.state.find_runs import list_runs

    refs = list_runs(_settings(need_redis=True))
    rows = [
        {"run_id": r.run_id, "name": r.name, "in_storage": r.in_storage,
         "ledger_prefix": r.settings.key_prefix if r.settings else None}
        for r in refs
    ]  # fmt: skip
    if as_json:
        _print_json({"runs": rows})
        return
    if not rows:
        click.echo("no runs under the data root or in the ledger (enqueue one with `regen enqueue MIX.yaml`)")
    for r in rows:
        where = (
            f"ledger {r['ledger_prefix']}" if r["ledger_prefix"] else "not in the ledger: `regen resume` it"
        )
        click.echo(
            f"{r['run_id']}  {r['name'] or '-'}  {'storage' if r['in_storage'] else 'NO FILES'}  {where}"
        )


@main.command()
@click.argument("run", callback=run_id_param)
@click.option("--json", "as_json", is_flag=True)
def resume(run: str, as_json: bool) -> None:
    """Rebuild RUN's ledger from the data root and queue its unfinished shards first (safe to repeat).

    RUN is a run id, an id prefix or a mix name. Shards still held by a lease (a worker killed a moment
    ago holds it until it runs out) are not queued: the output says when the lease frees.
    """
    from regen_service.state.resume import resume_run

    settings = _settings(need_redis=True)
    ref = _resolve(settings, run)
    try:
        res = resume_run(ref.settings or settings, ref.run_id)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        _print_json(res.as_dict())
        return
    click.echo(
        f"{ref.run_id}: {res.shards_done}/{res.shards_total} shards done; queued {len(res.shards_sent)}, "
        f"{len(res.shards_leased)} held by leases, {len(res.shards_already_queued)} already queued"
        + ("; ledger rebuilt from storage" if res.ledger_rebuilt else "")
    )
    if res.shards_leased and res.lease_frees_in_s is not None:
        click.echo(
            f"{len(res.shards_leased)} shard(s) are leased (a live worker, or one killed a moment ago); the "
            f"last lease frees in {res.lease_frees_in_s:.0f}s: if no worker holds them, run "
            f"`regen resume {ref.run_id}` again after that",
            err=True,
        )


@main.command("retry-failed")
@click.argument("run", callback=run_id_param)
@click.option("--include-terminal", is_flag=True, help="also re-ask rows with terminal errors (e.g. 4xx)")
def retry_failed_cmd(run: str, include_terminal: bool) -> None:
    """Send rows of RUN that exhausted their retries back through the queue.

    RUN is a run id, an id prefix or a mix name, as for `regen status`."""
    from regen_service.state.resume import retry_failed

    settings = _settings(need_redis=True)
    ref = _resolve(settings, run)
    try:
        res = retry_failed(ref.settings or settings, ref.run_id, include_terminal=include_terminal)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    _print_json(res)
