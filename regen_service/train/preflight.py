"""Check a train config against the target's config.json before anything heavy is loaded.

A draft vocabulary larger than the target's, aux layers outside the target, or sequences longer than the
target's positions would otherwise fail only after the weights are loaded (minutes for a large target).
This reads config.json alone (the text model's part of a multimodal config) and raises one ConfigError
naming every problem and the field to change. Loading the target is train.target's job.
"""

from __future__ import annotations

import json
from pathlib import Path

from regen_service.draft.aux_layers import checked_aux_layer_ids
from regen_service.errors import ConfigError
from regen_service.train.config import TrainConfig


def target_text_config(target_path: str | Path) -> dict:
    path = Path(target_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"--target {target_path}: no config.json (a local Hugging Face model directory is needed; "
            "`regen make-tiny-target DIR` builds a tiny one for dry runs)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--target {target_path}: cannot read config.json ({e})") from None
    return config.get("text_config") or config


def check_train_config(cfg: TrainConfig, target_path: str | Path) -> dict:
    """Every mismatch between `cfg` and the target's config, at once; returns the text config."""
    tc = target_text_config(target_path)
    problems = []
    vocab = tc.get("vocab_size")
    if vocab is not None and cfg.model.draft_vocab_size > vocab:
        problems.append(f"draft_vocab_size {cfg.model.draft_vocab_size} is larger than the target's vocabulary "
                        f"({vocab}); set draft_vocab_size <= {vocab}")  # fmt: skip
    num_layers = tc.get("num_hidden_layers")
    if num_layers is not None:
        try:
            checked_aux_layer_ids(cfg.target_states.aux_layer_ids, num_layers)
        except ConfigError as e:
            problems.append(str(e))
    max_pos = tc.get("max_position_embeddings")
    if max_pos is not None and cfg.data.max_length > max_pos:
        problems.append(f"max_length {cfg.data.max_length} is longer than the target's max_position_embeddings "
                        f"({max_pos}); set max_length <= {max_pos}")  # fmt: skip
    heads = cfg.model.num_attention_heads or tc.get("num_attention_heads")
    kv_heads = cfg.model.num_key_value_heads or tc.get("num_key_value_heads") or heads
    hidden = tc.get("hidden_size")
    if heads and hidden and hidden % heads:
        problems.append(f"num_attention_heads {heads} does not divide the target's hidden_size {hidden}")
    if heads and kv_heads and heads % kv_heads:
        problems.append(f"num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    if problems:
        raise ConfigError(f"train config does not fit the target {target_path}: " + "; ".join(problems))
    return tc
