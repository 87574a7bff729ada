"""SpecForge's EAGLE-3 trainer on the same examples and target, for the quality benchmark.

Runs SpecForge's own code from a checkout (`specforge/` at `root`, laid out as
../shared/bench-peers/assemble.sh does): `LlamaForCausalLMEagle3` (its draft), `OnlineEagle3Model`
(its training-time test and loss), `Eagle3TrainStrategy` with a frozen `TargetHead` over the target's
final hidden state (its offline "hidden_state" path: the head and the draft-vocabulary softmax are
SpecForge's), and `BF16Optimizer` (bf16 params, fp32 masters, its warmup+cosine schedule, clip 0.5).
What it shares with regen's run, so only the trainer differs: the target and its aux layers, the
examples and their batch order (offline.batches), the draft vocabulary (d2t/t2d), the draft's shapes,
lr, warmup ratio and step count. The trained weights come back as a regen `Eagle3Draft` (SpecForge's
state-dict names are SGLang's, which regen's model uses) so both drafts are scored by the same code.
A missing checkout is a ConfigError naming what was looked for.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from regen_service.errors import ConfigError
from regen_service.train.model import DraftConfig, Eagle3Draft
from regen_service.train.offline import batches, pad_batch


def check_checkout(root: str | Path) -> Path:
    root = Path(root)
    if not (root / "specforge" / "modeling" / "draft" / "llama3_eagle.py").is_file():
        raise ConfigError(
            f"SpecForge checkout not found: {root}/specforge/modeling/draft/llama3_eagle.py is missing; lay it "
            "out with ../shared/bench-peers/assemble.sh (git archive of sgl-project/SpecForge) or pass --specforge"
        )
    return root


@torch.no_grad()
def target_states(target, ids, mask):
    """(aux [B,T,3H], final hidden after the norm [B,T,H]) from an HFTarget."""
    out = target.model.get_decoder()(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                     output_hidden_states=True, use_cache=False)  # fmt: skip
    aux = torch.cat([out.hidden_states[i] for i in target.aux_layer_ids], -1)
    return aux, out.last_hidden_state


def train_specforge(
    root,
    target,
    dc: DraftConfig,
    vocab,
    examples,
    cfg,
    steps: int,
    device,
    backend: str = "sdpa",
    pad_to: int = 128,
) -> tuple[Eagle3Draft, dict]:
    sys.path.insert(0, str(check_checkout(root)))
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    d2t, t2d = vocab
    lc = LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"], hidden_act="silu", hidden_size=dc.hidden_size,
        intermediate_size=dc.intermediate_size, num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads, head_dim=dc.head_dim, num_hidden_layers=1,
        max_position_embeddings=dc.max_position_embeddings, rms_norm_eps=dc.rms_norm_eps,
        rope_theta=dc.rope_theta, tie_word_embeddings=False, vocab_size=dc.vocab_size,
        draft_vocab_size=dc.draft_vocab_size, pad_token_id=0, model_type="llama",
    )  # fmt: skip
    torch.manual_seed(cfg.data.seed)
    with torch.device(device):
        draft = LlamaForCausalLMEagle3(lc, attention_backend=backend)
    draft.t2d.copy_(t2d)
    draft.d2t.copy_(d2t)
    draft.embed_tokens.weight.data.copy_(target.embed_weight.to(draft.embed_tokens.weight.device))
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=torch.bfloat16)
    model = OnlineEagle3Model(draft, length=cfg.optimisation.ttt_length, attention_backend=backend)
    model.train()
    th = TargetHead.__new__(TargetHead)  # its forward/preprocess over the target's own lm_head
    nn.Module.__init__(th)
    head = target.model.get_output_embeddings().weight
    th.fc = nn.Linear(head.shape[1], head.shape[0], bias=False, device=device, dtype=torch.bfloat16)
    th.fc.weight.data.copy_(head)
    th.freeze_weights()
    th.eval()
    strat = Eagle3TrainStrategy(model, target_head=th, ploss_decay=cfg.optimisation.ttt_decay)
    opt = BF16Optimizer(
        model,
        lr=cfg.optimisation.lr,
        max_grad_norm=cfg.optimisation.grad_clip,
        total_steps=steps,
        warmup_ratio=cfg.optimisation.warmup_ratio,
    )
    t0 = time.perf_counter()
    n = 0
    for chunk in batches(examples, cfg.data.batch_size, steps, cfg.data.seed):
        b = pad_batch(chunk, pad_to)
        aux, last = target_states(target, b["input_ids"], b["attention_mask"])
        tensors = {
            "input_ids": b["input_ids"].to(device), "attention_mask": b["attention_mask"].to(device),
            "loss_mask": b["loss_mask"].to(device), "hidden_state": aux.to(torch.bfloat16),
            "target": last.to(torch.bfloat16),
        }  # fmt: skip
        batch = TrainBatch(sample_ids=[str(i) for i in range(len(chunk))], strategy="eagle3", tensors=tensors,
                           metadata={"target_repr": "hidden_state"})  # fmt: skip
        out = strat.forward_loss(batch)
        out.loss.backward()
        opt.step()
        n += 1
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    summary = {"steps": n, "train_s": round(time.perf_counter() - t0, 1), "attention_backend": backend,
               "loss": round(float(out.loss), 4)}  # fmt: skip
    sd = {
        k.replace("draft_model.", ""): v
        for k, v in model.state_dict().items()
        if k.startswith("draft_model.")
    }
    mine = Eagle3Draft(dc).to(device, torch.bfloat16)
    missing, unexpected = mine.load_state_dict(sd, strict=False)
    unexpected = [k for k in unexpected if "rotary" not in k]  # SpecForge keeps its rotary tables as buffers
    if unexpected or set(missing) - {"embed_tokens.weight"}:
        raise ConfigError(
            f"SpecForge draft does not map onto regen's: missing {missing}, unexpected {unexpected}"
        )
    mine.set_vocab(d2t, t2d)
    with torch.no_grad():
        mine.embed_tokens.weight.copy_(target.embed_weight)
    return mine, summary
