"""The fast training step against today's: the same loss and gradients on the same batch.

The reference is the eager attention (full scores, fp32 softmax) with per-step fp32 logits through
plain autograd; the fast step is the fused head loss (and, forward only, flex attention: it has no
CPU backward; the GPU check of its gradients is scripts/bench_train.py's numerics mode, figures in
docs/training.md). Also: bf16 parameters with fp32 masters, served head dims, YaRN carried into
the draft's rotary tables and config, and the target's draft-vocab logits without full fp32 logits.
"""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from regen_service.draft.config import DraftConfig
from regen_service.draft.export import build_config
from regen_service.train import loss as L
from regen_service.train.model import Eagle3Draft
from regen_service.train.optim import MasterWeights
from regen_service.train.rope import RotaryTable, inv_freq_and_scale
from regen_service.train.target import head_outputs
from regen_service.train.trainer import draft_config_for
from regen_service.train.ttt import _shift, ttt_loss

N_VOCAB, N_DRAFT = 300, 70


def _draft(seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(DraftConfig(32, 64, 4, 2, 8, 1e-5, 10000.0, 512, N_VOCAB, N_DRAFT, 32))
    t2d = torch.zeros(N_VOCAB, dtype=torch.bool)
    t2d[::4][:N_DRAFT] = True  # draft ids map to every 4th target id
    used = t2d.nonzero().flatten()
    d.set_vocab(used - torch.arange(N_DRAFT), t2d)
    return d


def _batch(seed=1, b=2, t=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N_VOCAB, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).long()
    probs = torch.softmax(torch.randn(b, t, N_DRAFT, generator=g) * 2, -1)
    return torch.randn(b, t, 96, generator=g), ids, mask, probs


def todays_ttt_loss(draft, aux, input_ids, target_ids, loss_mask, ttt_length, decay=0.8):
    """Today's (pre-issue-11) hard-target loop, verbatim in substance: per-step fp32 logits + F.cross_entropy."""
    b, t = input_ids.shape
    hidden = draft.fc(aux)
    positions = torch.arange(t)[None].expand(b, t)
    cache, total = [], torch.zeros(())
    for i in range(ttt_length):
        tgt = draft.t2d_index[_shift(target_ids, 1 + i)]
        valid = _shift(loss_mask, 2 + i).bool() & (tgt >= 0)
        hidden, logits = draft.step(_shift(input_ids, 1 + i), hidden, positions + i, cache)
        ce = F.cross_entropy(logits.float().flatten(0, 1), tgt.clamp(min=0).flatten(), reduction="none")
        total = total + (decay**i) * (ce * valid.flatten()).sum() / valid.sum().clamp(min=1)
    return total


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_fast_step_matches_todays_loss_and_gradients(monkeypatch):
    monkeypatch.setattr(L, "CHUNK_ELEMS", N_DRAFT * 50)  # several chunks over the 4*2*24 rows
    ref, new = _draft(), _draft()
    aux, ids, mask, _ = _batch()
    tids = ids.roll(-1, 1)  # the target's argmax: mostly inside the draft vocab or not, both happen
    l0 = todays_ttt_loss(ref, aux, ids, tids, mask, 4)
    l0.backward()
    l1, metrics = ttt_loss(new, aux, ids, tids, mask, 4)
    l1.backward()
    assert abs(l1.item() - l0.item()) <= 1e-5 * abs(l0.item())
    g0, g1 = _grads(ref), _grads(new)
    assert set(g0) == set(g1)
    worst = max(_rel(g1[k], g0[k]) for k in g0)
    assert worst < 1e-4, worst
    assert metrics["tokens_0"] > 0 and 0 <= float(metrics["acc_0"]) <= 1


def test_soft_fused_matches_reference():
    ref, new = _draft(), _draft()
    aux, ids, mask, probs = _batch()
    l0, m0 = ttt_loss(ref, aux, ids, ids, mask, 3, target_probs=probs, fused=False)
    l0.backward()
    l1, m1 = ttt_loss(new, aux, ids, ids, mask, 3, target_probs=probs, fused=True)
    l1.backward()
    assert abs(l1.item() - l0.item()) <= 1e-5 * abs(l0.item())
    g0, g1 = _grads(ref), _grads(new)
    assert max(_rel(g1[k], g0[k]) for k in g0) < 1e-4
    assert torch.allclose(m0["loss_2"], m1["loss_2"], rtol=1e-5)


def test_soft_loss_with_one_hot_targets_is_the_hard_loss():
    d = _draft()
    aux, ids, mask, _ = _batch()
    tgt = d.t2d_index[ids].clamp(min=0)
    one_hot = F.one_hot(tgt, N_DRAFT).float()
    with torch.no_grad():
        hard, _ = ttt_loss(d, aux, ids, ids, mask, 3)
        soft, _ = ttt_loss(d, aux, ids, ids, mask, 3, target_probs=one_hot)
    assert torch.allclose(hard, soft, rtol=1e-5)


def test_flex_forward_matches_eager_on_cpu():
    """flex_attention has no CPU backward; its forward (the TTT mask as a mask_mod) must equal eager's."""
    ref, new = _draft(), _draft()
    new.set_attention("flex")
    aux, ids, mask, _ = _batch(t=40)
    with (
        torch.no_grad(),
        warnings.catch_warnings(),
    ):  # torch warns (once per process) that uncompiled flex is unfused
        warnings.simplefilter("ignore", UserWarning)
        a, _ = ttt_loss(ref, aux, ids, ids, mask, 4)
        b, _ = ttt_loss(new, aux, ids, ids, mask, 4)
    assert abs(a.item() - b.item()) <= 1e-5 * abs(a.item())
    with pytest.raises(ValueError, match="allowed eager, flex"):
        new.set_attention("sdpa")


def test_bf16_parameters_step_fp32_masters():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16), requires_grad=False)
    mw = MasterWeights([p, frozen])
    assert len(mw.masters) == 1 and mw.masters[0].dtype == torch.float32  # no copy of frozen weights
    opt = torch.optim.SGD(mw.masters, lr=1e-3)
    for _ in range(8):  # 8 updates of 1e-3: each alone vanishes in bf16 (eps 2^-7 at 1.0), not in fp32
        p.grad = torch.ones_like(p)
        mw.to_masters()
        opt.step()
        mw.to_params()
    assert torch.allclose(mw.masters[0], torch.full((4,), 0.992), atol=1e-6)
    assert p.dtype == torch.bfloat16 and p[0].item() == pytest.approx(0.992, abs=4e-3)
    fp32 = torch.nn.Parameter(torch.ones(2))
    assert MasterWeights([fp32]).masters[0] is fp32 and MasterWeights([fp32]).state() is None


KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def test_kimi_shapes_serve_and_carry_yarn(caplog):
    tc = SimpleNamespace(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, intermediate_size=18432,
        rms_norm_eps=1e-6, rope_theta=50000.0, max_position_embeddings=262144, vocab_size=163840,
        rope_scaling=KIMI_YARN,
    )  # fmt: skip
    cfg = SimpleNamespace(num_attention_heads=None, num_key_value_heads=None, intermediate_size=None,
                          draft_vocab_size=32000)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        dc = draft_config_for(tc, cfg)
    assert (dc.num_attention_heads, dc.head_dim, dc.num_key_value_heads) == (56, 128, 56)
    assert "head_dim 128" in caplog.text and "112" in caplog.text
    assert dc.rope_scaling["factor"] == 64.0
    exported = build_config(dc.to_dict(), [2, 30, 58])
    assert exported["rope_scaling"] == dc.rope_scaling and exported["head_dim"] == 128
    llama = SimpleNamespace(**{**vars(tc), "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                               "rope_scaling": None})  # fmt: skip
    dl = draft_config_for(llama, cfg)
    assert (dl.num_attention_heads, dl.head_dim, dl.num_key_value_heads, dl.rope_scaling) == (
        32,
        128,
        8,
        None,
    )


def test_yarn_tables_follow_the_engines():
    plain, s0 = inv_freq_and_scale(128, 50000.0, None)
    yarn, s1 = inv_freq_and_scale(128, 50000.0, KIMI_YARN)
    assert s0 == 1.0 and s1 == pytest.approx(0.1 * torch.log(torch.tensor(64.0)).item() + 1)
    assert torch.allclose(yarn[:8], plain[:8])  # fast dims extrapolate
    assert torch.allclose(yarn[-4:], plain[-4:] / 64)  # slow dims interpolate
    cos, _sin = RotaryTable(128, 50000.0, KIMI_YARN).get(10, torch.device("cpu"), torch.float32)
    assert float(cos[0, 0]) == pytest.approx(s1) and cos.shape == (10, 128)
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        inv_freq_and_scale(128, 1e4, {"type": "longrope", "factor": 2})


def test_head_outputs_chunked_equal_full_logits(monkeypatch):
    import regen_service.train.target_head as T

    monkeypatch.setattr(T, "HEAD_CHUNK_ELEMS", 3 * N_VOCAB)
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(2, 10, 16, generator=g), torch.randn(N_VOCAB, 16, generator=g)
    rows = torch.arange(0, N_VOCAB, 4)[:N_DRAFT]
    pred, draft = head_outputs(h, w, rows)
    full = h @ w.T
    assert torch.equal(pred, full.argmax(-1))
    assert torch.allclose(draft, full[..., rows], atol=1e-5)
    assert head_outputs(h, w, None)[1] is None


def test_hf_target_states_give_the_draft_rows_of_its_logits(tmp_path):
    from regen_service.train.fixtures import make_tiny_target
    from regen_service.train.target import HFTarget

    target = HFTarget(str(make_tiny_target(tmp_path / "t", layers=4, hidden=32, heads=4, kv_heads=2)))
    ids = torch.randint(0, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(5, target.vocab_size, 7)
    aux, pred, draft = target.states(ids, None, rows)
    logits = target.model(ids).logits
    assert torch.equal(pred, logits.argmax(-1)) and torch.equal(target(ids)[1], pred)
    assert torch.allclose(draft, logits[..., rows], atol=1e-4) and aux.shape == (2, 9, 96)
