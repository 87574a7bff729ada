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
from regen_service.train import loss as loss_mod
from regen_service.train.chunks import chunk_rows
from regen_service.train.dist import DistContext
from regen_service.train.grads import GradBuffer
from regen_service.train.loss import head_loss, reference_loss
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


@pytest.mark.parametrize("held", [True, False], ids=["held", "at-once"])
@pytest.mark.parametrize("soft", [True, False], ids=["soft", "hard"])
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_every_buffer_gradient_equals_plain_autograd(arch, soft, held):
    """held: each weight's uses made as one product when backward ends (short sequences' path, these
    tests' 20 rows); at-once: each use's product made in its own backward (8K rows and more on a GPU)."""
    ref = _draft(arch)
    new = copy.deepcopy(ref)
    buf = GradBuffer(list(new.parameters()))
    buf.hold_below_rows = buf.hold_below_rows if held else 0
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
        assert l1.item() == pytest.approx(l0.item(), rel=1e-6)
        named = dict(new.named_parameters())
        for name, p in ref.named_parameters():
            if not p.requires_grad:
                assert not hasattr(named[name], "main_grad")  # the frozen embedding
                continue
            assert named[name].grad is None  # nothing left in .grad: all of it is in the buffer
            assert _rel(named[name].main_grad, p.grad) < 2e-6, name
    # the embedding half's gradient went to input_layernorm, none of it into a [T, H] product
    assert new.midlayer.input_layernorm.weight.main_grad.abs().sum() > 0


def test_held_weight_gradients_are_whole_when_backward_returns_and_a_second_backward_adds():
    """Two micro-batches, two backward passes, one step: each pass makes its held products before it
    returns (the memory probe, which never calls finish, measures them), and the second adds to the first."""
    ref = _draft("llama")
    new = copy.deepcopy(ref)
    buf = GradBuffer(list(new.parameters()))
    batches = [_batch(t=20), _batch(seed=2, t=12)]
    for aux, ids, mask, probs in batches:
        ttt_loss(ref, aux, ids, ids.roll(-1, 1), mask, 4, target_probs=probs)[0].backward()
    buf.begin()
    q = new.midlayer.self_attn.q_proj.weight
    for n, (aux, ids, mask, probs) in enumerate(batches):
        ttt_loss(new, aux, ids, ids.roll(-1, 1), mask, 4, target_probs=probs)[0].backward()
        assert not buf._held  # nothing waits for finish
        if n == 0:
            first = q.main_grad.clone()
            assert first.abs().sum() > 0
    assert not torch.equal(q.main_grad, first)  # the second pass added, it did not overwrite
    buf.finish()
    named = dict(new.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert _rel(named[name].main_grad, p.grad) < 2e-6, name


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


def _head_case(n_rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, 32, generator=g)
    rw = torch.rand(n_rows, generator=g)
    probs = torch.softmax(torch.randn(n_rows, N, generator=g), -1)
    return x, rw, probs, torch.arange(n_rows)


def test_the_head_gradient_written_into_the_buffer_takes_the_incoming_scale_and_adds_a_second_batch(
    monkeypatch,
):
    """The head loss writes the lm_head's fp32 gradient straight into main_grad when it is the step's first
    write, and scales it in backward by the incoming gradient (a loss weight: 0.37 here); a second
    micro-batch in the same step adds its own, scaled, instead of overwriting; several chunks, the last
    one shorter; under no_grad the buffer is left alone. All against plain autograd."""
    monkeypatch.setattr(loss_mod, "CHUNK_ELEMS", N * 7)  # 7 rows at most: 10 rows in 5 + 5, 13 in 7 + 6
    torch.manual_seed(0)
    head = torch.nn.Linear(32, N, bias=False)
    ref_w = head.weight.detach().clone().requires_grad_(True)
    buf = GradBuffer([head.weight])
    buf.begin()
    batches = [_head_case(10, 1), _head_case(13, 2)]
    for scale, (x, rw, probs, rows) in zip((0.37, 1.7), batches, strict=True):
        kw = {"target_probs": probs, "prob_rows": rows}
        xr = x.clone().requires_grad_(True)
        xn = x.clone().requires_grad_(True)
        (ref_total, _, _) = reference_loss(xr, ref_w, rw, **kw)
        (total, _, _) = head_loss(xn, head.weight, rw, **kw)
        assert total.item() == pytest.approx(ref_total.item(), rel=1e-6)
        (ref_total * scale).backward()
        (total * scale).backward()
        assert _rel(xn.grad, xr.grad) < 2e-6
    buf.finish()
    assert head.weight.grad is None
    assert _rel(head.weight.main_grad, ref_w.grad) < 2e-6
    before = head.weight.main_grad.clone()
    with torch.no_grad():
        x, rw, probs, rows = batches[0]
        total, _, _ = head_loss(x, head.weight, rw, target_probs=probs, prob_rows=rows)
    assert torch.equal(head.weight.main_grad, before)
    assert total.item() == pytest.approx(
        reference_loss(x, ref_w, rw, target_probs=probs, prob_rows=rows)[0].item()
    )


def test_logit_chunks_are_equal_within_their_budget():
    # Kimi 8K, 7 TTT steps: 4 chunks of 14,336 rows, not 3 of 16,777 and a short one
    assert chunk_rows(57_344, 32_000, 1 << 29) == 14_336
    assert chunk_rows(14_336, 32_000, 1 << 29) == 14_336  # one chunk when it fits
    assert chunk_rows(10, 4, 28) == 5 and chunk_rows(0, 4, 28) == 7 and chunk_rows(3, 100, 10) == 1
