"""Hostile inputs to the trainer's files, round two (issue 18, items 7, 8 and 9): each probe planted as
the issue found it, each answered with one line that names the file and the fix, a non-zero exit and no
traceback, through the real `regen` command in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from regen_service.draft.checkpoint import UnsafeCheckpointError, latest_path
from regen_service.errors import ConfigError
from regen_service.train import data as D
from regen_service.train.config import TrainConfig
from regen_service.train.fixtures import DEMO_TOKENIZER
from schemas.yamlfile import YamlRefused, load_yaml
from tests.draft.test_convert import make_speculators_draft
from tests.draft.test_export_validate import cli, exported, make_checkpoint, make_target  # noqa: F401 (fixture)
from tests.procs import regen_cmd

BOMB = """\
lr: &a [1,1,1,1,1,1,1,1,1]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def regen(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        regen_cmd(*args), capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode != 0, res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    for n in needles:
        assert n in res.stderr + res.stdout, (n, res.stderr[-2000:], res.stdout[-2000:])


# item 7: one YAML loader without aliases


def test_train_yaml_alias_bomb_is_refused_within_a_second(settings_env, tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        TrainConfig.load(cfg)
    assert time.monotonic() - t0 < 1.0
    msg = str(err.value)
    assert (
        "\n" not in msg
        and str(cfg) in msg
        and "line 2: YAML aliases (*a) are not allowed in train.yaml" in msg
    )
    res = regen("train", "--run", "r-1", "--target", str(tmp_path), "--out", str(tmp_path / "o"),
                "--config", str(cfg), env=settings_env)  # fmt: skip
    one_line_error(res, "YAML aliases (*a) are not allowed in train.yaml")
    assert len(res.stderr.strip().splitlines()) == 1


def test_deep_yaml_is_refused_before_recursion(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("lr: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        TrainConfig.load(cfg)
    with pytest.raises(YamlRefused, match="aliases"):
        load_yaml("a: &x 1\nb: *x\n", what="a mix file")


def test_no_module_reads_yaml_another_way():
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("regen_service", "schemas", "workers", "scripts"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "yamlfile.py":  # the one loader
                continue
            text = path.read_text(encoding="utf-8")
            if any(s in text for s in ("yaml.safe_load", "yaml.load(", "yaml.full_load", "yaml.unsafe_load")):
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


# item 8: validate-draft, convert-draft, export


def _header(payload: bytes) -> bytes:
    return struct.pack("<Q", len(payload)) + payload


PLANTED = {
    # name: (file, bytes, what the error must say)
    "header_not_json": ("model.safetensors", _header(b"not json!!"), "its header is not JSON"),
    "short_file": ("model.safetensors", b"abc", "shorter than 8 bytes"),
    "header_a_list": ("model.safetensors", _header(b"[1, 2]"), "its header is a list"),
    "header_deep": ("model.safetensors", _header(b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "entry_no_shape": (
        "model.safetensors",
        _header(b'{"fc.weight": {"dtype": "F32"}}'),
        "lacks dtype, shape",
    ),
    "config_deep": ("config.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "config_deep_object": ("config.json", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    "config_a_list": ("config.json", b"[1]", "not an object of fields"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_validate_draft_on_a_planted_file_says_which_and_why(case, exported, tmp_path):  # noqa: F811 (the imported fixture)
    draft, target = exported
    name, payload, expect = PLANTED[case]
    (draft / name).write_bytes(payload)
    res = regen("validate-draft", str(draft), "--target-config", str(target))
    one_line_error(res, expect, name, "fix: re-export the draft")
    assert res.returncode == 1


def test_a_deep_target_config_is_one_line(exported, tmp_path):  # noqa: F811 (the imported fixture)
    draft, _ = exported
    deep = tmp_path / "deep-target"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(regen("validate-draft", str(draft), "--target-config", str(deep)), "nested too deeply")


def test_convert_draft_with_bad_safetensors_is_one_line(tmp_path):
    src = make_speculators_draft(tmp_path / "spec")
    (src / "model.safetensors").write_bytes(_header(b"not json!!"))
    res = regen("convert-draft", str(src), "--out", str(tmp_path / "out"))
    one_line_error(res, "model.safetensors: not a readable safetensors file", "copy it again")
    assert not (tmp_path / "out").exists()


def test_export_against_a_one_layer_target_is_one_line(tmp_path):
    make_checkpoint(tmp_path / "train")
    t1 = tmp_path / "t1"
    t1.mkdir()
    (t1 / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 500})
    )
    res = regen("export", str(tmp_path / "train"), "--out", str(tmp_path / "out"), "--target-config", str(t1))
    one_line_error(res, "num_hidden_layers is 1", "at least 4 layers")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_checkpoints_latest_naming_a_path_outside_is_refused(how, tmp_path):
    make_checkpoint(tmp_path / "train")
    elsewhere = tmp_path / "elsewhere" / "step-00000999"
    elsewhere.mkdir(parents=True)
    shutil.copy(tmp_path / "train/checkpoints/step-00000123/state.pt", elsewhere / "state.pt")
    ckpts = tmp_path / "train" / "checkpoints"
    if how == "symlink":
        (ckpts / "step-00000999").symlink_to(elsewhere)
        name = "step-00000999"
    else:
        name = "../../elsewhere/step-00000999" if how == "dotdot" else str(elsewhere)
    (ckpts / "latest").write_text(name + "\n")
    res = regen("export", str(tmp_path / "train"), "--out", str(tmp_path / "out"))
    one_line_error(res, "checkpoints/latest names", "not a step-NNNNNNNN directory inside", "refused")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsafeCheckpointError):  # the resuming trainer reads `latest` the same way
        latest_path(tmp_path / "train")


# item 9: the fix the vLLM aux-engine message prints


def test_validate_for_vllm_prints_a_runnable_export_command(exported):  # noqa: F811 (the imported fixture)
    draft, target = exported
    res = regen("validate-draft", str(draft), "--target-config", str(target), "--engine", "vllm")
    assert res.returncode == 1 and "[aux_engine]" in res.stdout
    assert "regen export CKPT --out DIR --engine vllm" in res.stdout and "fmt." not in res.stdout


# item 8: rows cut to max_length before they are built


def test_a_30m_token_row_is_cut_before_it_becomes_python_lists():
    n = 30_000_000
    offsets = pa.array([0, n], pa.int32())
    table = pa.table({
        "input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.arange(n, dtype=np.int32) % 1000)),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(np.ones(n, dtype=np.int32))),
        "error": pa.array([None], pa.string()),
    })  # fmt: skip
    tracemalloc.start()
    try:
        examples, stats = D.table_examples(table, lambda: None, max_length=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats["token_rows"] == 1 and [e.ids.numel() for e in examples] == [4096]
    assert examples[0].ids[:5].tolist() == [0, 1, 2, 3, 4]
    print(f"30M-token row: Python peak {peak / 1e6:.1f} MB (1228 MB before the cut moved into Arrow)")
    assert peak < 50e6


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    return D.ChatRenderer(AutoTokenizer.from_pretrained(DEMO_TOKENIZER))


def test_a_long_rendered_row_gives_the_same_first_tokens_from_a_prefix(renderer):
    words = " ".join(f"w{i % 97}x" for i in range(20_000))
    msgs = [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": words}]
    whole = renderer.encode(msgs, None)
    cut = renderer.encode(msgs, None, max_length=256)
    assert cut.ids.tolist() == whole.ids[:256].tolist() and cut.mask.tolist() == whole.mask[:256].tolist()
    huge = [msgs[0], {"role": "assistant", "content": words * 50}]  # ~5M characters
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        ex = renderer.encode(huge, None, max_length=256)
        took = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ex.ids.tolist() == whole.ids[:256].tolist()
    print(f"5M-character answer cut to 256 tokens: {took:.2f}s, Python peak {peak / 1e6:.1f} MB")
    assert peak < 200e6
