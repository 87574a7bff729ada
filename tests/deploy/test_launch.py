"""launch-sglang: the command it builds, the draft preflight, the EAGLE refusal, the spec numbers rule."""

from __future__ import annotations

import json
import shlex

import pytest
from click.testing import CliRunner

from regen_service.cli import main
from regen_service.deploy.launch import SpecParams
from tests.draft.test_export_validate import make_checkpoint, make_target


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(main, ["launch-sglang", *args], env=env, catch_exceptions=False)


@pytest.fixture
def target_and_draft(tmp_path):
    target = make_target(tmp_path / "target")
    make_checkpoint(tmp_path / "train")
    res = CliRunner().invoke(main, ["export", str(tmp_path / "train"), "--out", str(tmp_path / "draft")])
    assert res.exit_code == 0, res.output
    return target, tmp_path / "draft"


def test_plain_launch_command(tmp_path):
    target = make_target(tmp_path / "target")
    res = run("--target", str(target), "--tp", "4", "--port", "30001", "--print")
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.output)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == str(target)
    assert argv[argv.index("--tp") + 1] == "4" and argv[argv.index("--port") + 1] == "30001"
    for flag in ("--trust-remote-code", "--enable-metrics"):
        assert flag in argv
    assert argv[argv.index("--reasoning-parser") + 1] == "kimi_k2"
    assert argv[argv.index("--tool-call-parser") + 1] == "kimi_k2"
    assert "--speculative-algorithm" not in argv


def test_draft_launch_uses_eagle3_and_hides_the_key(target_and_draft):
    target, draft = target_and_draft
    res = run("--target", str(target), "--draft", str(draft), "--extra", "--mem-fraction-static 0.85", "--print",
              env={"REGEN_ENDPOINT_API_KEY": "sekrit-123"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "sekrit-123" not in res.output
    argv = shlex.split(res.output)
    assert argv[argv.index("--api-key") + 1] == "***"
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(draft)
    nums = [argv[argv.index(f) + 1] for f in ("--speculative-num-steps", "--speculative-eagle-topk",
                                              "--speculative-num-draft-tokens")]  # fmt: skip
    assert nums == ["3", "1", "4"]
    assert argv[-2:] == ["--mem-fraction-static", "0.85"]


def test_explicit_eagle_is_refused_with_the_reason(target_and_draft):
    target, draft = target_and_draft
    res = run("--target", str(target), "--draft", str(draft), "--speculative-algorithm", "EAGLE", "--print")
    assert res.exit_code != 0
    for needle in ("EAGLE3", "final hidden state", "fc", "1.00"):
        assert needle in res.output


def test_invalid_draft_stops_the_launch(target_and_draft):
    target, draft = target_and_draft
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 5, 30]
    (draft / "config.json").write_text(json.dumps(cfg))
    res = run("--target", str(target), "--draft", str(draft), "--print")
    assert res.exit_code != 0
    assert "[aux_range]" in res.output and "not launching" in res.output


def test_draft_needs_a_local_target_config(target_and_draft, tmp_path):
    _, draft = target_and_draft
    res = run("--target", "moonshotai/Kimi-K2.5", "--draft", str(draft), "--print")
    assert res.exit_code != 0 and "config.json" in res.output


def test_spec_numbers_validated_together(target_and_draft):
    target, draft = target_and_draft
    ok = run("--target", str(target), "--draft", str(draft), "--spec-steps", "5", "--print")
    assert ok.exit_code == 0 and "--speculative-num-draft-tokens 6" in ok.output
    bad = run(
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--spec-steps",
        "3",
        "--spec-draft-tokens",
        "8",
        "--print",
    )
    assert bad.exit_code != 0 and "num_steps + 1" in bad.output
    tree = run("--target", str(target), "--draft", str(draft), "--spec-steps", "2", "--spec-topk", "2",
               "--spec-draft-tokens", "7", "--print")  # fmt: skip
    assert tree.exit_code == 0, tree.output
    assert SpecParams(num_steps=5, eagle_topk=4, num_draft_tokens=8).num_draft_tokens == 8
    with pytest.raises(ValueError, match="exceeds"):
        SpecParams(num_steps=2, eagle_topk=2, num_draft_tokens=8)


def run_vllm(*args: str):
    return CliRunner().invoke(main, ["launch-vllm", *args], catch_exceptions=False)


def test_vllm_hidden_state_server_captures_aux_layers_and_the_last(tmp_path):
    target = make_target(tmp_path / "target")  # 12 layers
    res = run_vllm(
        "--target", str(target), "--hidden-states", str(tmp_path / "states"), "--tp", "8", "--print"
    )
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.output)
    assert argv[0] == "env" and argv[1].startswith("PYTHONPATH=")
    assert argv[argv.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9, 12]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "regen_service.train.vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "states").resolve())
    bad = run_vllm("--target", str(target), "--hidden-states", str(tmp_path / "s"), "--aux-layers", "2,2,1")
    assert bad.exit_code != 0 and "repeat a layer" in bad.output


def test_vllm_launch_refuses_a_draft_exported_for_sglang(target_and_draft):
    target, draft = target_and_draft  # exported with the default --engine sglang
    res = run_vllm("--target", str(target), "--draft", str(draft), "--print")
    assert res.exit_code == 1 and "[aux_engine]" in res.output and "--engine vllm" in res.output


def test_vllm_launch_refuses_a_target_the_gpus_cannot_hold(tmp_path):
    target = make_target(tmp_path / "target")
    with open(target / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(600 * 2**30)  # sparse: Kimi-K2.5's ~600 GiB of weights, no disk used
    res = run_vllm("--target", str(target), "--tp", "1", "--gpu-memory-gib", "141", "--print")
    assert res.exit_code != 0
    assert "600 GiB" in res.output and "--tp 6 or more" in res.output
    ok = run_vllm("--target", str(target), "--tp", "8", "--gpu-memory-gib", "141", "--print")
    assert ok.exit_code == 0, ok.output
