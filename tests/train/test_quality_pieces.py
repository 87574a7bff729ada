"""The quality benchmark's library pieces on the CPU: prompt/answer cutting, the small target's refusals,
the fixed-step trainer and batched speculative decoding checked against plain greedy decoding and
accept.py's one-prompt-at-a-time decoder."""

from __future__ import annotations

import pytest
import torch

from regen_service.errors import ConfigError
from regen_service.train import code_prompts as CP
from regen_service.train import offline, specdecode
from regen_service.train.accept import accept_length
from regen_service.train.config import TrainConfig
from regen_service.train.data import Example
from regen_service.train.dist import DistContext
from regen_service.train.fixtures import greedy_rows, make_tiny_target, random_prompts
from regen_service.train.small_target import TargetRecipe, build_target
from regen_service.train.target import HFTarget

SRC = '''"""A module that adds numbers and keeps a running total for the caller."""
import math


def add(a, b):
    """Return the sum of a and b."""
    total = a + b
    return total


class Acc:
    """An accumulator of values."""

    def __init__(self):
        self.v = 0
'''


def test_file_pairs_cut_each_source():
    pairs = list(CP.file_pairs(SRC))
    by = {p["source"]: p for p in pairs}
    assert set(by) == {"module_start", "fn_body", "class_start"}
    assert by["fn_body"]["prompt"].endswith('"""Return the sum of a and b."""')
    assert by["fn_body"]["response"] == "    total = a + b\n    return total"
    assert by["module_start"]["response"].startswith("import math")
    assert "def __init__" in by["class_start"]["response"]
    assert list(CP.file_pairs("def broken(:\n")) == []


def test_small_target_refuses_a_tiny_corpus(tmp_path):
    for pkg in ("alpha", "held"):
        (tmp_path / "root" / pkg).mkdir(parents=True)
        (tmp_path / "root" / pkg / "m.py").write_text(SRC * 3)
    r = TargetRecipe(vocab_size=300, hidden=32, layers=4, heads=2, kv_heads=1, intermediate=64, seq_len=32, batch=4,
                     steps=1000, tokenizer_sample_bytes=10_000)  # fmt: skip
    with pytest.raises(ConfigError, match="corpus too small"):
        build_target([tmp_path / "root"], {"held"}, tmp_path / "out", r, device="cpu")
    with pytest.raises(ConfigError, match="held-out packages"):
        build_target([tmp_path / "root"], {"missing"}, tmp_path / "out", r, device="cpu")


@pytest.mark.slow  # trains a tiny draft for a few seconds, then decodes
def test_batched_spec_decoding_matches_greedy_and_accept_py(tmp_path):
    torch.manual_seed(0)
    tdir = make_tiny_target(tmp_path / "t", embed_scale=10.0, logit_scale=30.0)
    rows = greedy_rows(tdir, "r", 48, new_tokens=32, seed=1)
    exs = [Example(torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"])) for r in rows]
    target = HFTarget(str(tdir))
    cfg = TrainConfig(draft_vocab_size=512, max_length=128, batch_size=12, lr=2e-3, ttt_length=4, warmup_ratio=0.05,
                      report_to=["none"], attention="eager")  # fmt: skip
    vocab = offline.vocab_for(exs, target.vocab_size, cfg.model.draft_vocab_size)[:2]
    tr, summary = offline.train_draft(target, exs, vocab, cfg, 24, DistContext())
    assert summary["steps"] == 24 and summary["epochs"] == 6.0
    draft = tr.draft.eval()
    from transformers import AutoTokenizer

    prompts = random_prompts(AutoTokenizer.from_pretrained(tdir), 5, 12, seed=999)
    prompts[1] = prompts[1][:-3]  # rows of different lengths in one batch
    out = specdecode.accept_lengths(target, draft, prompts, ["a", "b", "a", "b", "a"], k=3, max_new_tokens=20,
                                    batch_size=4)  # fmt: skip
    greedy = target.model.generate(torch.tensor([prompts[0]]), max_new_tokens=20, do_sample=False,
                                   pad_token_id=0)[0, len(prompts[0]):].tolist()  # fmt: skip
    assert out["generated"][0] == greedy  # speculative decoding never changes the greedy text
    steps = sum(accept_length(target, draft, [p], k=3, max_new_tokens=20)["verify_steps"] for p in prompts)
    assert out["verify_steps"] == steps and out["tokens"] == 5 * 20
    assert out["accept_length"] > 1.2 and set(out["sources"]) == {"a", "b"}
    # the evaluator's decoding walk on the greedy text is the real figure; its all-position mean is not
    from regen_service.train.eval_set import EvalSample
    from regen_service.train.evaluate import evaluate

    samples = [EvalSample(torch.tensor(p + g), torch.tensor([0] * len(p) + [1] * len(g)), "a")
               for p, g in zip(prompts, out["generated"], strict=True)]  # fmt: skip
    sim = evaluate(draft, target, samples, cfg.model_copy(update={"batch_size": 1}), DistContext())
    assert abs(sim["accept_length_walk"]["3"] - out["accept_length"]) < 1e-6
