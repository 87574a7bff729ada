"""FLOPs of one EAGLE-3 training step and the MFU figures they give, regen's and the peers' alike.

scripts/bench_train.py reports its draft step with these, and a summary of the peers' lines
(../shared/bench-peers/bench_peers.py, which counts the draft's FLOPs only) recomputes theirs with
`peer_step_figures`, so every implementation is held to one formula. A step as training runs it is the
draft's forward and backward (`model_flops`) plus the target's LM head over the last hidden state,
forward only (`target_head_flops`): regen and SpecForge project through the full vocabulary and keep the
draft columns, speculators through a head already cut to the draft vocabulary (its verifier_lm_head is
[draft_vocab, H]), so each is counted by the head it multiplies; speculators' draft lm_head is frozen, so
its step is counted without that head's weight gradient. Plain arithmetic on a DraftConfig: no torch, so
it imports anywhere.
"""

from __future__ import annotations

from regen_service.draft.config import DraftConfig

PEAK_BF16 = 989e12  # H200 dense bf16 datasheet
PEAK_MEASURED = 790e12  # measured on 8192^3 bf16 products on the H200s this was run on

# The width of the target head each peer's step multiplies: "vocab" the full one, "draft" the draft rows.
PEER_HEAD = {"specforge": "vocab", "speculators": "draft"}
LLAMA_8B_SHAPES = "4096,32,8,14336,128256,32000"  # bench_peers.py's default P3_SHAPES


def draft_shapes(h, heads, kv, inter, vocab, dvocab) -> DraftConfig:
    """A Llama-style draft of a target whose hidden size is the draft's (head dim h // heads)."""
    return DraftConfig(h, inter, heads, kv, h // heads, 1e-5, 500000.0, 131072, vocab, dvocab, h)


def _attn_proj_flops(c: DraftConfig) -> tuple[float, int, int]:
    """(projection FLOPs per token, qk dim x heads, v dim x heads) of the draft's attention."""
    h, nh = c.hidden_size, c.num_attention_heads
    if c.draft_arch == "mla":
        qk, v, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.qk_rope_head_dim
        proj = 2 * (2 * h * c.q_lora_rank + c.q_lora_rank * nh * qk + 2 * h * (c.kv_lora_rank + rope))
        proj += 2 * (c.kv_lora_rank * nh * (c.qk_nope_head_dim + v) + nh * v * h)
        return proj, nh * qk, nh * v
    hd, nkv = c.head_dim, c.num_key_value_heads
    return 2 * 2 * h * (nh + 2 * nkv) * hd + 2 * nh * hd * h, nh * hd, nh * hd


def model_flops(c: DraftConfig, t: int, ttt: int, head_trained: bool = True) -> float:
    """The draft's training FLOPs per sequence (fwd + bwd = 3x fwd); attention scores counted causal (T^2/2).
    head_trained=False: a frozen draft lm_head (speculators') makes no weight gradient, so its head counts
    2x its forward (the forward and the input gradient), not 3x."""
    h, i = c.hidden_size, c.intermediate_size
    proj_tok, qk, v = _attn_proj_flops(c)
    fwd = 2 * t * 3 * c.target_hidden_size * h  # fc
    for step in range(ttt):
        proj = t * proj_tok
        attn = 2 * (qk + v) * (t * t / 2 + t * step)  # QK^T and PV over prefix + own earlier steps
        mlp = 3 * 2 * t * h * i
        fwd += proj + attn + mlp
    head = ttt * 2 * t * h * c.draft_vocab_size
    return 3 * fwd + (3 if head_trained else 2) * head


def target_head_flops(c: DraftConfig, t: int, width: int | None = None) -> float:
    """The target's LM head over one sequence's last hidden state, forward only (the head is frozen and
    no gradient flows into the target): the full vocabulary unless `width` says how many rows it has."""
    return 2 * t * c.target_hidden_size * (c.vocab_size if width is None else width)


def _tflop(flops: float) -> float:
    return float(f"{flops / 1e12:.5g}")  # significant digits: a CPU smoke test's step is a few GFLOP


def step_figures(
    c: DraftConfig, t: int, ttt: int, batch: int, step_s: float, head_width: int | None = None, whole=True,
    head_trained: bool = True,
) -> dict:  # fmt: skip
    """The FLOP split of one step of `batch` sequences and its MFU from the total. whole=False: the
    draft's step alone (the target's draft-vocab logits handed in), as bench_train.py's `--step draft`."""
    draft = model_flops(c, t, ttt, head_trained) * batch
    head = target_head_flops(c, t, head_width) * batch if whole else 0.0
    total = draft + head
    return {
        "model_tflop_per_step": _tflop(total),
        "draft_tflop_per_step": _tflop(draft),
        "target_head_tflop_per_step": _tflop(head),
        "mfu_vs_989": round(total / step_s / PEAK_BF16, 4),
        "mfu_vs_790_measured": round(total / step_s / PEAK_MEASURED, 4),
    }


def peer_step_figures(line: dict, shapes: str = LLAMA_8B_SHAPES) -> dict:
    """A bench_peers.py result line (impl, batch, seq, ttt, step_s) at `shapes` (its P3_SHAPES:
    "H,heads,kv_heads,intermediate,target_vocab,draft_vocab") -> step_figures under the whole-step
    formula, the target head counted at the width that peer multiplies (PEER_HEAD) and the draft's
    lm_head without a weight gradient where the line says it is frozen (speculators' `lm_head_trained`:
    false; its model.py sets lm_head.weight.requires_grad = False, vllm-project/speculators c05b95b)."""
    if line.get("impl") not in PEER_HEAD:  # regen's own lines carry their split (bench_train.py --step)
        raise ValueError(f"not a peer's line: impl {line.get('impl')!r}, not one of {sorted(PEER_HEAD)}")
    c = draft_shapes(*(int(x) for x in shapes.split(",")))
    width = c.draft_vocab_size if PEER_HEAD[line["impl"]] == "draft" else c.vocab_size
    trained = bool(line.get("lm_head_trained", True))  # SpecForge's lines carry none: it trains lm_head
    return step_figures(c, line["seq"], line["ttt"], line["batch"], line["step_s"], head_width=width,
                        head_trained=trained)  # fmt: skip
