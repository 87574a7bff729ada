"""Tiny local targets and target-generated shards, for tests, the demo and dry runs of `regen train`.

`make_tiny_target` saves a small random-weight Llama with the demo tokenizer (no download);
`greedy_rows` makes OUTPUT_SCHEMA rows whose answers are that target's own greedy continuations
(token-exact, as with api generate), which is what regen produces at scale and what a draft can
learn even from a random target; `publish_run` writes such rows as output shards and announces them
through the ledger exactly as the pipeline does. Real data comes from the pipeline, not from here.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import torch

from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.storage import RunLayout, Storage
from schemas.records import RunManifest, ShardDoneEvent, ShardInfo
from schemas.tables import OUTPUT_SCHEMA

DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "demo" / "tokenizer"


def make_tiny_target(
    path: str | Path,
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    embed_scale: float = 1.0,
    logit_scale: float = 30.0,
) -> Path:
    """embed_scale > 1 makes the token's own embedding dominate the residual stream, so the random
    model's next token depends mostly on the current token and less on the context (a structured,
    learnable target; with 1.0 its greedy text is close to noise). logit_scale > 1 sharpens its
    next-token distribution: a random head spreads it near uniformly over the vocabulary (entropy
    ~ln V), where trained LLMs put most mass on a few tokens, which is what soft targets learn from.

    The default logit_scale 30 gives the tiny target a real LM's next-token entropy: measured on the CPU
    over random prompts of the demo vocabulary (V = 6000, ln V = 8.70 nats), 8.69 nats at logit_scale 1
    (flat), 7.40 at 10, 4.40 at 20, 2.35 at 30 (embed_scale 1, 10 or 30 alike); a 42M code LM trained on
    real Python reads 2.5 nats per token on held-out code and Llama 2 7B / Llama 3 8B about 2.2 / 2.1 nats
    per WikiText word (docs/quality.md). Scaling the head leaves every argmax, so greedy text, unchanged."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    random_scaled(LlamaForCausalLM, config, seed, embed_scale, logit_scale).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def random_scaled(model_cls, config, seed: int, embed_scale: float, logit_scale: float):
    """A random-weight model of `model_cls`, its embeddings and LM head scaled so that its next-token
    entropy is a real LM's (see make_tiny_target), the same for a given seed."""
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model


def _plain_pool(tok, pool: int) -> list[int]:
    """A fixed pool of `pool` plain token ids (no special or marker tokens), the same for every seed."""
    special = set(tok.all_special_ids)
    plain = [
        i for i in range(len(tok)) if i not in special and not tok.convert_ids_to_tokens(i).startswith("<|")
    ]
    return random.Random(0).sample(plain, min(pool, len(plain)))


def random_prompts(tok, n: int, words: int, seed: int, pool: int = 64) -> list[list[int]]:
    """Chat-templated prompts (token ids, all the same length) whose user text is `words` random plain
    tokens from a fixed pool of `pool` ids: the same pool for every seed, so held-out prompts share
    the training data's token space."""
    rng = random.Random(seed)
    plain = _plain_pool(tok, pool)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "\x00"}], tokenize=False, add_generation_prompt=True
    )
    head, tail = (tok.encode(part, add_special_tokens=False) for part in text.split("\x00"))
    return [head + [rng.choice(plain) for _ in range(words)] + tail for _ in range(n)]


def random_texts(tok, n: int, words: int, seed: int, pool: int = 64) -> list[str]:
    """The user texts of random_prompts as strings, for mixes that go through the real pipeline."""
    rng = random.Random(seed)
    plain = _plain_pool(tok, pool)
    return [tok.decode([rng.choice(plain) for _ in range(words)]) for _ in range(n)]


def greedy_rows(
    target_path: str | Path,
    run_id: str,
    n: int,
    new_tokens: int = 48,
    seed: int = 0,
    words: int = 12,
    pool: int = 64,
    temperature: float = 0.0,
) -> list[dict]:
    """n rows answered by the target's greedy decoding (one batch: the prompts share a length), or
    sampled at `temperature` > 0 (seeded by `seed`): answers off the greedy path, where soft and hard
    targets differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target_path, local_files_only=True).eval()
    prompts = random_prompts(tok, n, words, seed, pool)
    x = torch.tensor(prompts)
    sample = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
    )
    torch.manual_seed(seed)
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        pad_token_id=tok.pad_token_id, **({"do_sample": False} | sample),
    )  # fmt: skip
    rows = []
    for i, prompt in enumerate(prompts):
        gen = out[i, len(prompt) :].tolist()
        rows.append(
            {
                "run_id": run_id,
                "prompt_id": f"p{seed}-{i}",
                "source": "tiny",
                "row_index": i,
                "messages": [
                    {"role": "user", "content": tok.decode(prompt)},
                    {"role": "assistant", "content": tok.decode(gen)},
                ],
                "input_ids": prompt + gen,
                "loss_mask": [0] * len(prompt) + [1] * len(gen),
                "api": "generate",
                "completion_tokens": len(gen),
            }
        )
    return rows


def output_table(rows: list[dict]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in OUTPUT_SCHEMA}
    return pa.Table.from_pydict(cols, schema=OUTPUT_SCHEMA)


def register_run(settings: Settings, run_id: str, num_shards: int, rows_per_shard: int) -> Ledger:
    ledger = Ledger(settings)
    manifest = RunManifest(
        run_id=run_id, mix_name="tiny", created_at=time.time(), model="tiny", api="generate",
        sampling_hash="-", regen_key="-", num_prompts=num_shards * rows_per_shard, num_shards=num_shards,
        shards=[ShardInfo(shard_id=i, num_prompts=rows_per_shard, sources={"tiny": rows_per_shard}) for i in range(num_shards)],
        sources={},
    )  # fmt: skip
    ledger.register_run(manifest, settings.data_root_resolved)
    # The manifest on the data root too, as enqueue leaves it: `regen resume` rebuilds the run from it.
    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    layout.storage.write_json_atomic(layout.manifest_path, manifest.model_dump(mode="json"))
    return ledger


def publish_shard(settings: Settings, ledger: Ledger, run_id: str, shard_id: int, rows: list[dict]) -> str:
    """Write an output shard and append its shard_done event (and run_done after the last)."""
    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    path = layout.output_shard(shard_id)
    layout.storage.write_table_atomic(path, output_table(rows))
    ledger.mark_shard_done(ShardDoneEvent(run_id=run_id, shard_id=shard_id, path=path, num_rows=len(rows)))
    return path
