"""Block-sparse attention for the training-time test: the TTT mask as a flex_attention mask_mod.

At TTT step n (0-based) each query t attends to the step-0 keys causally (kv <= t) and to exactly
one key in each of the n later segments: its own earlier draft step (kv % T == t). Keys of all
steps are concatenated to [B, kv_heads, T*(n+1), d]; flex_attention visits only the 128x128 blocks
the mask touches (the causal triangle plus one diagonal block per segment), never building the
[B, heads, T, T*(n+1)] score matrix, and reads grouped keys directly (enable_gqa). Block masks
are cached per (T, n, device); packed rows (packing.py) add their documents to the mask (`doc_ids`: a query
sees the prefix keys of its own document) and get a mask of their own per batch. The kernel is compiled on CUDA (compiled.py's policy); flex_attention has no CPU backward,
so the CPU trains with the eager reference (model.Attention) and the CPU tests compare the two
forwards. The per-step key/value bookkeeping is model.py's. Imports torch only.
"""

from __future__ import annotations

import functools

import torch

from regen_service.train.compiled import compiled, mark_lengths

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    create_block_mask = flex_attention = None

BLOCK = 128


def available(device: torch.device) -> bool:
    """Whether the flex path can train here (CUDA and a torch that has flex_attention)."""
    return flex_attention is not None and device.type == "cuda"


def fits(dtype: torch.dtype, qk_head_dim: int) -> bool:
    """Whether the flex kernel fits the GPU's shared memory: fp32 with a qk head dim over 128 does not on
    an H200 (the MLA draft's 192, padded to 256, asked 278,784 bytes of 232,448); bf16 does."""
    return dtype != torch.float32 or qk_head_dim <= 128


def ttt_mask_mod(t: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx < t) & (kv_idx <= q_idx)) | ((kv_idx >= t) & (kv_idx % t == q_idx))

    return mask_mod


def ttt_doc_mask_mod(t: int, doc_ids: torch.Tensor):
    """ttt_mask_mod, the prefix keys limited to the query's own document (doc_ids [B, T])."""

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc_ids[b, q_idx] == doc_ids[b, kv_idx % t]
        return (((kv_idx < t) & (kv_idx <= q_idx)) | ((kv_idx >= t) & (kv_idx % t == q_idx))) & same

    return mask_mod


def _compiled_block_mask():
    # what create_block_mask(_compile=True) did, without its DeprecationWarning at every new mask (the
    # flag is to be removed): one compiled create_block_mask, so a new length is a dynamo cache entry
    return compiled(create_block_mask, all_dynamic=True)


# 24 length buckets up to 16K (lengths.py, "geometric") x 7 TTT steps fit; "off" or "block" may evict
@functools.lru_cache(maxsize=256)
def ttt_block_mask(t: int, segments: int, device: str):
    """The BlockMask for T queries over `segments` key segments of length T (step segments-1)."""
    make = create_block_mask if device == "cpu" else _compiled_block_mask()
    return make(ttt_mask_mod(t), None, None, t, t * segments, device=device, BLOCK_SIZE=BLOCK)


# keyed by the doc_ids tensor itself (a tensor hashes by identity): one mask per TTT step of a packed batch
@functools.lru_cache(maxsize=16)
def ttt_doc_block_mask(doc_ids: torch.Tensor, segments: int, device: str):
    """The BlockMask of packed rows: ttt_block_mask's, each query's prefix limited to its document."""
    b, t = doc_ids.shape
    make = create_block_mask if device == "cpu" else _compiled_block_mask()
    return make(ttt_doc_mask_mod(t, doc_ids), b, None, t, t * segments, device=device, BLOCK_SIZE=BLOCK)


def _compiled():
    # the lengths arrive as ints too (the BlockMask's seq_lengths): all sizes symbolic under "lengths"
    return compiled(flex_attention, all_dynamic=True)


def ttt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, H, T, d]; k, v [B, KV, T*n, d] (all steps so far): the TTT-masked attention, [B, H, T, d].
    doc_ids [B, T]: packed rows' documents (no key of another document is seen)."""
    t = q.shape[2]
    dev = q.device
    if doc_ids is None:
        bm = ttt_block_mask(t, k.shape[2] // t, str(dev))
    else:
        bm = ttt_doc_block_mask(doc_ids, k.shape[2] // t, str(dev))
    fn = _compiled() if dev.type == "cuda" else flex_attention
    mark_lengths((q, 2), (k, 2), (v, 2))
    return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
