"""The fp32 gradient buffer (grads.py) and the linears that write it (linear.py) against plain autograd.

The trainer's weights get their gradients from custom backwards: each weight's fp32 `main_grad`
accumulated inside the GEMMs, the embedding half of the layer's input never multiplied back (its only
gradient, the one into input_layernorm's weight, made from the weight gradient after backward), the
clip folded into the fused AdamW's `grad_scale`. These tests hold every gradient, and a whole optimizer
step, to plain autograd on a copy of the same draft, for both architectures and both kinds of target.
"""

from __future__ import annotations

import copy

import pytest
import torch

from regen_service.bench.train_step import make_trainer
from regen_service.draft.config import DraftConfig
from regen_service.train.dist import DistContext
from regen_service.train.grads import GradBuffer
from regen_service.train.memory_probe import StepProbe
from regen_service.train.model import Eagle3Draft
from regen_service.train.ttt import ttt_loss
from tests.train.test_fast import N_DRAFT as N
from tests.train.test_fast import N_VOCAB as V
from tests.train.test_fast import _batch  # the same vocabulary and aux width (96 = 3 x 32)


def _config(arch: str) -> DraftConfig:
    if arch == "llama":
        return DraftConfig(32, 64, 4, 2, 8, 1e-5, 10000.0, 512, V, N, 32)
    return DraftConfig(32, 64, 4, 4, 24, 1e-5, 10000.0, 512, V, N, 32, draft_arch="mla", q_lora_rank=16,
                       kv_lora_rank=12, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)  # fmt: skip


def _draft(arch: str) -> Eagle3Draft:
    torch.manual_seed(0)
    d = Eagle3Draft(_config(arch))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::4][:N] = True
    d.set_vocab(t2d.nonzero().flatten() - torch.arange(N), t2d)
    with torch.no_grad():  # norm weights away from 1, so a gradient that forgets them shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


def _trainer(c: DraftConfig, lr=1e-4):
    torch.manual_seed(0)  # make_trainer draws the embedding before the trainer seeds itself
    return make_trainer(c, 3, DistContext(device=torch.device("cpu")), lr=lr)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("soft", [True, False], ids=["soft", "hard"])
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_every_buffer_gradient_equals_plain_autograd(arch, soft):
    ref = _draft(arch)
    new = copy.deepcopy(ref)
    buf = GradBuffer(list(new.parameters()))
    aux, ids, mask, probs = _batch(t=20)
    tids = ids.roll(-1, 1)
    kw = {"target_probs": probs} if soft else {}
    l0, _ = ttt_loss(ref, aux, ids, tids, mask, 4, **kw)
    l0.backward()
    for _ in range(2):  # a second step overwrites the first's gradients, it does not add to them
        buf.begin()
        l1, _ = ttt_loss(new, aux, ids, tids, mask, 4, **kw)
        l1.backward()
        buf.finish()
        assert float(l1) == pytest.approx(float(l0), rel=1e-6)
        named = dict(new.named_parameters())
        for name, p in ref.named_parameters():
            if not p.requires_grad:
                assert not hasattr(named[name], "main_grad")  # the frozen embedding
                continue
            assert named[name].grad is None  # nothing left in .grad: all of it is in the buffer
            assert _rel(named[name].main_grad, p.grad) < 2e-6, name
    # the embedding half's gradient went to input_layernorm, none of it into a [T, H] product
    assert new.midlayer.input_layernorm.weight.main_grad.abs().sum() > 0


def test_a_probe_between_steps_leaves_the_next_steps_gradients_whole():
    c = DraftConfig(32, 64, 4, 2, 8, 1e-5, 10000.0, 512, V, N, 32)
    a, b = _trainer(c), _trainer(c)
    aux, ids, mask, probs = _batch(t=20)
    StepProbe(b, 2, True, torch.float32).run(16)  # forward and backward, never finished
    ga, gb = ({}, {})
    for tr, out in ((a, ga), (b, gb)):
        tr.train_batch(aux, ids, ids, mask, draft_logits=torch.log(probs))
        out.update({k: p.detach().clone() for k, p in tr.draft.named_parameters()})
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_one_step_equals_autograd_clip_and_adamw_and_the_fused_clip_agrees():
    """The trainer's step (buffer gradients, the clip on the flat buffer) against clip_grad_norm_ and AdamW
    on plain autograd gradients; and the fused AdamW with the clip as its grad_scale (CUDA's path, run
    here by torch's CPU fused kernel) against the trainer's CPU path."""
    c = DraftConfig(32, 64, 4, 2, 8, 1e-5, 10000.0, 512, V, N, 32)
    tr, fused = _trainer(c, 1e-2), _trainer(c, 1e-2)
    fused.opt = torch.optim.AdamW(
        fused.masters.masters, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True
    )
    fused.sched = torch.optim.lr_scheduler.LambdaLR(fused.opt, tr.sched.lr_lambdas[0])
    fused.fused_opt = True
    ref = Eagle3Draft(c)
    ref.load_state_dict(tr.draft.state_dict())
    aux, ids, mask, probs = _batch(t=20)
    aux = aux * 40  # a gradient norm above the clip (0.5)
    loss, _ = ttt_loss(ref, aux, ids, ids, mask, 3, target_probs=probs)
    loss.backward()
    params = [p for p in ref.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, 0.5)
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for g in opt.param_groups:
        g["lr"] = 1e-2 * tr.sched.lr_lambdas[0](0)
    opt.step()
    m = tr.train_batch(aux, ids, ids, mask, draft_logits=torch.log(probs))
    fused.train_batch(aux, ids, ids, mask, draft_logits=torch.log(probs))
    assert float(norm) > 1 and float(m["grad_norm"]) == pytest.approx(float(norm), rel=1e-5)
    got, gotf = dict(tr.draft.named_parameters()), dict(fused.draft.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.allclose(got[name], p, atol=1e-6, rtol=1e-5), name
            assert torch.allclose(gotf[name], got[name], atol=1e-6, rtol=1e-5), name
