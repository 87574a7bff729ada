"""Drafter building blocks on the CPU: vocabulary rule, SGLang key names, TTT/decoding agreement,
assistant-only loss masks from the chat template, checkpoint files, the strict config."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch

from regen_service.draft.checkpoint import REQUIRED_KEYS, latest_path, load_latest, save_checkpoint
from regen_service.draft.config import DraftConfig
from regen_service.errors import ConfigError
from regen_service.train import data as D
from regen_service.train.config import TrainConfig
from regen_service.train.fixtures import DEMO_TOKENIZER, output_table
from regen_service.train.model import Eagle3Draft
from regen_service.train.ttt import ttt_loss
from regen_service.train.vocab import build_vocab
from schemas.conversation import Message, ToolCall
from schemas.rows import OutputRow
from tests.train.test_mla import YARN, mla_config

SGLANG_KEYS = {
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=50, draft_vocab_size=12,
        target_hidden_size=32,
    )  # fmt: skip
    return DraftConfig(**{**base, **kw})


def test_vocab_rule_top_counts_sorted_offsets_and_padding():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[7, 3, 15]] = torch.tensor([5, 9, 5])
    d2t, t2d = build_vocab(counts, 5)
    used = d2t + torch.arange(5)
    # the 3 seen ids, then the lowest unseen ids (0, 1) as padding; sorted ascending
    assert used.tolist() == [0, 1, 3, 7, 15]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.sum() == 5 and t2d[used].all()
    d2t, _ = build_vocab(counts, 2)  # ties broken by the lower id: 3 (9), then 7 before 15
    assert (d2t + torch.arange(2)).tolist() == [3, 7]
    with pytest.raises(ConfigError):
        build_vocab(counts, 21)


def test_draft_state_dict_has_exactly_sglang_names():
    draft = Eagle3Draft(tiny_config())
    sd = draft.draft_state_dict()
    assert set(sd) == SGLANG_KEYS
    assert "embed_tokens.weight" in draft.state_dict()
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # 2H in
    assert sd["fc.weight"].shape == (32, 96)  # 3H -> H
    assert not draft.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_ttt_steps_match_chain_decoding(arch):
    """Step i at position t in training sees exactly what decoding sees i tokens after the prefix [0..t]
    (the MLA draft with YaRN past its original context)."""
    torch.manual_seed(0)
    c = tiny_config() if arch == "llama" else mla_config(YARN)
    draft = Eagle3Draft(c).eval()
    d2t, t2d = build_vocab(torch.arange(50), 12)
    draft.set_vocab(d2t, t2d)
    t_len, steps = 10, 3
    aux, ids = torch.randn(1, t_len, 96), torch.randint(0, 50, (1, t_len))
    with torch.no_grad():
        hidden, cache, train_logits = draft.fc(aux), [], []
        pos = torch.arange(t_len)[None]
        for i in range(steps):
            shifted = torch.cat([ids[:, 1 + i :], ids.new_zeros(1, 1 + i)], 1)
            hidden, logits = draft.step(shifted, hidden, pos + i, cache)
            train_logits.append(logits)
        t = 4  # decode from the prefix ids[0..t], feeding the real next tokens
        hidden, cache = draft.fc(aux[:, : t + 1]), []
        step_ids, p = ids[:, 1 : t + 2], torch.arange(t + 1)[None]
        for i in range(steps):
            hidden, logits = draft.step(step_ids, hidden, p, cache)
            assert torch.allclose(logits[0, -1], train_logits[i][0, t], atol=1e-5), f"step {i}"
            hidden, step_ids, p = hidden[:, -1:], ids[:, t + 2 + i : t + 3 + i], torch.tensor([[t + 1 + i]])
            cache = [cache[0], *[(k[:, :, -1:], v[:, :, -1:]) for k, v in cache[1:]]]
        loss, metrics = ttt_loss(draft, aux, ids, ids, torch.ones_like(ids), ttt_length=steps)
    assert torch.isfinite(loss) and set(metrics) >= {"loss_0", "acc_2"}


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    return D.ChatRenderer(AutoTokenizer.from_pretrained(DEMO_TOKENIZER))


def test_chat_template_mask_covers_assistant_turns_with_thinking_and_tools(renderer):
    tc = (ToolCall(id="c1", name="lookup", arguments='{"q": 1}'),)
    msgs = (
        Message(role="system", content="be brief"),
        Message(role="user", content="first question"),
        Message(role="assistant", content="old answer", reasoning_content="old thoughts"),
        Message(role="user", content="second question"),
        Message(role="assistant", content="calling", reasoning_content="new thoughts", tool_calls=tc),
        Message(role="tool", content="result 42", tool_call_id="c1"),
        Message(role="assistant", content="final answer", reasoning_content="more thoughts"),
    )
    ex = renderer.encode(
        D.template_messages(OutputRow(messages=msgs)), [{"type": "function", "function": {"name": "lookup"}}]
    )
    tok = renderer.tok
    masked = tok.decode([i for i, m in zip(ex.ids.tolist(), ex.mask.tolist(), strict=True) if m])
    assert "final answer" in masked and "more thoughts" in masked and "new thoughts" in masked
    assert '{"q": 1}' in masked and "functions.lookup" in masked and masked.count("<|im_end|>") == 3
    assert "old thoughts" not in masked  # the template drops history thinking: so does the mask
    for text in ("first question", "second question", "result 42", "be brief", "user"):
        assert text not in masked


def test_table_examples_skip_errors_use_token_ids_and_truncate(renderer):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"input_ids": list(range(10, 30)), "loss_mask": [0] * 5 + [1] * 15, "api": "generate"},
        {"messages": [{"role": "user", "content": "x"}], "error": "context length exceeded"},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]},  # nothing to learn
    ]
    table = output_table(rows)
    assert isinstance(table, pa.Table)
    examples, stats = D.table_examples(table, lambda: renderer, max_length=12)
    assert stats == {
        "rows": 4,
        "errors": 1,
        "token_rows": 2,
        "template_rows": 1,
        "no_loss": 1,
        "generation_samples": 0,
        "image_rows": 0,
    }
    assert examples[1].ids.tolist() == list(range(10, 22)) and examples[1].mask.sum() == 7
    batch = D.collate(examples)
    assert batch["input_ids"].shape[0] == 2 and batch["attention_mask"][1].sum() == 12


def test_rank_batches_keep_ranks_in_lockstep():
    exs = [D.Example(torch.tensor([i, i]), torch.tensor([1, 1])) for i in range(7)]
    got = [D.rank_batches(exs, 2, r, 3) for r in range(3)]
    assert [len(b) for b, _ in got] == [2, 1, 1] and {n for _, n in got} == {2}
    seen = sorted(int(e.ids[0]) for b, _ in got for chunk in b for e in chunk)
    assert seen == list(range(7))


def test_checkpoint_atomic_layout(tmp_path):
    state = {k: None for k in REQUIRED_KEYS} | {"step": 5, "consumed_shards": [["r", 0]]}
    save_checkpoint(tmp_path, state, keep=2)
    for step in (6, 7):
        save_checkpoint(tmp_path, state | {"step": step}, keep=2)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000007"
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000006",
        "step-00000007",
    ]
    assert latest_path(tmp_path).parent.name == "step-00000007" and load_latest(tmp_path)["step"] == 7
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, {"step": 1})


def test_train_config_is_strict(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps({"ttt_length": 3, "draft_vocab_size": 100}))
    cfg = TrainConfig.load(path)
    assert cfg.optimisation.ttt_length == 3 and cfg.optimisation.lr == 1e-4
    path.write_text("ttt_lenght: 3\n")
    with pytest.raises(ConfigError, match="ttt_lenght"):
        TrainConfig.load(path)
