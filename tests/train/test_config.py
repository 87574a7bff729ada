"""TrainConfig nested by concern: nested and flat train.yaml load the same config, a key given both ways is
refused, and checkpoints keep the flat form every earlier checkpoint holds."""

from __future__ import annotations

import pytest

from regen_service.errors import ConfigError
from regen_service.train.config import SECTION_OF, SECTIONS, TrainConfig

FLAT = """max_length: 256
draft_vocab_size: 512
lr: 0.0003
target_backend: vllm
target_endpoint: http://127.0.0.1:8000
target_states_dir: /tmp/states
eval_fraction: 0.1
report_to: [none]
keep_checkpoints: 2
"""

NESTED = """data: {max_length: 256}
model: {draft_vocab_size: 512}
optimisation: {lr: 0.0003}
target_states: {target_backend: vllm, target_endpoint: "http://127.0.0.1:8000", target_states_dir: /tmp/states}
evaluation: {eval_fraction: 0.1}
tracking: {report_to: [none]}
checkpoints: {keep_checkpoints: 2}
"""


def test_flat_and_nested_train_yaml_load_the_same_config(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(FLAT)
    nested.write_text(NESTED)
    a, b = TrainConfig.load(flat), TrainConfig.load(nested)
    assert a == b
    assert a.data.max_length == 256 and a.model.draft_vocab_size == 512 and a.optimisation.lr == 3e-4
    assert a.target_states.target_backend == "vllm" and a.tracking.report_to == ["none"]


def test_every_field_has_one_section_and_the_flat_form_round_trips():
    names = [k for model in SECTIONS.values() for k in model.model_fields]
    assert len(names) == len(set(names)) == len(SECTION_OF) == 48  # no field name in two sections
    assert not set(SECTIONS) & set(SECTION_OF)  # no section named like a field
    cfg = TrainConfig(max_length=64, ttt_length=3, eval_seed=2)
    flat = cfg.flat_dict()
    assert set(flat) == set(SECTION_OF) and flat["ttt_length"] == 3 and flat["max_length"] == 64
    assert TrainConfig.model_validate(flat) == cfg


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_length: 128\ndata: {max_length: 256}\n", r"max_length is given twice.*keep data\.max_length"),
        ("ttt_lenght: 3\n", "ttt_lenght"),  # unknown at the top level
        ("optimisation: {ttt_lenght: 3}\n", r"optimisation\.ttt_lenght"),  # unknown inside a section
    ],
)
def test_a_key_twice_or_unknown_is_refused_by_name(tmp_path, text, message):
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        TrainConfig.load(path)


def test_command_line_overrides_land_in_their_sections_over_the_file(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("tracking: {report_to: [tensorboard]}\ntarget_states: {trust_remote_code: false}\n")
    cfg = TrainConfig.load(path, report_to=["none"], trust_remote_code=True, target_endpoint=None)
    assert cfg.tracking.report_to == ["none"] and cfg.target_states.trust_remote_code is True
    assert cfg.target_states.target_endpoint is None


def test_model_copy_puts_a_flat_update_into_its_section():
    cfg = TrainConfig(eval_seed=0, lr=1e-4)
    copy = cfg.model_copy(update={"eval_seed": 3, "optimisation": {"lr": 2e-4}})
    assert copy.evaluation.eval_seed == 3 and copy.optimisation.lr == 2e-4
    assert cfg.evaluation.eval_seed == 0 and not hasattr(copy, "eval_seed")
