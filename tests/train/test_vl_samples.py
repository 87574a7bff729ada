"""Samples whose context holds images, without an engine: the engine's expanded sequence mapped onto the
trainer's rendering, the images sent inline, the context kept through a checkpoint, and the HF backend's
refusal (the engine path is tests/e2e/test_train_images.py)."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from regen_service.errors import ConfigError
from regen_service.train.config import TrainConfig
from regen_service.train.data import Example
from regen_service.train.eval_set import EvalSet
from regen_service.train.target import VL_NEEDS_ENGINE, TargetBackend
from regen_service.train.vl_samples import VlContext, align, context_for, request_messages
from schemas.conversation import Message, with_image_parts
from schemas.media import ImageRef

PAD = 9
SHA = "ab" * 32


def test_align_widens_each_placeholder_to_the_engines_run_outside_the_loss():
    ids = [1, 2, PAD, 3, 4, 5]
    mask = [0, 0, 0, 0, 1, 1]
    engine = [1, 2, PAD, PAD, PAD, PAD, 3, 4, 5, 7]  # the engine's prompt may go on past a cut sample
    got_ids, got_mask = align(engine, ids, mask, PAD)
    assert got_ids == [1, 2, PAD, PAD, PAD, PAD, 3, 4, 5]  # the draft reads what the target saw
    assert got_mask == [0, 0, 0, 0, 0, 0, 0, 1, 1]


def test_two_images_next_to_each_other_keep_their_own_runs():
    # Kimi-K2.5 brackets each image (<|media_begin|>...<|media_end|>): runs never touch
    ids, mask = [1, PAD, 8, 1, PAD, 8, 4], [0, 0, 0, 0, 0, 0, 1]
    engine = [1, PAD, PAD, 8, 1, PAD, PAD, PAD, 8, 4]
    assert align(engine, ids, mask, PAD) == (engine, [0] * 9 + [1])


@pytest.mark.parametrize("engine", [[1, 3, PAD, PAD, 4], [1, 2, PAD]])
def test_a_sequence_the_engine_rendered_otherwise_is_refused(engine):
    with pytest.raises(ConfigError, match="differs from the trainer's rendering"):
        align(engine, [1, 2, PAD, 4], [0, 0, 0, 1], PAD)


def test_image_parts_are_placed_and_sent_inline(tmp_path):
    part = {"message_index": 0, "offset": 4, "sha256": SHA, "media_type": "image/png", "width": 2,
            "height": 2, "num_bytes": 3}  # fmt: skip
    msgs = with_image_parts(
        [Message(role="user", content="Look here"), Message(role="assistant", content="ok")], [part]
    )
    template = [m.to_dict("template") for m in msgs]
    assert template[0]["content"][1] == {"type": "image_url", "image_url": {"url": f"images/{SHA}.png"}}
    ctx = context_for(template, lambda name: f"/store/{name}", thinking=True)
    assert ctx.images == (f"/store/{SHA}.png",) and json.loads(ctx.template_kwargs) == {"thinking": True}
    sent = request_messages(ctx, lambda path: b"PNG" if path == f"/store/{SHA}.png" else b"")
    url = sent[0]["content"][1]["image_url"]["url"]
    assert url == "data:image/png;base64," + base64.b64encode(b"PNG").decode()
    assert json.loads(ctx.messages)[0]["content"][1]["image_url"]["url"] == f"images/{SHA}.png"  # unchanged
    assert context_for([{"role": "user", "content": "text only"}], str) is None


def test_a_held_out_sample_keeps_its_images_through_a_checkpoint():
    cfg = TrainConfig.load(None, eval_fraction=0.5)
    ev = EvalSet(cfg)
    ctx = VlContext(json.dumps([{"role": "user", "content": "x"}]), ("/store/a.png",), "{}")
    ex = Example(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), ctx)
    ev.add({"s": [ex, Example(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]))]}, {}, {"s": 2})
    back = EvalSet(cfg)
    back.load(ev.state(), "ckpt", had_ckpt=True)
    assert [s.vl for s in back.samples] == [ctx, None]


def test_the_hf_backend_refuses_samples_with_images_in_one_line():
    ex = Example(torch.tensor([1, 2]), torch.tensor([0, 1]), VlContext("[]", ("/a.png",)))
    with pytest.raises(ConfigError) as err:
        TargetBackend().example_states([ex])
    assert str(err.value) == VL_NEEDS_ENGINE and "--target-backend vllm" in VL_NEEDS_ENGINE
    assert "\n" not in VL_NEEDS_ENGINE


def test_the_kimi_k25_template_renders_a_row_with_images_for_training(tmp_path):
    # The Kimi fixture holds Kimi-K2.5's real template output (tests/test_kimi_fixture_k25.py): the
    # trainer's renderer puts one <|media_pad|> per image in the user turn, outside the loss, and the
    # engine's widening of each pad (one token per merged patch) keeps the answer's mask as it was.
    from regen_service.kimi_fixture import build_kimi_fixture
    from regen_service.remote_code import load_tokenizer
    from regen_service.train.data import ChatRenderer

    kimi = build_kimi_fixture(tmp_path / "Kimi-K2.5")
    tok = load_tokenizer(kimi, trust_remote_code=True, setting="test")
    pad = json.loads((kimi / "config.json").read_text())["media_placeholder_token_id"]
    assert pad == tok.convert_tokens_to_ids("<|media_pad|>")
    parts = [{"message_index": 0, "offset": o, "sha256": SHA, "media_type": "image/png", "width": 2,
              "height": 2, "num_bytes": 3} for o in (0, 5)]  # fmt: skip
    msgs = with_image_parts(
        [Message(role="user", content="Left right?"), Message(role="assistant", content="Both red.")], parts
    )
    template = [m.to_dict("template") for m in msgs]
    ex = ChatRenderer(tok).encode(template, None)
    ids, mask = ex.ids.tolist(), ex.mask.tolist()
    assert ids.count(pad) == 2 and all(m == 0 for i, m in zip(ids, mask, strict=True) if i == pad)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "</think>Both red.<|im_end|>"
    widened = [t for i in ids for t in ([pad] * 6 if i == pad else [i])]
    got_ids, got_mask = align(widened, ids, mask, pad)
    assert got_ids == widened and sum(got_mask) == sum(mask) and len(got_mask) == len(ids) + 10
    ctx = context_for(template, lambda name: f"runs/r/images/{name}")
    assert ctx.images == (f"runs/r/images/{SHA}.png",) * 2


def test_a_token_row_with_images_trains_from_its_messages():
    # api generate rows (SGLang /generate with image_data) carry ids with one placeholder per image; the
    # engine takes images only with messages, so such a row renders like a chat row and keeps its images
    from transformers import AutoTokenizer

    from regen_service.train.data import ChatRenderer, table_examples
    from regen_service.train.fixtures import DEMO_TOKENIZER
    from schemas.rows import OutputRow, output_table

    part = {"offset": 0, "sha256": SHA, "media_type": "image/png", "width": 2, "height": 2, "num_bytes": 3}
    user = Message(role="user", content="what").model_copy(update={"images": (ImageRef(**part),)})
    row = OutputRow(
        run_id="r", prompt_id="p", messages=(user, Message(role="assistant", content="a cat")),
        input_ids=[1, 2, 3], loss_mask=[0, 1, 1], api="generate",
    )  # fmt: skip
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(DEMO_TOKENIZER))
    exs, stats = table_examples(
        output_table([row]), lambda: renderer, 512, "conversation", lambda n: f"/i/{n}"
    )
    (ex,) = exs
    assert stats["template_rows"] == 1 and stats["token_rows"] == 0 and stats["image_rows"] == 1
    assert ex.vl is not None and ex.vl.images == (f"/i/{SHA}.png",) and ex.ids.tolist() != [1, 2, 3]
