"""Settings and the one Celery configuration every broker client shares."""

from __future__ import annotations

import pytest

from regen_service.settings import Settings, redact_url
from regen_service.state.queue import celery_config, make_celery


def test_every_broker_client_gets_the_same_exactly_once_settings():
    s = Settings.from_env({"REGEN_REDIS_URL": "redis://:pw@h:6379/2", "REGEN_VISIBILITY_TIMEOUT_S": "7200"})
    conf = celery_config(s)
    assert conf["accept_content"] == ["json"] and conf["task_serializer"] == "json"
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["broker_transport_options"]["visibility_timeout"] == 7200
    app = make_celery(s)
    assert app.conf.broker_transport_options["visibility_timeout"] == 7200
    assert app.conf.accept_content == ["json"]


def test_rediss_and_passwords():
    s = Settings.from_env({"REGEN_REDIS_URL": "rediss://user:s3cret@redis.example:6380/0"})
    assert celery_config(s)["broker_use_ssl"] == {"ssl_cert_reqs": "required"}
    assert "s3cret" not in s.redis_url_redacted and "***" in s.redis_url_redacted
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"


def test_bad_settings_say_how_to_fix():
    with pytest.raises(ValueError, match="redis://, rediss:// or unix://"):
        Settings.from_env({"REGEN_REDIS_URL": "http://127.0.0.1:6379"})
    with pytest.raises(ValueError, match="visibility_timeout_s"):
        Settings.from_env({"REGEN_VISIBILITY_TIMEOUT_S": "1"})
