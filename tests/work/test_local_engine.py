"""The in-process engine behind the Regenerator: a prepared run answered by a tiny HF model (greedy) and by
replayed answers, written as the token-exact output shards the trainer reads."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from regen_service.bench.quality import mix_for
from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.state.storage import RunLayout, Storage
from regen_service.train.fixtures import make_tiny_target
from regen_service.work.local_engine import LocalEngine, hf_sampler, replay_sampler
from regen_service.work.local_run import regenerate_run
from schemas.rows import output_rows


def _run(tmp_path, tdir, name):
    (tmp_path / "p.jsonl").write_text(
        "".join(json.dumps({"prompt": f"question {i}", "response": f"answer {i}"}) + "\n" for i in range(5))
    )
    mix, text = mix_for(name, {"qa": tmp_path / "p.jsonl"}, tmp_path, {"temperature": 0.0, "max_new_tokens": 8},
                        2, str(tdir))  # fmt: skip
    storage = Storage(str(tmp_path / "data"))
    run_id = run_id_for(mix)
    prepare_run(mix, storage, run_id, text)
    return mix, storage, run_id


def test_regenerate_run_with_a_local_model(tmp_path):
    tdir = make_tiny_target(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(tdir)
    model = AutoModelForCausalLM.from_pretrained(tdir).eval()
    mix, storage, run_id = _run(tmp_path, tdir, "local-a")
    engine = LocalEngine(hf_sampler(model, tok, "cpu"), tok, batch_size=2)
    stats = regenerate_run(storage, run_id, mix, engine, tok)
    assert stats["rows"] == 5 and stats["errors"] == 0 and stats["shards"] == 3 and engine.batches == 3
    layout = RunLayout(storage, run_id)
    rows = [
        r
        for s in sorted(layout.output_shard_ids())
        for r in output_rows(storage.read_table(layout.output_shard(s)))
    ]
    for r in rows:
        out = r.turns[0].output_ids
        p = r.input_ids[: r.turns[0].prompt_len]
        assert r.run_id == run_id and r.input_ids == p + out and sum(r.loss_mask) == len(out)
        greedy = model.generate(
            torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )
        want = greedy[0, len(p) :].tolist()
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id) + 1]
        assert out == want


def test_replayed_answers_land_as_the_same_rows(tmp_path):
    tdir = make_tiny_target(tmp_path / "t")
    tok = AutoTokenizer.from_pretrained(tdir)
    mix, storage, run_id = _run(tmp_path, tdir, "local-b")
    from regen_service.work.chat_template import prompt_ids
    from schemas.prompt_rows import prompts_from_table

    layout = RunLayout(storage, run_id)
    answers = {}
    for sid in range(3):
        for rec in prompts_from_table(storage.read_table(layout.prompt_shard(sid))):
            ids = prompt_ids(tok, list(rec.conversation.messages[:-1]), None, thinking=False)
            answers[tuple(ids)] = tok(rec.conversation.messages[-1].content, add_special_tokens=False)[
                "input_ids"
            ]
    regenerate_run(storage, run_id, mix, LocalEngine(replay_sampler(answers), tok), tok)
    rows = [r for s in range(3) for r in output_rows(storage.read_table(layout.output_shard(s)))]
    assert sorted(tok.decode(r.turns[0].output_ids) for r in rows) == [f"answer {i}" for i in range(5)]
