"""The flash TTT attention (flash_ttt.py): the causal part plus the diagonal keys merged by log-sum-exp.

On the CPU the causal part runs the module's plain-torch reference by the FlashAttention-2 formulas
(forward: out and the rows' log-sum-exp; backward: called with the merged output and the global
log-sum-exp, as the CUDA kernel is), so these tests hold the merge and its hand-written backward to
the eager attention's autograd. The CUDA kernel itself is held to the eager reference by
`scripts/bench_train.py --mode numerics` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from regen_service.draft.config import DraftConfig
from regen_service.train import flash_ttt
from regen_service.train.layers import eager_attention
from regen_service.train.model import Eagle3Draft
from regen_service.train.trainer import choose_attention
from regen_service.train.ttt import ttt_loss
from tests.train.test_mla import mla_config


def _cache(g, kv, t, d, dv, segments):
    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()

    return [(r(2, kv, t, d), r(2, kv, t, dv)) for _ in range(segments)]


@pytest.mark.parametrize(
    ("heads", "kv", "d", "dv", "t", "steps"),
    [
        (4, 4, 16, 16, 10, 1),
        (4, 4, 16, 16, 10, 4),
        (4, 2, 16, 16, 9, 3),
        (4, 4, 24, 16, 7, 7),
        (8, 2, 24, 16, 12, 5),
    ],
)
def test_forward_and_every_gradient_match_eager(heads, kv, d, dv, t, steps):
    """GQA (kv < heads) and the MLA draft's narrower values (dv < d, padded for the kernel) included."""
    g = torch.Generator().manual_seed(heads * 100 + steps)
    q = torch.randn(2, heads, t, d, generator=g, dtype=torch.float64).requires_grad_()
    cache = _cache(g, kv, t, d, dv, steps)
    leaves = [q] + [x for pair in cache for x in pair]
    scale = d**-0.5
    ref = eager_attention(q, cache, scale)
    probe = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((ref * probe).sum(), leaves)
    out = flash_ttt.ttt_attention(q, cache, scale, backend="reference")
    got = torch.autograd.grad((out * probe).sum(), leaves)
    # the merge computes in fp32 (as on the GPU): fp32-level agreement with the float64 reference
    assert float((out - ref).detach().abs().max()) < 1e-5
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


@pytest.mark.parametrize("arch", ["llama-gqa", "mla"])
def test_the_draft_trains_the_same_loss_and_gradients_with_flash_as_with_eager(arch):
    """Through ttt_loss's unroll (a TTTCache): each diagonal key's gradient is summed across the steps
    that read it inside the merge's backward, the later steps handing autograd None for it; GQA (4
    query heads on 2 key heads) and the MLA draft's values narrower than its keys (8 < 12)."""
    torch.manual_seed(0)
    if arch == "mla":
        config, vocab, draft_vocab, width = mla_config(), 50, 12, 96
    else:
        config, vocab, draft_vocab, width = (
            DraftConfig(32, 64, 4, 2, 8, 1e-5, 10000.0, 512, 300, 50, 32),
            300,
            50,
            96,
        )
    ref = Eagle3Draft(config)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    ref.set_vocab(torch.zeros(draft_vocab, dtype=torch.int64), t2d)
    new = Eagle3Draft(ref.config)
    new.load_state_dict(ref.state_dict())
    new.set_attention("flash")
    g = torch.Generator().manual_seed(1)
    aux, ids = (
        torch.randn(2, 20, width, generator=g),
        torch.randint(0, draft_vocab + 10, (2, 20), generator=g),
    )
    ids = ids.clamp(max=vocab - 1)
    mask = (torch.rand(2, 20, generator=g) > 0.2).long()
    la, _ = ttt_loss(ref, aux, ids, ids, mask, 5)
    lb, _ = ttt_loss(new, aux, ids, ids, mask, 5)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-5 * abs(la.item())
    for (name, p), (_, p2) in zip(ref.named_parameters(), new.named_parameters(), strict=True):
        if p.grad is not None:
            assert torch.allclose(p.grad, p2.grad, rtol=1e-4, atol=1e-6), name


def test_auto_takes_flash_only_where_the_kernel_runs_and_an_impossible_choice_says_what_can():
    cpu = torch.device("cpu")
    assert choose_attention("auto", torch.float32, 128, cpu) == "eager"
    assert choose_attention("eager", torch.float32, 128, cpu) == "eager"
    assert flash_ttt.takes(torch.bfloat16, 192)  # the MLA draft's qk head dim
    assert not flash_ttt.takes(torch.bfloat16, 192, "cudnn")  # cuDNN's limit here: 128
    assert not flash_ttt.takes(torch.float32, 128)
    assert not flash_ttt.takes(torch.bfloat16, 320)
    if not torch.cuda.is_available():  # no GPU: no fused path, whatever the shapes
        assert not flash_ttt.supported(torch.bfloat16, 128, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"attention flash: needs CUDA.*allowed here: eager"):
        choose_attention("flash", torch.float32, 128, cpu)
    with pytest.raises(ValueError, match=r"attention flex: needs CUDA.*allowed here: eager"):
        choose_attention("flex", torch.float32, 128, cpu)
    with pytest.raises(ValueError, match=r"attention fa4: .*allowed here: eager"):
        choose_attention("fa4", torch.bfloat16, 128, cpu)
    assert not flash_ttt.takes(torch.bfloat16, 192, "fa4")


class _TorchFA4:
    """flash-attn-4's two calls as fa4.py makes them, by the plain formulas in float64: [B, T, h, d]
    tensors, grouped keys read as they are (kv heads divide h), the log-sum-exp [B, h, T] natural log.
    It checks what the package requires of its inputs (unit stride in d), so the test holds
    flash_ttt's glue (layouts, GQA without repeats, the merged out and global L in backward) on the CPU."""

    @staticmethod
    def _scores(q, k, scale):
        rep = q.shape[2] // k.shape[2]
        qh, kh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1)
        t = q.shape[1]
        s = (qh @ kh.transpose(-1, -2)) * scale
        return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), rep

    def _flash_attn_fwd(self, q, k, v, softmax_scale, causal, return_lse):
        assert causal and return_lse and all(x.stride(-1) == 1 for x in (q, k, v))
        s, rep = self._scores(q, k, softmax_scale)
        lse = torch.logsumexp(s, -1)
        out = torch.exp(s - lse[..., None]) @ v.transpose(1, 2).repeat_interleave(rep, 1)
        return out.transpose(1, 2).contiguous(), lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, scale, causal):
        assert causal and all(x.stride(-1) == 1 for x in (q, k, v, out, dout))
        s, rep = self._scores(q, k, scale)
        p = torch.exp(s - lse[..., None])
        do, vh = dout.transpose(1, 2), v.transpose(1, 2).repeat_interleave(rep, 1)
        ds = p * (do @ vh.transpose(-1, -2) - (do * out.transpose(1, 2)).sum(-1, keepdim=True))
        kh = k.transpose(1, 2).repeat_interleave(rep, 1)
        dq, dk, dv = (
            (ds @ kh) * scale,
            (ds.transpose(-1, -2) @ q.transpose(1, 2)) * scale,
            p.transpose(-1, -2) @ do,
        )
        b, _h, t, d = dk.shape
        kv = k.shape[2]
        dk = dk.view(b, kv, rep, t, d).sum(2)
        dv = dv.view(b, kv, rep, t, -1).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize(("heads", "kv", "steps"), [(4, 4, 1), (4, 4, 4), (8, 2, 5)])
def test_the_fa4_backend_hands_its_kernel_the_package_layout_and_unrepeated_keys(
    monkeypatch, heads, kv, steps, packed
):
    """fa4.py and flash_ttt's fa4 path against the eager attention's autograd, the package's calls played
    by _TorchFA4: q/k/v as [B, h, T, d] views of [B, T, h, d] memory (the trainer's layout), GQA keys
    passed with their own kv heads and their gradients returned per kv head; packed: the kernel called
    per document on views of the rows (two documents and padding in row 0, one in row 1)."""
    from regen_service.train import fa4
    from regen_service.train.packing import Documents

    monkeypatch.setattr(fa4, "_interface", lambda: _TorchFA4())
    g = torch.Generator().manual_seed(heads + steps)
    t, d = 9, 16

    def bthd(h):  # [B, h, T, d] view of [B, T, h, d] memory
        return torch.randn(2, t, h, d, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()

    q = bthd(heads)
    cache = flash_ttt.TTTCache()
    cache += [(bthd(kv), bthd(kv)) for _ in range(steps)]
    if packed:
        docs = Documents(((4, 3), (9,)), t)
        cache.segments, cache.doc_ids = docs.segments, docs.doc_ids()
    leaves = [q] + [x for pair in cache for x in pair]
    ref = eager_attention(q, cache, d**-0.5)
    probe = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((ref * probe).sum(), leaves)
    flat = [x for pair in cache[1:] for x in pair]
    out = flash_ttt._TTTFlash.apply(q, d**-0.5, "fa4", None, cache.segments, cache[0][0], cache[0][1], *flat)
    got = torch.autograd.grad((out * probe).sum(), leaves)
    assert float((out - ref).detach().abs().max()) < 1e-5
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5
