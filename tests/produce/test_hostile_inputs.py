"""Hostile mix files and rows, through `regen enqueue` as an operator runs it: a 200k-deep row and an
oversized row are quarantined with their reasons, a YAML alias bomb is refused at once, `hf:` options
outside the allow-list (trust_remote_code above all) are refused, a `.parquet` that is not Parquet is
one clear line. Nothing crashes the producer and nothing runs code."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from schemas.mix import MixError, load_mix
from tests.procs import regen_cmd


def _enqueue(mix: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(regen_cmd("enqueue", str(mix), "--json"), env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _mix(tmp_path: Path, source: dict, name: str = "hostile") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "target": {"model": "m"}, "sources": [source]}))
    return path


def test_deep_and_oversized_rows_are_quarantined_with_reasons(settings, settings_env, tmp_path):
    data = tmp_path / "rows.jsonl"
    deep = "[" * 200_000 + "]" * 200_000
    with data.open("w") as f:
        for i in range(5):
            f.write(json.dumps({"prompt": f"good question {i}"}) + "\n")
        f.write('{"prompt": "deep", "extra": ' + deep + "}\n")  # RecursionError in json.loads before
        f.write(json.dumps({"prompt": "nested", "extra": json.loads("[" * 100 + "]" * 100)}) + "\n")
        f.write(json.dumps({"prompt": "x" * (5 << 20)}) + "\n")  # over the 4 MiB default
        f.write(json.dumps({"prompt": "small but over the limit " * 100}) + "\n")
    mix = _mix(tmp_path, {"name": "rows", "path": str(data), "format": "prompt_response"})
    res = _enqueue(mix, settings_env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "RecursionError" not in res.stderr
    run_id = json.loads(res.stdout)["run_id"]
    quarantine = pq.read_table(Path(settings.data_root) / "runs" / run_id / "quarantine.parquet").to_pylist()
    reasons = {q["row_index"]: q["reason"] for q in quarantine}
    assert "max_nesting_depth" in reasons[5] and "max_nesting_depth" in reasons[6], reasons
    assert "too long" in reasons[7] and "max_row_bytes" in reasons[7], reasons
    assert 8 not in reasons and len(reasons) == 3  # the 2.5 KB row is under the default bound
    # the bound is a named field of the source
    mix2 = _mix(tmp_path, {"name": "rows", "path": str(data), "format": "prompt_response", "max_row_bytes": 1000},
                name="hostile-small")  # fmt: skip
    res = _enqueue(mix2, settings_env)
    run_id = json.loads(res.stdout)["run_id"]
    quarantine = pq.read_table(Path(settings.data_root) / "runs" / run_id / "quarantine.parquet").to_pylist()
    assert "max_row_bytes 1000" in {q["row_index"]: q["reason"] for q in quarantine}[8]


BOMB = """name: bomb
target: {model: m}
sources:
  - name: s
    format: messages
    hf:
      path: json
      a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
      b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
      c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
      d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
      e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
      f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
      g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
      h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
      i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_yaml_alias_bomb_is_refused_at_once(settings_env, tmp_path):
    mix = tmp_path / "bomb.yaml"
    mix.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(MixError, match=r"aliases \(\*a\) are not allowed"):
        load_mix(mix)
    assert time.monotonic() - t0 < 0.5
    t0 = time.monotonic()
    res = _enqueue(mix, settings_env)
    took = time.monotonic() - t0
    assert res.returncode != 0 and "line 9: YAML aliases" in res.stderr and "Traceback" not in res.stderr
    print(f"alias bomb refused by `regen enqueue` in {took:.2f}s (process start included)")


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ({"trust_remote_code": True}, "trust_remote_code is refused"),
        ({"cache_dir": "/tmp/x"}, "hf.cache_dir: unknown field"),
        ({"download_mode": "force_redownload"}, "hf.download_mode: unknown field"),
    ],
)
def test_hf_options_outside_the_allow_list_are_refused(tmp_path, option, expected):
    mix = _mix(
        tmp_path,
        {"name": "s", "format": "messages", "hf": {"path": "json", "data_files": "x.jsonl", **option}},
    )
    with pytest.raises(MixError, match=expected):
        load_mix(mix)


def test_datasets_floor_refuses_dataset_scripts(tmp_path):
    """The `datasets` this project requires has no dataset-script support: a folder holding a script
    is never executed, whatever the mix says."""
    import datasets
    from packaging.version import Version

    assert Version(datasets.__version__) >= Version("4.0")
    folder = tmp_path / "evil"
    folder.mkdir()
    marker = tmp_path / "PWNED"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\nimport datasets\n")
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do; the point is the marker
        datasets.load_dataset(str(folder), split="train")
    assert not marker.exists()


def test_a_parquet_name_that_is_not_parquet_is_one_clear_line(settings_env, tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"prompt": "I am JSON"}\n')
    res = _enqueue(
        _mix(tmp_path, {"name": "p", "path": str(fake), "format": "prompt_response"}), settings_env
    )
    assert res.returncode != 0
    assert "Traceback" not in res.stderr and "ArrowInvalid" not in res.stderr
    assert "not a Parquet file" in res.stderr and str(fake) in res.stderr


def _remote_code_folder(tmp_path: Path, marker: Path) -> Path:
    folder = tmp_path / "evil-tokenizer"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
        "tokenizer_class": "EvilTokenizer",
    }))  # fmt: skip
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\n"
        "from transformers import PreTrainedTokenizer\n\n\nclass EvilTokenizer(PreTrainedTokenizer):\n    pass\n"
    )
    return folder


def test_sim_runs_tokenizer_code_only_with_trust_remote_code(tmp_path):
    marker = tmp_path / "PWNED"
    folder = _remote_code_folder(tmp_path, marker)
    res = subprocess.run(regen_cmd("sim", "--port", "0", "--tokenizer", str(folder)), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0 and "--trust-remote-code" in res.stderr and "auto_map" in res.stderr, (
        res.stderr
    )
    assert "Traceback" not in res.stderr
    assert not marker.exists(), "the tokenizer folder's code ran without the flag"
    # the explicit opt-in does run it (the folder is then the operator's responsibility)
    res = subprocess.run(regen_cmd("sim", "--port", "0", "--tokenizer", str(folder), "--trust-remote-code"),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert marker.exists()


def test_client_side_tokenization_runs_off_the_event_loop(tmp_path):
    """api: generate renders and tokenizes a 2 MB prompt (about a second here) in a thread: the worker's
    event loop (other requests, the lease heartbeat) keeps turning meanwhile."""
    import asyncio

    from transformers import AutoTokenizer

    from regen_service.work.client.pool import EndpointPool
    from regen_service.work.regenerate import Regenerator
    from schemas.conversation import Conversation, Message, PromptRecord
    from tests.procs import sim_server
    from tests.work.test_client_faults import fast_config, make_mix
    from tests.work.test_client_units import DEMO_TOKENIZER

    tok = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    mix = make_mix(api="generate", tokenizer=str(DEMO_TOKENIZER))
    big = Message(role="user", content="word other thing " * 120_000)
    record = PromptRecord(prompt_id="big", source="s", row_index=0, conversation=Conversation(messages=[big]))

    async def main(url):
        async with EndpointPool(fast_config([url]), target_model=mix.target.model) as pool:
            gaps, stop = [], asyncio.Event()

            async def ticker():
                last = asyncio.get_running_loop().time()
                while not stop.is_set():
                    await asyncio.sleep(0.01)
                    now = asyncio.get_running_loop().time()
                    gaps.append(now - last)
                    last = now

            t = asyncio.create_task(ticker())
            t0 = time.monotonic()
            row = (await Regenerator(pool, mix, tok).regenerate(record)).to_record()
            took = time.monotonic() - t0
            stop.set()
            await t
            return row, took, max(gaps)

    with sim_server(
        "--decode-tok-s", "0", "--context-length", "1000", "--tokenizer", str(DEMO_TOKENIZER)
    ) as url:
        row, took, worst_gap = asyncio.run(main(url))
    assert row["error_class"] == "terminal_row" and "longer than the model's context" in row["error"]
    print(f"tokenizing took {took:.2f}s; the event loop's longest pause {worst_gap * 1000:.0f} ms")
    assert took > 0.3 and worst_gap < took / 3
