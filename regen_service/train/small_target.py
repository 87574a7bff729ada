"""A small real target, trained from scratch: a Llama-architecture code LM on the machine's own Python.

The corpus is the Python source (code, comments, docstrings) of the installed packages and the
standard library; `held_out` packages are never trained on (the benchmark's prompts come from them,
code_prompts.py). Recipe, deterministic for a given tree and seed: a byte-level BPE tokenizer trained
on a sample of the training files (`tokenizers`), with ChatML turns (`<|im_start|>role ... <|im_end|>`)
as its chat template; documents are whole files plus chat-rendered prompt/answer pairs cut from the
training packages (so the target answers in the chat format it will be served with), packed into
fixed windows, shuffled with the seed; AdamW with warmup and cosine decay, bf16 autocast, fp32 weights.
It reports held-out perplexity and mean next-token entropy (nats, full vocabulary) on the held-out
packages' files, and refuses (ConfigError) a corpus too small for the steps asked or a model whose
held-out perplexity stays above `max_perplexity`. The weights are written to `out`, never committed.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from regen_service.errors import ConfigError
from regen_service.train import code_prompts as CP

log = logging.getLogger(__name__)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class TargetRecipe:
    vocab_size: int = 16384
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1536
    seq_len: int = 512
    batch: int = 64
    steps: int = 2000
    lr: float = 1.5e-3
    warmup: int = 100
    seed: int = 0
    chat_share: float = 0.25  # share of documents that are chat-rendered prompt/answer pairs
    tokenizer_sample_bytes: int = 40_000_000
    corpus_bytes: int = 300_000_000  # training text read at most (files in seeded order)
    max_perplexity: float = 20.0  # held-out bound (other packages than trained on): above it, not converged
    eval_tokens: int = 400_000


def corpus_files(
    roots: list[Path], held_out: set[str]
) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(training files, held-out files) as (package, path): each top-level entry of each root is a package."""
    train, held = [], []
    for root in roots:
        for entry in sorted(Path(root).iterdir()):
            name = entry.name.removesuffix(".py")
            if name in ("site-packages", "dist-packages", "__pycache__", "test", "tests", "idlelib"):
                continue
            if name.endswith((".dist-info", ".egg-info", ".data")):
                continue
            files = CP.python_files(entry) if entry.is_dir() else ([entry] if entry.suffix == ".py" else [])
            (held if name in held_out else train).extend((name, f) for f in files)
    return train, held


def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ChatML specials, wrapped as a transformers fast tokenizer with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>", unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def chat_text(prompt: str, response: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>\n"


def token_stream(tok, docs: list[str]) -> np.ndarray:
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    out = []
    for i in range(0, len(docs), 2048):
        for enc in tok.backend_tokenizer.encode_batch(docs[i : i + 2048], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int32))
            out.append(np.asarray([eot], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def llama_config(r: TargetRecipe, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok), hidden_size=r.hidden, intermediate_size=r.intermediate,
        num_hidden_layers=r.layers, num_attention_heads=r.heads, num_key_value_heads=r.kv_heads,
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip


@torch.no_grad()
def heldout_stats(model, windows: torch.Tensor, device, batch: int = 32) -> dict:
    """Mean cross-entropy (-> perplexity) and mean next-token entropy, nats, over every position."""
    model.eval()
    ce = ent = n = 0.0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch].to(device).long()
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, -1)
        ce += float(-logp.gather(-1, x[:, 1:, None]).sum())
        ent += float(-(logp.exp() * logp).sum())
        n += x[:, 1:].numel()
    model.train()
    return {"heldout_ce": ce / n, "heldout_perplexity": math.exp(ce / n), "heldout_entropy": ent / n,
            "heldout_tokens": int(n)}  # fmt: skip


def build_target(
    roots: list[Path], held_out: set[str], out: str | Path, r: TargetRecipe, device: str = "cuda"
) -> dict:
    """Train the target, save model + tokenizer to `out`; returns the report (figures, wall times)."""
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    dev = torch.device(device)
    train_files, held_files = corpus_files(roots, held_out)
    if not held_files:
        raise ConfigError(f"held-out packages {sorted(held_out)}: none found under {[str(x) for x in roots]}")
    rng = random.Random(r.seed)
    order = list(train_files)
    rng.shuffle(order)
    texts, size, used = [], 0, []
    for pkg, p in order:
        if size >= r.corpus_bytes:
            break
        if t := CP.read_text(p):
            texts.append(t)
            used.append((pkg, p))
            size += len(t)
    sample, size = [], 0
    for t in texts:
        if size >= r.tokenizer_sample_bytes:
            break
        sample.append(t)
        size += len(t)
    tok = build_tokenizer(sample, r.vocab_size)
    t_tok = time.perf_counter()
    want = int(len(texts) * r.chat_share / (1 - r.chat_share))
    chats = []
    for pkg, p in used:  # chat documents from the same training files, parsed until there are enough
        if len(chats) >= want:
            break
        chats += [chat_text(q["prompt"], q["response"]) for q in CP.pairs_from_files([(pkg, p)])]
    n_chat = min(len(chats), want)
    docs = texts + chats[:n_chat]
    rng.shuffle(docs)
    stream = token_stream(tok, docs)
    need = r.steps * r.batch * (r.seq_len + 1)
    windows = len(stream) // (r.seq_len + 1)
    if windows < r.batch * 4 or need > 8 * len(stream):
        raise ConfigError(
            f"corpus too small: {len(stream):,} training tokens from {len(train_files)} files, but {r.steps} "
            f"steps x {r.batch} x {r.seq_len} need {need:,} (more than 8 epochs); add package roots or "
            "lower --steps/--batch"
        )
    data = torch.from_numpy(stream[: windows * (r.seq_len + 1)].reshape(windows, r.seq_len + 1).copy())
    held_text = [t for _, p in held_files if (t := CP.read_text(p))]
    held_stream = token_stream(tok, held_text[:: max(1, len(held_text) // 400)])[: r.eval_tokens]
    hw = len(held_stream) // (r.seq_len + 1)
    if hw < 4:
        raise ConfigError(
            f"held-out packages {sorted(held_out)}: only {len(held_stream)} tokens to evaluate on"
        )
    held = torch.from_numpy(held_stream[: hw * (r.seq_len + 1)].reshape(hw, r.seq_len + 1).copy())
    t_data = time.perf_counter()

    torch.manual_seed(r.seed)
    model = LlamaForCausalLM(llama_config(r, tok)).to(dev)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(
        model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )

    def lr_at(s):
        if s < r.warmup:
            return (s + 1) / r.warmup
        return 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * min(1.0, (s - r.warmup) / max(1, r.steps - r.warmup)))
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(r.seed))
    model.train()
    losses = []
    t_train = time.perf_counter()
    for s in range(r.steps):
        idx = order[(torch.arange(r.batch) + s * r.batch) % windows]
        x = data[idx].to(dev, non_blocking=True).long()
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if s % 100 == 0 or s == r.steps - 1:
            losses.append((s, round(float(loss.detach()), 4)))
            log.info("target step %d loss %.4f", s, float(loss.detach()))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t_train
    stats = heldout_stats(model, held, dev)
    out = Path(out)
    model.to(torch.bfloat16 if dev.type == "cuda" else torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    report = {
        "recipe": asdict(r), "params": n_params, "params_m": round(n_params / 1e6, 1),
        "train_files": len(used), "train_bytes": sum(map(len, texts)), "heldout_files": len(held_files),
        "train_packages": len({p for p, _ in train_files}), "heldout_packages": sorted({p for p, _ in held_files}),
        "train_tokens": len(stream), "chat_docs": n_chat, "epochs": round(need / max(1, len(stream)), 3),
        "tokens_seen": r.steps * r.batch * r.seq_len, "train_s": round(train_s, 1),
        "tokens_per_s": round(r.steps * r.batch * r.seq_len / train_s), "tokenizer_s": round(t_tok - t0, 1),
        "data_s": round(t_data - t_tok, 1), "loss_curve": losses, **{k: round(v, 4) for k, v in stats.items()},
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    if not stats["heldout_perplexity"] <= r.max_perplexity:
        raise ConfigError(
            f"target did not converge: held-out perplexity {stats['heldout_perplexity']:.2f} > bound "
            f"{r.max_perplexity} after {r.steps} steps (raise --steps or --lr); report: {report}"
        )
    return report
