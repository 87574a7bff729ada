"""The training step: the draft built from the target's shapes, AdamW, warmup+cosine, clipping, bf16.

`DraftTrainer` owns the model, optimizer and schedule and turns (target states, ids, masks) into
one optimizer step; it knows nothing about Redis or shards (runner.py feeds it; the GPU benchmark
feeds it synthetic states). Parameters stay fp32; on a GPU the forward runs under bf16 autocast.
Under torchrun the TTT module is wrapped in DistributedDataParallel. Imports torch only; `cfg` is
a TrainConfig or any object with the same attributes.
"""

from __future__ import annotations

import math
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from regen_service.drafter.dist import DistContext, all_reduce_mean
from regen_service.drafter.model import DraftConfig, Eagle3Draft
from regen_service.drafter.ttt import TTTModule


def draft_config_for(tc, cfg) -> DraftConfig:
    """Draft shapes from the target's text config (overridable in cfg); see eagle3.md."""
    heads = cfg.num_attention_heads or tc.num_attention_heads
    kv = cfg.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or heads
    rope = getattr(tc, "rope_parameters", None) or {}
    return DraftConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=tc.hidden_size // heads,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        vocab_size=tc.vocab_size,
        draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=tc.hidden_size,
    )


class WarmupCosine:
    """Linear warmup, cosine decay to min_ratio at `total` steps, flat after. A class so it pickles."""

    def __init__(self, total: int, warmup: int, min_ratio: float):
        self.total, self.warmup, self.min_ratio = total, warmup, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        p = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


class DraftTrainer:
    def __init__(self, cfg, dc: DraftConfig, embed_weight: torch.Tensor, ctx: DistContext, total_steps: int):
        self.cfg, self.ctx, self.dc = cfg, ctx, dc
        torch.manual_seed(cfg.seed)
        self.draft = Eagle3Draft(dc).to(ctx.device)
        with torch.no_grad():
            self.draft.embed_tokens.weight.copy_(embed_weight.to(ctx.device, torch.float32))
        self.ttt = TTTModule(self.draft, cfg.ttt_length, cfg.ttt_decay)
        self.module = (
            DistributedDataParallel(
                self.ttt,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                broadcast_buffers=False,
            )
            if ctx.distributed
            else self.ttt
        )
        params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        warmup = max(1, int(total_steps * cfg.warmup_ratio))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, WarmupCosine(total_steps, warmup, cfg.min_lr_ratio)
        )
        self.step = 0
        self.autocast = ctx.device.type == "cuda" and cfg.bf16
        self._t0, self._tokens = time.perf_counter(), 0

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.draft.set_vocab(d2t, t2d)

    def train_batch(
        self, aux, input_ids, target_ids, loss_mask, weight: float = 1.0
    ) -> dict[str, torch.Tensor]:
        """One optimizer step. weight 0 keeps a rank with no data in lockstep without learning from it."""
        self.module.train()
        dev = self.ctx.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, metrics = self.module(aux.to(dev), input_ids.to(dev), target_ids.to(dev), loss_mask.to(dev))
        (loss * weight).backward()
        metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self._tokens += int(input_ids.numel()) if weight else 0
        metrics["loss"] = loss.detach()
        return metrics

    def log_record(self, metrics: dict[str, torch.Tensor]) -> dict:
        """Metrics averaged over ranks (collective: every rank calls it), with throughput since last call."""
        keys = sorted(k for k in metrics if not k.startswith("tokens_"))
        vec = all_reduce_mean(torch.stack([metrics[k].float().to(self.ctx.device) for k in keys]), self.ctx)
        now = time.perf_counter()
        rec = {k: round(float(v), 5) for k, v in zip(keys, vec.tolist(), strict=True)}
        rec.update(
            step=self.step,
            lr=self.sched.get_last_lr()[0],
            tok_s_rank=round(self._tokens / max(1e-9, now - self._t0), 1),
        )
        self._t0, self._tokens = now, 0
        return rec

    def state(self) -> dict:
        return {
            "draft_state_dict": self.draft.draft_state_dict(),
            "draft_config": self.dc.to_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "step": self.step,
        }

    def load_state(self, ckpt: dict) -> None:
        missing, unexpected = self.draft.load_state_dict(ckpt["draft_state_dict"], strict=False)
        if unexpected or set(missing) - {"embed_tokens.weight"}:
            raise ValueError(
                f"checkpoint does not match the draft: missing {missing}, unexpected {unexpected}"
            )
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.step = int(ckpt["step"])
