"""The target's last step (target_head.py) against the computation it replaced.

head_outputs used to make the full-vocab logits chunk by chunk for the argmax only, then a second
matmul through a gathered copy of the head's draft rows; now one pass gives both. The old code is kept
here as the reference: argmax equal, draft logits equal to rounding, for fp32 and bf16 heads, with and
without draft ids, over a position count that is not a multiple of the chunk. target_step's norm is
held to transformers' LlamaRMSNorm, and the vLLM backend's assembly to its former `_normed` + head.
"""

from __future__ import annotations

import pytest
import torch

import regen_service.train.target_head as TH
from regen_service.train.engine_target import VllmTarget

V, H = 300, 16


def old_head_outputs(hidden, head, draft_token_ids, chunk_elems):
    b, t, h = hidden.shape
    x = hidden.reshape(b * t, h).to(head.dtype)
    pred = torch.empty(b * t, dtype=torch.int64)
    chunk = max(1, chunk_elems // head.shape[0])
    for s in range(0, b * t, chunk):
        pred[s : s + chunk] = (x[s : s + chunk] @ head.T).argmax(-1)
    draft = None
    if draft_token_ids is not None:
        draft = (x @ head[draft_token_ids].T).float().reshape(b, t, -1)
    return pred.reshape(b, t), draft


def _tol(dtype):
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_ids", [False, True])
def test_one_pass_over_the_head_equals_the_two_matmul_head(monkeypatch, dtype, with_ids):
    monkeypatch.setattr(TH, "HEAD_CHUNK_ELEMS", 3 * V)  # 3 positions a chunk: 2 x 10 = 20 is not a multiple
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 10, H, generator=g).to(dtype)
    head = torch.randn(V, H, generator=g).to(dtype)
    ids = torch.randperm(V, generator=g)[:70] if with_ids else None  # unsorted: the columns' order counts
    pred, draft = TH.head_outputs(hidden, head, ids)
    ref_pred, ref_draft = old_head_outputs(hidden, head, ids, 3 * V)
    assert pred.dtype == torch.int64 and torch.equal(pred, ref_pred)
    if not with_ids:
        assert draft is None and ref_draft is None
        return
    assert draft.dtype == torch.float32 and draft.shape == (2, 10, 70)
    torch.testing.assert_close(draft, ref_draft, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_target_step_is_the_llama_final_norm_then_the_head(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    last = (torch.randn(2, 7, H, generator=g) * 5).to(dtype)
    norm = LlamaRMSNorm(H, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
    head, ids = torch.randn(V, H, generator=g).to(dtype), torch.arange(40)
    normed = TH.final_norm(last, norm.weight, 1e-5)
    with torch.no_grad():
        assert torch.equal(normed, norm(last))
    pred, draft = TH.target_step(last, norm.weight.detach(), 1e-5, head, ids)
    ref_pred, ref_draft = old_head_outputs(norm(last).detach(), head, ids, TH.HEAD_CHUNK_ELEMS)
    assert torch.equal(pred, ref_pred)
    torch.testing.assert_close(draft, ref_draft, **_tol(dtype))


def test_the_vllm_backend_assembles_what_its_former_norm_and_head_gave():
    g = torch.Generator().manual_seed(3)
    t = VllmTarget.__new__(VllmTarget)  # only the head's weights: no engine, no checkpoint
    t.hidden_size, t.device, t._eps = H, torch.device("cpu"), 1e-6
    t._norm_w = torch.rand(H, generator=g) + 0.5
    t._lm_head = torch.randn(V, H, generator=g)
    states = [(torch.randn(n, 4, H, generator=g) * 3).to(torch.bfloat16) for n in (9, 5)]
    ids = torch.arange(0, V, 3)
    aux, pred, draft = t._assemble(states, (2, 9), ids)
    for i, st in enumerate(states):
        n = st.shape[0]
        x = st[:, 3].to(torch.float32)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + t._eps) * t._norm_w  # the old _normed
        ref_pred, ref_draft = old_head_outputs(normed[None], t._lm_head, ids, TH.HEAD_CHUNK_ELEMS)
        assert torch.equal(pred[i, :n], ref_pred[0]) and not pred[i, n:].any()
        torch.testing.assert_close(draft[i, :n], ref_draft[0], rtol=1e-5, atol=1e-5)
        assert not draft[i, n:].any() and torch.equal(aux[i, :n], st[:, :3].reshape(n, -1))
    assert t._head(states[0][:, 3], None)[1] is None
