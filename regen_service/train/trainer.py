"""The training step: the draft built from the target's shapes, AdamW, warmup+cosine, clipping, bf16.

`DraftTrainer` owns the model, optimizer and schedule and turns (target states, ids, masks, and the
target's draft-vocab distribution for soft targets) into one optimizer step; it knows nothing about
Redis or shards (loop.py feeds it; the GPU benchmark feeds it synthetic states). On a GPU with
`bf16` the parameters are bf16 (the frozen target embedding too: no fp32 copy of it) and AdamW
steps fp32 master weights (optim.py) whose gradients backward writes in fp32 (grads.py); attention is
cuDNN's or FlashAttention-2 with the TTT diagonal merged (flash_ttt.py; `choose_attention`). The CPU
keeps fp32 and the eager attention. Under torchrun every rank starts from rank 0's weights and the
flat gradient buffer is averaged with one all-reduce before clipping (what DistributedDataParallel did
per bucket; the layer's weights get their last gradient at the end of backward anyway, step 0 of the
TTT unroll being the last one run). Imports torch only; `cfg` is a TrainConfig or any object with its
nested attributes (`data.seed`, `model.attention`, `optimisation.lr` ...: the GPU benchmark passes a
namespace).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from regen_service.draft.config import DraftConfig
from regen_service.train import compiled, fa4, flash_ttt, flexattn
from regen_service.train.adamw import MasterAdamW
from regen_service.train.dist import DistContext, all_reduce_mean
from regen_service.train.lengths import compile_counts
from regen_service.train.model import Eagle3Draft
from regen_service.train.optim import MasterWeights
from regen_service.train.rope import scaling_type
from regen_service.train.target_kernels import softmax_to
from regen_service.train.ttt import TTTModule

log = logging.getLogger(__name__)

# head dims the serving attention kernels take (FlashInfer/FA3 in SGLang: 64, 128, 256)
SERVED_HEAD_DIMS = (64, 128, 256)
# what model.attention "auto" takes, the first that runs here (choose_attention)
AUTO_ORDER = ("fa4", "cudnn", "flash", "flex", "eager")
# packed rows run the causal kernel once per document, at lengths that are rarely met twice: torch builds
# and caches a cuDNN graph per (s_q, s_kv, strides) (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams), so
# cuDNN would build one per document; FlashAttention-4 and -2 launch at any length without a build
PACKED_AUTO_ORDER = ("fa4", "flash", "flex", "eager")


def served_heads(hidden: int, heads: int) -> tuple[int, int]:
    """(heads, head_dim) with a served head dim: the target's split when it is served, else head_dim 128
    with hidden // 128 heads (Kimi-K2.5: 7168 / 64 = 112 is not served; 56 x 128, as the published drafts).
    A hidden size no served head dim divides (tiny test targets) keeps the target's split, with a warning."""
    if hidden % heads == 0 and hidden // heads in SERVED_HEAD_DIMS:
        return heads, hidden // heads
    for hd in (128, 64, 256):
        if hidden % hd == 0:
            return hidden // hd, hd
    log.warning(
        "draft attention: hidden_size %d splits into no served head dim %s; keeping %d heads (SGLang's "
        "attention kernels will not serve this draft)", hidden, SERVED_HEAD_DIMS, heads,
    )  # fmt: skip
    return heads, hidden // heads


def rope_scaling_of(tc) -> dict | None:
    """The target's rope scaling (`rope_scaling`, or transformers 5's `rope_parameters` when it scales)."""
    rs = getattr(tc, "rope_scaling", None)
    if not rs:
        rp = getattr(tc, "rope_parameters", None) or {}
        rs = rp if scaling_type(rp) is not None else None
    if not rs or (rs.get("rope_type") or rs.get("type")) == "default":
        return None
    return {k: v for k, v in dict(rs).items() if k != "rope_theta"}


def mla_dims_for(tc, heads: int) -> dict[str, int]:
    """The MLA draft's attention dims: an MLA target's own (Kimi-K2.5: q_lora 1536, kv_lora 512, nope
    128, rope 64, v 128, as lightseekorg's MLA draft), else DeepSeek-V2's proportions of the target's
    head dim (q_lora 12x, kv_lora 4x, nope 1x, rope 1/2x, v 1x)."""
    own = {
        k: getattr(tc, k, None)
        for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    }
    if all(own.values()):
        return {k: int(v) for k, v in own.items()}
    hd = tc.hidden_size // heads
    rope = max(2, hd // 2 // 2 * 2)  # even: rotary pairs
    return {
        "q_lora_rank": 12 * hd,
        "kv_lora_rank": 4 * hd,
        "qk_nope_head_dim": hd,
        "qk_rope_head_dim": rope,
        "v_head_dim": hd,
    }


def draft_config_for(tc, model) -> DraftConfig:
    """Draft shapes from the target's text config, overridable in `model` (TrainConfig.model, or any
    object with its attributes; draft_arch defaults to llama); see eagle3.md."""
    if getattr(model, "draft_arch", "llama") == "mla":
        return _mla_draft_config(tc, model)
    target_heads = model.num_attention_heads or tc.num_attention_heads
    heads, head_dim = served_heads(tc.hidden_size, target_heads)
    if (heads, head_dim) != (target_heads, tc.hidden_size // target_heads):
        log.warning(
            "draft attention: %d heads x head_dim %d (the target's %d heads give head_dim %s, which SGLang's "
            "attention kernels do not serve; served: %s)",
            heads, head_dim, target_heads, tc.hidden_size / target_heads, SERVED_HEAD_DIMS,
        )  # fmt: skip
    kv = model.num_key_value_heads or getattr(tc, "num_key_value_heads", None) or target_heads
    if heads % kv:
        kv = heads  # the target's kv grouping does not divide the served head count: no grouping
    return DraftConfig(
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, **_common(tc, model)
    )


def _common(tc, model) -> dict:
    rope = getattr(tc, "rope_parameters", None) or {}
    return dict(
        hidden_size=tc.hidden_size,
        intermediate_size=model.intermediate_size or tc.intermediate_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(tc, "rope_theta", None) or rope.get("rope_theta", 10000.0)),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
        vocab_size=tc.vocab_size,
        draft_vocab_size=model.draft_vocab_size,
        target_hidden_size=tc.hidden_size,
        rope_scaling=rope_scaling_of(tc),
    )


def _mla_draft_config(tc, model) -> DraftConfig:
    """The MLA draft: the target's heads (the MLA attention backend has no head-dim limit of the Llama
    draft's kinds) and MLA dims (mla_dims_for)."""
    heads = model.num_attention_heads or tc.num_attention_heads
    dims = mla_dims_for(tc, heads)
    return DraftConfig(
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
        draft_arch="mla",
        **dims,
        **_common(tc, model),
    )


def choose_attention(
    requested: str, dtype: torch.dtype, qk_head_dim: int, device: torch.device, packed: bool = False
) -> str:
    """The attention path for model.attention: "auto" is the first of AUTO_ORDER that runs here:
    FlashAttention-4 (its package installed, sm90+, bf16, qk head dim <= 128), cuDNN's fused attention
    (CUDA, bf16, <= 128), FlashAttention-2 (<= 256; all three flash_ttt.supported: the MLA draft's 192
    takes it), flex where its kernel fits, eager; `packed` (data.packing) skips cuDNN (PACKED_AUTO_ORDER).
    An explicit path that cannot run here is refused, naming what can."""
    ok = {
        "fa4": flash_ttt.supported(dtype, qk_head_dim, device, "fa4"),
        "cudnn": flash_ttt.supported(dtype, qk_head_dim, device, "cudnn"),
        "flash": flash_ttt.supported(dtype, qk_head_dim, device, "flash"),
        "flex": flexattn.available(device) and flexattn.fits(dtype, qk_head_dim),
        "eager": True,
    }
    if requested == "auto":
        return next(n for n in (PACKED_AUTO_ORDER if packed else AUTO_ORDER) if ok[n])
    if ok[requested]:
        if packed and requested == "cudnn":
            log.warning("attention cudnn with packed rows: cuDNN builds a graph for each new document length; "
                        "fa4 or flash (attention: auto) runs any length without one")  # fmt: skip
        return requested
    allowed = ", ".join(n for n, good in ok.items() if good)
    if requested == "fa4" and not fa4.installed():
        raise ValueError(
            "attention fa4: the flash-attn-4 package is not installed (pip install 'regen[fa4]'); "
            f"allowed here: {allowed}"
        )
    if requested in ("fa4", "flash", "cudnn"):
        gpu = "a Hopper or later GPU" if requested == "fa4" else "CUDA"
        raise ValueError(
            f"attention {requested}: needs {gpu}, bf16 parameters and a qk head dim <= "
            f"{flash_ttt.MAX_HEAD_DIM[requested]} (device {device}, {dtype}, head dim {qk_head_dim}); "
            f"allowed here: {allowed}"
        )
    if not flexattn.available(device):
        raise ValueError(
            f"attention flex: needs CUDA and torch>=2.5 (device {device}); allowed here: {allowed}"
        )
    raise ValueError(
        f"attention flex: fp32 parameters with qk head dim {qk_head_dim} exceed the flex kernel's shared "
        "memory; set bf16: true (the default) or attention: eager"
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
        torch.manual_seed(cfg.data.seed)  # seeds the CPU and every CUDA generator
        self.bf16 = ctx.device.type == "cuda" and cfg.optimisation.bf16
        # Built where it trains: at Kimi-K2.5 shapes the draft holds ~2.4B entries (1.2B of them the
        # embedding the target's replaces); initialised on the CPU that was ~30 s before the GPU did
        # anything (2 cores: 8 ns per entry of the embedding's normal init, 16 ns of a Linear's). fp32
        # init (the same weights whatever the dtype; on the CPU the same weights as before), then bf16
        # parameters where the GPU trains in bf16.
        with torch.device(ctx.device):
            draft = Eagle3Draft(dc)
        self.draft = draft.to(torch.bfloat16 if self.bf16 else torch.float32)
        with torch.no_grad():
            self.draft.embed_tokens.weight.copy_(
                embed_weight.to(ctx.device, self.draft.embed_tokens.weight.dtype)
            )
        self.draft.set_attention(
            choose_attention(
                cfg.model.attention,
                torch.bfloat16 if self.bf16 else torch.float32,
                dc.head_dim,
                ctx.device,
                packed=getattr(cfg.data, "packing", False),
            )
        )
        compiled.set_dynamic(getattr(cfg.model, "compile_dynamic", "lengths"))
        self.ttt = TTTModule(self.draft, cfg.optimisation.ttt_length, cfg.optimisation.ttt_decay)
        if ctx.distributed:  # every rank starts from rank 0's weights (DistributedDataParallel did this)
            with torch.no_grad():
                for p in self.draft.parameters():
                    if p.requires_grad:  # the frozen embedding is the target's on every rank
                        dist.broadcast(p, 0)
        self.masters = MasterWeights(list(self.draft.parameters()))
        self.fused_opt = ctx.device.type == "cuda"
        # CUDA: one Triton pass per parameter that also writes its bf16 copy (adamw.py; the update is
        # memory-bound, ~34 GB a step at Kimi-K2.5 draft shapes); torch's fused AdamW where it falls back
        self.opt = MasterAdamW(
            self.masters, lr=cfg.optimisation.lr, betas=tuple(cfg.optimisation.betas),
            weight_decay=cfg.optimisation.weight_decay, fused=self.fused_opt,
        )  # fmt: skip
        warmup = max(1, int(total_steps * cfg.optimisation.warmup_ratio))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, WarmupCosine(total_steps, warmup, cfg.optimisation.min_lr_ratio)
        )
        self.step = 0
        self._t0, self._tokens = time.perf_counter(), 0

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.draft.set_vocab(d2t, t2d)

    def target_probs(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The target's distribution over the draft vocabulary (softmax of its draft-row logits), in the
        parameters' dtype: what soft targets train on."""
        dtype = self.draft.lm_head.weight.dtype
        if self.ctx.device.type == "cuda":  # one kernel, fp32 inside (target_kernels.py)
            return softmax_to(draft_logits.to(self.ctx.device), dtype)
        return torch.softmax(draft_logits.to(self.ctx.device, torch.float32), -1).to(dtype)

    def train_batch(
        self,
        aux,
        input_ids,
        target_ids,
        loss_mask,
        weight: float = 1.0,
        draft_logits=None,
        tokens: int | None = None,
        docs=None,
    ) -> dict[str, torch.Tensor]:
        """One optimizer step. weight 0 keeps a rank with no data in lockstep without learning from it.
        draft_logits [B,T,N]: the target's logits over the draft vocabulary (soft targets); None = hard.
        tokens: the batch's real tokens (pads excluded) for the throughput figure; None = all of input_ids.
        docs: packed rows' packing.Documents (None: one sample per row)."""
        self.ttt.train()
        dev = self.ctx.device
        probs = None if draft_logits is None else self.target_probs(draft_logits)
        grads = self.masters.grads
        grads.begin()
        loss, metrics = self.ttt(
            aux.to(dev), input_ids.to(dev), target_ids.to(dev), loss_mask.to(dev), probs, docs
        )
        (loss * weight).backward()
        self.masters.to_masters()
        grads.all_reduce_mean(self.ctx.world)
        metrics["grad_norm"] = norm = grads.norm()
        self._clip(norm, self.cfg.optimisation.grad_clip)
        self.opt.step()  # the bf16 parameters too
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self._tokens += (int(input_ids.numel()) if tokens is None else tokens) if weight else 0
        metrics["loss"] = loss.detach()
        return metrics

    def set_total_steps(self, total_steps: int) -> None:
        """The schedule's length re-estimated (packed rows: a step holds several samples, known once the
        first shard is packed), warmup kept at its ratio; the current rate follows. Checkpoints keep it
        (LambdaLR saves its schedule object's fields)."""
        sched = self.sched.lr_lambdas[0]
        sched.total = max(1, int(total_steps))
        sched.warmup = max(1, int(sched.total * self.cfg.optimisation.warmup_ratio))
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs, strict=True):
            group["lr"] = base * sched(self.sched.last_epoch)
        self.sched._last_lr = [g["lr"] for g in self.opt.param_groups]

    def _clip(self, norm: torch.Tensor, max_norm: float) -> None:
        """clip_grad_norm_'s rule (scale by max_norm / (norm + 1e-6) when below 1) on the flat buffer. The
        fused AdamW divides each gradient by its `grad_scale` as it reads it (the unscale meant for AMP's
        loss scaling), so on CUDA the clip costs no pass over the gradients."""
        if self.fused_opt:
            self.opt.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        else:
            self.masters.grads.flat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))

    def log_record(self, metrics: dict[str, torch.Tensor]) -> dict:
        """Metrics averaged over ranks (collective: every rank calls it), with throughput since last call
        (real tokens) and this process's torch.compile totals so far (lengths.compile_counts: counters only)."""
        keys = sorted(k for k in metrics if not k.startswith("tokens_"))
        vec = all_reduce_mean(torch.stack([metrics[k].float().to(self.ctx.device) for k in keys]), self.ctx)
        now = time.perf_counter()
        rec = {k: round(float(v), 5) for k, v in zip(keys, vec.tolist(), strict=True)}
        rec.update(
            step=self.step,
            lr=self.sched.get_last_lr()[0],
            tok_s_rank=round(self._tokens / max(1e-9, now - self._t0), 1),
        )
        cc = compile_counts()
        rec.update(compiles=cc.graphs, compile_s=round(cc.seconds, 1))
        self._t0, self._tokens = now, 0
        return rec

    def state(self) -> dict:
        return {
            "draft_state_dict": self.draft.draft_state_dict(),
            "draft_config": self.dc.to_dict(),
            "optimizer": self.opt.state_dict(),
            "master_weights": self.masters.state(),
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
        self.masters.load(ckpt.get("master_weights"))
        self.sched.load_state_dict(ckpt["scheduler"])
        self.step = int(ckpt["step"])
