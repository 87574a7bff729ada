"""Length buckets and compile bookkeeping (issue 21), on the CPU.

The bucket rule's bounds and shape counts; a batch padded further gives the same loss and gradients
(fp32, eager attention); the target backends never compute a pad position and give it zeros; the
held-out evaluation does not move with padding; the compiled norm keeps one rank (a handful of dynamo
entries, not the recompile limit), and the MLA draft's norms compile once per width across lengths;
dynamo's counters read back; the draft built on its device keeps the CPU's weights of before.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from regen_service.bench import train_step
from regen_service.train import data as D
from regen_service.train import layers
from regen_service.train.config import TrainConfig
from regen_service.train.dist import DistContext, init_distributed
from regen_service.train.engine_target import VllmTarget
from regen_service.train.eval_set import EvalSample
from regen_service.train.evaluate import evaluate
from regen_service.train.fixtures import make_tiny_target
from regen_service.train.lengths import CompileCounts, bucket_length, bucket_lengths, bucketer, compile_counts
from regen_service.train.model import Eagle3Draft
from regen_service.train.target import HFTarget
from regen_service.train.trainer import DraftTrainer
from regen_service.train.ttt import ttt_loss
from tests.train.test_mla import mla_config
from tests.train.test_units import tiny_config


def test_bucket_rule_bounds_padding_and_counts_its_shapes():
    for t in range(1, 40000):
        assert bucket_length(t, "off") == t
        b, g = bucket_length(t, "block"), bucket_length(t, "geometric")
        assert b % 128 == 0 and t <= b < t + 128
        assert g % 128 == 0 and g >= t
        if t < 1024:
            assert g == b  # blocks up to 1024
        if t >= 512:
            assert g - t < 0.25 * t  # four buckets per octave: padding under a quarter
    # a bounded number of shapes: what a run of 128..32K (16K) tokens can meet
    assert len({bucket_length(t, "geometric") for t in range(128, 32769)}) == 28
    assert len({bucket_length(t, "geometric") for t in range(128, 16385)}) == 24
    assert bucket_lengths(128, 16384, "geometric") == sorted(
        {bucket_length(t, "geometric") for t in range(128, 16385)}
    )
    assert bucket_lengths(1000, 5000, "geometric") == [
        1024,
        1280,
        1536,
        1792,
        2048,
        2560,
        3072,
        3584,
        4096,
        5120,
    ]
    # never past max_length (the cap), never below the length
    assert (
        bucket_length(4900, "geometric", cap=5000) == 5000
        and bucket_length(4000, "geometric", cap=5000) == 4096
    )
    assert bucket_length(300, "block", cap=200) == 300
    assert (
        bucketer("off") is None
        and bucketer("geometric", 300)(200) == 256
        and bucketer("block", 300)(290) == 300
    )
    with pytest.raises(ValueError, match="allowed off, block, geometric"):
        bucketer("pow2")
    with pytest.raises(ValueError):
        bucket_length(0, "block")
    assert TrainConfig().data.length_bucket == "geometric"


def _batch_states(exs, pad_to, hidden, n_draft, seed=0):
    """The batch padded to pad_to and target states made for its real positions (zeros at pads, as the
    backends give them): aux, target argmax, draft-vocab logits."""
    g = torch.Generator().manual_seed(seed)
    t0 = max(e.ids.numel() for e in exs)
    aux = torch.zeros(len(exs), t0, 3 * hidden)
    tgt = torch.zeros(len(exs), t0, dtype=torch.int64)
    dl = torch.zeros(len(exs), t0, n_draft)
    for i, e in enumerate(exs):
        n = e.ids.numel()
        aux[i, :n] = torch.randn(n, 3 * hidden, generator=g)
        tgt[i, :n] = torch.randint(0, n_draft + 5, (n,), generator=g)  # some outside the draft vocabulary
        dl[i, :n] = torch.randn(n, n_draft, generator=g) * 3
    batch = D.collate(exs, pad_to=pad_to)
    t = batch["input_ids"].shape[1]
    return batch, D.pad_time(aux, t), D.pad_time(tgt, t), D.pad_time(dl, t)


@pytest.mark.parametrize("soft", [True, False])
def test_padding_further_leaves_loss_and_gradients_unchanged(soft):
    torch.manual_seed(0)
    c = tiny_config()
    draft = Eagle3Draft(c)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[: c.draft_vocab_size] = True
    draft.set_vocab(torch.zeros(c.draft_vocab_size, dtype=torch.int64), t2d)
    g = torch.Generator().manual_seed(1)
    exs = []
    for n in (61, 23, 40):
        mask = (torch.rand(n, generator=g) > 0.3).long()
        exs.append(D.Example(torch.randint(0, c.vocab_size, (n,), generator=g), mask))
    runs = []
    for pad_to in (61, 61 + 37):
        batch, aux, tgt, dl = _batch_states(exs, pad_to, c.target_hidden_size, c.draft_vocab_size)
        assert batch["input_ids"].shape == (3, pad_to)
        assert int(batch["loss_mask"][:, 61:].sum()) == 0 and int(batch["attention_mask"][:, 61:].sum()) == 0
        probs = torch.softmax(dl, -1) if soft else None  # the trainer's target_probs (uniform at pads)
        draft.zero_grad(set_to_none=True)
        loss, metrics = ttt_loss(draft, aux, batch["input_ids"], tgt, batch["loss_mask"], 4, 0.8, probs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
        runs.append((loss.detach(), grads, {k: v.clone() for k, v in metrics.items()}))
    (l0, g0, m0), (l1, g1, m1) = runs
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-6), (float(l0), float(l1))
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-5, atol=1e-6), name
    assert all(torch.equal(m0[f"tokens_{i}"], m1[f"tokens_{i}"]) for i in range(4))  # pads never counted


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    torch.manual_seed(0)
    return HFTarget(str(make_tiny_target(tmp_path_factory.mktemp("target") / "t", logit_scale=30.0)))


def test_hf_target_never_runs_on_pads_and_gives_them_zeros(hf_target):
    g = torch.Generator().manual_seed(2)
    exs = [
        D.Example(torch.randint(5, 500, (n,), generator=g), torch.ones(n, dtype=torch.int64)) for n in (37, 9)
    ]
    seen = []
    states = hf_target.states

    def spy(ids, attn=None, draft_ids=None):
        seen.append(tuple(ids.shape))
        return states(ids, attn, draft_ids)

    hf_target.states = spy
    try:
        draft_ids = torch.arange(40)
        plain = hf_target.example_states(exs, draft_ids)
        padded = hf_target.example_states(exs, draft_ids, bucketer("geometric", 512))
    finally:
        del hf_target.states
    assert seen == [(2, 37), (2, 37)]  # the target saw the unpadded batch both times
    (b0, *s0), (b1, *s1) = plain, padded
    assert b1["input_ids"].shape == (2, 128) and int(b1["loss_mask"][:, 37:].sum()) == 0
    for key in b0:
        assert torch.equal(b1[key][:, :37], b0[key])
    for x0, x1 in zip(s0, s1, strict=True):
        assert x1.shape[1] == 128 and torch.equal(x1[:, :37], x0) and not x1[:, 37:].any()


def test_vllm_target_pads_after_the_engine_answered():
    h = 8
    vt = object.__new__(VllmTarget)  # no engine: each sample's states come from the stub below
    vt.hidden_size, vt.device, vt._eps = h, torch.device("cpu"), 1e-6
    vt._norm_w, vt._lm_head = torch.ones(h), torch.randn(30, h)
    vt._pool = ThreadPoolExecutor(2)
    g = torch.Generator().manual_seed(3)
    vt._example = lambda ex: (
        ex.ids.tolist(),
        ex.mask.tolist(),
        torch.randn(ex.ids.numel(), 4, h, generator=g),
    )
    exs = [D.Example(torch.arange(n), torch.ones(n, dtype=torch.int64)) for n in (150, 70)]
    batch, aux, pred, dl = vt.example_states(exs, torch.arange(12), bucketer("geometric", 8192))
    vt._pool.shutdown()
    assert batch["input_ids"].shape == (2, 256) and aux.shape[:2] == pred.shape == dl.shape[:2] == (2, 256)
    assert not aux[0, 150:].any() and not aux[1, 70:].any() and aux[0, :150].abs().sum() > 0
    assert int(batch["loss_mask"][0, 150:].sum()) == 0 and int(batch["attention_mask"][1, 70:].sum()) == 0


def test_evaluation_does_not_move_with_padding(hf_target):
    torch.manual_seed(0)
    cfg = TrainConfig(draft_vocab_size=64, ttt_length=3, batch_size=2, attention="eager", report_to=["none"])
    from regen_service.train.trainer import draft_config_for

    draft = Eagle3Draft(draft_config_for(hf_target.text_config, cfg.model))
    draft.embed_tokens.weight.data.copy_(hf_target.embed_weight)
    t2d = torch.zeros(hf_target.vocab_size, dtype=torch.bool)
    t2d[:64] = True
    draft.set_vocab(torch.zeros(64, dtype=torch.int64), t2d)
    g = torch.Generator().manual_seed(4)
    samples = []
    for i, n in enumerate((30, 57, 12, 44, 90)):
        mask = torch.zeros(n, dtype=torch.int64)
        mask[n // 3 :] = 1
        samples.append(EvalSample(torch.randint(0, 64, (n,), generator=g), mask, "ab"[i % 2]))
    off = evaluate(draft, hf_target, samples, cfg.model_copy(update={"length_bucket": "off"}), DistContext())
    geo = evaluate(draft, hf_target, samples, cfg, DistContext())
    assert off["positions"] == geo["positions"] and off["samples"] == geo["samples"] == 5
    assert off["acc"] == geo["acc"] and off["accept_length"] == geo["accept_length"]
    assert off["accept_length_walk"] == geo["accept_length_walk"]
    assert off["loss"] == pytest.approx(geo["loss"], abs=1e-4)
    assert off["target_entropy"] == pytest.approx(geo["target_entropy"], abs=1e-4)


def test_compiled_norm_keeps_one_rank_and_the_counters_see_it(monkeypatch):
    torch._dynamo.reset()  # a clean cache for _rms_norm's code object
    compiled = torch.compile(layers._rms_norm, backend="eager", dynamic=None)
    monkeypatch.setattr(layers, "fused_on", lambda x, fn: compiled if fn is layers._rms_norm else fn)
    norm = layers.RMSNorm(16, 1e-6)
    before = compile_counts()
    for t in (40, 57, 23, 130, 88, 301):
        emb = torch.randn(1, t, 16)  # a TTT step's embedding (no grad) and hidden (grad)
        hid = torch.randn(1, t, 16, requires_grad=True)
        for x in (emb, hid, torch.stack([hid, hid, hid])):  # ... and the loss's stacked steps
            out = norm(x)
            assert out.shape == x.shape and torch.allclose(out, layers._rms_norm(x, norm.weight, 1e-6))
        with torch.no_grad():  # eval heads: [N, H] rows, and a chain step's [B, 1, H]
            norm(torch.randn(t // 3, 16))
            norm(torch.randn(2, 1, 16))
    got = compile_counts().since(before)
    # before the reshape: one entry per rank and grad mode, 7 of the limit's 8 within a few steps
    assert 1 <= got.graphs <= 4, got
    assert got.frames == got.graphs and got.seconds > 0
    assert CompileCounts(5, 5, 2.0).since(CompileCounts(2, 2, 0.5)) == CompileCounts(3, 3, 1.5)
    assert CompileCounts(1, 1, 0.12345).as_dict() == {"graphs": 1, "frames": 1, "seconds": 0.123}


def test_the_mla_draft_compiles_each_norm_once_across_lengths(monkeypatch):
    """Its q_a and kv_a norms read the latent projections (c_kv a column slice of kv_a's output); as
    tracked views they reached dynamo with guards on their base's length and compiled again per length,
    which with grad modes and the fit check's lengths passed the recompile limit at Kimi shapes."""
    torch._dynamo.reset()
    compiled = torch.compile(layers._rms_norm, backend="aot_eager", dynamic=None)  # autograd as on CUDA
    monkeypatch.setattr(layers, "fused_on", lambda x, fn: compiled if fn is layers._rms_norm else fn)
    c = mla_config(max_position_embeddings=512)
    tr = train_step.make_trainer(c, 3, init_distributed("cpu"), attention="eager")
    before = compile_counts()
    for t in (40, 57, 23, 130, 88, 301):
        train_step.draft_step(tr, c, 1, t, True, True)()
    # one entry per width (hidden 32, q_lora 24, kv_lora 16); tracked views made it 5 here
    assert compile_counts().since(before).graphs == 3


def test_the_draft_built_on_its_device_keeps_the_cpu_weights_and_logs_real_tokens():
    c = tiny_config()
    cfg = TrainConfig(seed=7, report_to=["none"], attention="eager")
    torch.manual_seed(7)
    before = Eagle3Draft(c)  # how the trainer built it before: seeded, on the CPU, fp32
    emb = torch.randn(c.vocab_size, c.hidden_size)
    tr = DraftTrainer(cfg, c, emb, DistContext(), 10)
    again = DraftTrainer(cfg, c, emb, DistContext(), 10)
    ref = before.state_dict()
    for name, v in tr.draft.state_dict().items():
        want = emb if name == "embed_tokens.weight" else ref[name]
        assert v.device.type == "cpu" and v.dtype == want.dtype and torch.equal(v, want), name
        assert torch.equal(v, again.draft.state_dict()[name])
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[: c.draft_vocab_size] = True
    tr.set_vocab(torch.zeros(c.draft_vocab_size, dtype=torch.int64), t2d)
    batch = D.collate([D.Example(torch.arange(20), torch.ones(20, dtype=torch.int64))], pad_to=128)
    aux = torch.randn(1, 128, 3 * c.hidden_size)
    ids = batch["input_ids"]
    tr._tokens = 0
    tr.train_batch(aux, ids, ids, batch["loss_mask"], tokens=int(batch["attention_mask"].sum()))
    assert tr._tokens == 20  # the throughput counts real tokens, not the 128 padded ones
    rec = tr.log_record(tr.train_batch(aux, ids, ids, batch["loss_mask"], tokens=20))
    assert {"compiles", "compile_s", "tok_s_rank"} <= rec.keys()
