"""`regen worker`'s options come from WorkerConfig: each flag's default, type and choices are the field's,
and the parameters fold back into the nested config (pool, bounds) the worker validates."""

from __future__ import annotations

import click
from pydantic_core import PydanticUndefined

from regen_service.cli import main
from regen_service.cli.config_options import config_values, field_at
from regen_service.work.worker_config import WorkerConfig

FLAGS = [
    "--endpoint", "--max-shards-in-hand", "--concurrency", "--exit-after-no-endpoint-s", "--max-request-image-bytes",
    "--max-inflight-per-endpoint", "--api-key-env", "--api-key-file", "--no-stream", "--engine",
    "--stall-timeout-s", "--request-timeout-s", "--max-reply-bytes", "--stream-slack-events", "--max-attempts",
    "--metrics-port", "--metrics-address", "--hostname", "--trust-remote-code",
]  # fmt: skip


def _worker() -> click.Command:
    return main.commands["worker"]


def test_the_worker_keeps_every_flag():
    flags = [f for p in _worker().params for f in p.opts]
    assert [f for f in flags if f != "--help"] == FLAGS


def test_each_setting_flag_takes_its_default_and_type_from_the_config():
    settings = [p for p in _worker().params if "__" in p.name or p.name in WorkerConfig.model_fields]
    assert len(settings) == 16  # --concurrency is --max-shards-in-hand
    for param in settings:
        field = field_at(WorkerConfig, param.name.replace("__", "."))
        default = None if field.default is PydanticUndefined else field.default
        assert param.default == default or (param.multiple and default is None), param.name
    engine = next(p for p in settings if p.name == "pool__engine")
    assert list(engine.type.choices) == ["auto", "sglang", "vllm"]


def test_parameters_fold_into_the_nested_config():
    values = config_values(
        {"pool__endpoints": ("http://h:1",), "bounds__max_shards_in_hand": 3, "hostname": "n"}
    )
    assert values == {
        "pool": {"endpoints": ["http://h:1"]},
        "bounds": {"max_shards_in_hand": 3},
        "hostname": "n",
    }
    config = WorkerConfig.model_validate(values)
    assert config.pool.endpoints == ["http://h:1"] and config.bounds.max_shards_in_hand == 3
    assert config.pool.stall_timeout_s == 60.0 and config.shard_log.flush_rows == 64
