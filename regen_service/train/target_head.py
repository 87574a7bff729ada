"""The target's last step, from its final hidden state to what the draft trains on: `target_step`.

Every target backend ends the same way: the last layer's output through the target's final RMSNorm and
its full LM head, which gives the target's greedy next token over the whole vocabulary and its logits
over the draft vocabulary (the soft targets, softmaxed by the trainer). HFTarget gets the hidden state
already normed from its decoder and calls `head_outputs`; engine_target.VllmTarget reads the last
layer's residual stream from the engine and calls `target_step`; scripts/bench_train.py times
`target_step` inside its whole training step, so the benchmark runs the code training runs. On CUDA
the argmax and the draft columns come from one Triton kernel per chunk (target_kernels.py). Imports
torch (and triton on CUDA, which CUDA torch ships: the benchmark runs on a bare GPU host).
"""

from __future__ import annotations

import torch

from regen_service.train.chunks import chunk_rows
from regen_service.train.target_kernels import argmax_select_

# Logits elements per position chunk: Kimi-K2.5's head is 163,840 wide, so [T, V] logits of an 8K
# sequence would be 2.7 GB in bf16; a chunk of 2^27 elements is 256 MiB (819 positions) and a large GEMM.
# The positions are split into equal chunks (chunks.chunk_rows): no short last chunk running a thin GEMM.
HEAD_CHUNK_ELEMS = 1 << 27


def final_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama / DeepSeek RMSNorm: statistics in fp32, the normed values cast back to the input's dtype
    before the weight multiplies them (as the targets' own modelling code does, so the argmax is theirs).
    Eager, not compiled as the draft's norm is: each sequence of a batch has its own length here."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


@torch.no_grad()
def head_outputs(
    hidden: torch.Tensor, head: torch.Tensor, draft_token_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [B, T, H] (after the final norm), head [V, H] (lm_head) -> (argmax [B, T] over the full
    vocabulary, logits over the draft vocabulary [B, T, N] fp32 or None). One pass over the head: each
    chunk of positions gets its full-vocab logits once, in the head's dtype, and both the argmax and the
    draft columns come from them, so no [B*T, V] tensor and no gathered copy of the head's draft rows."""
    b, t, h = hidden.shape
    x = hidden.reshape(b * t, h).to(head.dtype)
    pred = torch.empty(b * t, dtype=torch.int64, device=x.device)
    draft = cols = None
    if draft_token_ids is not None:
        cols = draft_token_ids.to(x.device)
        draft = torch.empty(b * t, len(cols), dtype=torch.float32, device=x.device)
    chunk = chunk_rows(b * t, head.shape[0], HEAD_CHUNK_ELEMS)
    for s in range(0, b * t, chunk):
        logits = x[s : s + chunk] @ head.T
        if x.is_cuda:  # one kernel reads the chunk for both (target_kernels.py)
            argmax_select_(logits, cols, pred[s : s + chunk], None if draft is None else draft[s : s + chunk])
            continue
        pred[s : s + chunk] = logits.argmax(-1)
        if draft is not None:
            draft[s : s + chunk] = logits.index_select(1, cols)
    return pred.reshape(b, t), None if draft is None else draft.reshape(b, t, -1)


@torch.no_grad()
def target_step(
    last_hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    head: torch.Tensor,
    draft_token_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """last_hidden [B, T, Ht] (the last layer's output, BEFORE the final norm), the final norm's weight
    [Ht] and eps, head [V, Ht] -> (argmax [B, T] over the full vocabulary, draft-vocab logits [B, T, N]
    fp32 or None). The norm computes in the dtype last_hidden comes in (fp32 in, fp32 out)."""
    return head_outputs(final_norm(last_hidden, norm_weight, eps), head, draft_token_ids)
