"""The EAGLE-3 draft: `fc`, one decoder layer (`midlayer`), `norm`, `lm_head`, plus `d2t`/`t2d`.

Two architectures (`DraftConfig.draft_arch`): "llama", SGLang's LlamaForCausalLMEagle3 (Llama GQA
attention, layers.py), and "mla", its Eagle3DeepseekV2ForCausalLM (the same layer with DeepSeek-V2
multi-latent attention, mla_attention.py; what SGLang serves for MLA targets such as Kimi-K2.5).
Module names are SGLang's checkpoint keys, so `draft_state_dict()` exports with no renaming. The frozen `embed_tokens` is the target's and is left out of that state dict
(SGLang replaces the draft's embedding with the target's at load). Attention takes a per-step cache:
the first entry holds the keys/values of every prefix position (causal); each later entry holds one
key/value per query position (the draft's own earlier steps), as SpecForge's training-time test and
chain decoding both need; layers.attend picks the eager reference or flex attention. Rotary tables
(with the target's YaRN scaling) come from rope.py. The TTT loss lives in ttt.py, the vocabulary in
vocab.py. Imports torch only (the GPU benchmark runs it without pydantic).
"""

from __future__ import annotations

import torch
from torch import nn

from regen_service.draft.config import DraftConfig
from regen_service.train.layers import MLP, Attention, RMSNorm
from regen_service.train.linear import NormedPair
from regen_service.train.mla_attention import MLAAttention
from regen_service.train.rope import RotaryTable

EXCLUDED_KEYS = ("embed_tokens.weight",)


class MidLayer(nn.Module):
    """SpecForge llama3_eagle's decoder layer: attention over [norm(embedding); norm(hidden)] (2H in);
    Llama attention or, for draft_arch "mla", SGLang's Eagle3MLADecoderLayer's multi-latent attention."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = MLAAttention(c) if c.draft_arch == "mla" else Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, cache) -> torch.Tensor:
        residual = hidden
        # [input_layernorm(emb); hidden_norm(hidden)], kept apart: the frozen embedding's half needs no
        # input gradient (linear.py)
        x = NormedPair(
            self.input_layernorm.normalized(emb), self.input_layernorm.weight, self.hidden_norm(hidden)
        )
        hidden = residual + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # the MLA attention rotates only its qk_rope dims, with DeepSeek's YaRN variant; its frequencies
        # are made on the CPU (float64) even when the draft is built under a CUDA device context: the
        # tables are computed there and moved (RotaryTable.get), the same numbers on every device
        with torch.device("cpu"):
            self.rotary = RotaryTable(
                c.rotary_dim, c.rope_theta, c.rope_scaling, deepseek=c.draft_arch == "mla"
            )
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # target id -> draft id (or -1); derived from t2d, so not saved
        self.register_buffer(
            "t2d_index", torch.full((c.vocab_size,), -1, dtype=torch.int64), persistent=False
        )

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))
        used = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        idx = torch.full_like(self.t2d_index, -1)
        idx[used] = torch.arange(used.numel(), device=used.device)
        self.t2d_index.copy_(idx)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "d2t" in state_dict:
            self.set_vocab(state_dict[prefix + "d2t"], state_dict[prefix + "t2d"])

    def set_attention(self, impl: str) -> None:
        if impl not in ("eager", "flex", "flash", "cudnn", "fa4"):
            raise ValueError(f"attention impl {impl!r}: allowed eager, flex, flash, cudnn, fa4")
        self.midlayer.self_attn.impl = impl

    def step_hidden(self, input_ids, hidden, cos, sin, cache):
        """One draft step from rotary tables already indexed: output hidden [B,T,H] (no logits)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, cache)

    def step(self, input_ids, hidden, positions, cache):
        """One draft step: returns (output hidden [B,T,H], draft-vocab logits [B,T,N])."""
        cos, sin = self.rotary.at(positions, hidden.dtype)
        out = self.step_hidden(input_ids, hidden, cos, sin, cache)
        return out, self.lm_head(self.norm(out))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything SGLang loads (incl. d2t, t2d), on the CPU; never the frozen embedding."""
        return {k: v.detach().cpu().clone() for k, v in self.state_dict().items() if k not in EXCLUDED_KEYS}
