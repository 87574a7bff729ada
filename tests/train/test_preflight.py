"""`regen train` checks its config against the target's config.json before loading any weight, and the
documented `regen make-tiny-target` builds the target for CPU dry runs. Real CLI processes."""

from __future__ import annotations

import json
import os
import subprocess

import yaml

from tests.procs import regen_cmd


def test_train_refuses_a_config_the_target_cannot_take_before_loading_it(settings_env, tmp_path):
    env = {**os.environ, **settings_env}
    target = tmp_path / "tiny"
    made = subprocess.run(regen_cmd("make-tiny-target", str(target)), env=env, capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    config = json.loads((target / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # what vLLM's CPU build needs
    assert "tiny target in" in made.stdout

    for weights in target.glob("*.safetensors"):
        weights.unlink()  # had train loaded the weights, the error would be about these
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"aux_layer_ids": [1, 2, 9], "max_length": 4096}))  # draft_vocab_size 32000
    res = subprocess.run(regen_cmd("train", "--run", "any", "--target", str(target), "--out", str(tmp_path / "o"),
                                   "--config", str(cfg), "--device", "cpu"),
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 1
    err = res.stderr
    assert f"draft_vocab_size 32000 is larger than the target's vocabulary ({config['vocab_size']})" in err
    assert "aux_layer_ids" in err and "max_length 4096" in err
    assert "safetensors" not in err and "Traceback" not in err
