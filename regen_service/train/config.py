"""The one training configuration (`train.yaml`): typed, strict, nested by concern, stored in every checkpoint.

Seven sections, one model each: `data` (sequences, batches, samples, the draft vocabulary's counting,
the stream), `model` (the draft's architecture and attention), `target_states` (where the target's
hidden states come from), `optimisation` (objective, training-time test, optimizer, schedule,
precision), `checkpoints`, `evaluation` (the held-out split) and `tracking` (log lines, trackers). A
field keeps its name inside its section, so the flat train.yaml of earlier releases loads unchanged:
a top-level key that names a section's field is moved into that section (`max_length: 4096` is
`data: {max_length: 4096}`); the same key given both ways is refused, naming both. Unknown keys are
errors (extra="forbid") so a misspelt field never silently trains with a default. Checkpoints record
the flat form (`flat_dict`), the one every earlier checkpoint holds. Draft shapes default to the
target's (hidden size, heads, intermediate size); set them here to override. What the fields mean is
in docs/training.md.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from regen_service.errors import ConfigError
from schemas.yamlfile import YamlRefused, load_yaml


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Section):
    # tokens per sequence (longer ones are cut): Kimi-K2.5's thinking answers run long; docs/training.md
    # gives the peak memory per length at Kimi shapes
    max_length: int = Field(default=8192, ge=8)
    batch_size: int = Field(default=1, ge=1)  # sequences per rank per step
    # on a GPU, before the first step: a max_length x batch_size whose step would not fit in memory is
    # refused with the largest length that fits (memory.py), instead of running out of memory mid-run
    fit_check: bool = True
    # the length a batch is padded to (lengths.py), so compiled kernels and flex block masks meet a
    # bounded set of shapes over answers of 200 to 16K tokens: "geometric" rounds the batch's longest
    # sequence up to a multiple of max(128, 2**(floor(log2 T) - 2)) (blocks to 1024, then four buckets
    # per octave: under 25% padding from 512 tokens on, 24 shapes up to 16K); "block" to a multiple of
    # 128 (flex attention's block); "off": the longest sequence itself. Never past max_length; pads sit
    # after the tokens, count in no loss and never reach the target
    length_bucket: Literal["off", "block", "geometric"] = "geometric"
    # packing (packing.py): each batch is batch_size rows of max_length tokens, filled with whole samples
    # that attend only to themselves (positions restart, no loss across a sample's end): one shape, almost
    # no padding; length_bucket then applies to nothing but the held-out evaluation. Off: one sample a row
    packing: bool = False
    epochs: int = Field(default=1, ge=1)  # passes over each shard before it counts as consumed
    seed: int = 0
    # training samples of multi-turn rows: one per generation (the exact prompt the target saw plus
    # its answer), or one per conversation (right only for templates that keep all thinking); auto:
    # per generation when the target's template drops earlier thinking (Kimi-K2.5's does)
    samples: Literal["auto", "per_generation", "conversation"] = "auto"
    # draft vocabulary: built from the first `vocab_shards` shards, or fewer once `vocab_tokens`
    # loss-masked tokens were counted (0 = no token limit); then frozen
    vocab_shards: int = Field(default=1, ge=1)
    vocab_tokens: int = Field(default=0, ge=0)
    # stream: how long another consumer's pending shard must sit idle before we take it over
    claim_idle_s: float = Field(default=600.0, gt=0)
    poll_s: float = Field(default=2.0, gt=0)


class ModelConfig(_Section):
    # draft architecture: "llama" (LlamaForCausalLMEagle3, GQA attention) or "mla" (Eagle3DeepseekV2ForCausalLM:
    # DeepSeek-V2 multi-latent attention with the target's MLA dims, what SGLang serves for Kimi-K2.5; its KV
    # cache is 576 values per token against 2048). docs/draft-checkpoints.md says what we found.
    draft_arch: Literal["llama", "mla"] = "llama"
    draft_vocab_size: int = Field(default=32000, ge=1)
    # draft shapes; None = the target's
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # draft attention in training (layers.py, flash_ttt.py): "fa4" (FlashAttention-4, the optional
    # flash-attn-4 package, Hopper and later), "cudnn", "flash" (FlashAttention-2), "flex" (block-sparse),
    # "eager" (the reference, the CPU's); "auto" = the first of those that runs here (trainer.AUTO_ORDER)
    attention: Literal["auto", "fa4", "cudnn", "flash", "flex", "eager"] = "auto"
    # how the draft's hot functions compile on CUDA (compiled.py): "lengths" = the sequence dimension
    # symbolic from the first call (one compile per function whatever the lengths); "auto" = torch's
    # default (exact shapes first, a second compile at the first new length)
    compile_dynamic: Literal["lengths", "auto"] = "lengths"


class TargetStatesConfig(_Section):
    # let the target folder's own Python code run (auto_map: Kimi-K2.5's tokenizer and model);
    # a folder that needs it without this is a ConfigError before training starts
    trust_remote_code: bool = False
    # target: layer INPUT indices to capture; None = [2, L//2, L-3] (three distinct layers if those collide)
    aux_layer_ids: list[int] | None = None
    # where target states come from: a local Hugging Face copy ("hf", small targets), or a vLLM engine that
    # holds the target with tensor/expert parallelism ("vllm": `regen launch-vllm --hidden-states DIR`)
    target_backend: Literal["hf", "vllm"] = "hf"
    target_endpoint: str | None = None  # the vLLM server's base URL (target_backend vllm)
    # the folder that engine writes states files to (its `--hidden-states DIR`): the trainer reads and
    # deletes files only inside it, whatever path the engine's reply names
    target_states_dir: str | None = None
    target_num_parallel_requests: int = Field(default=8, ge=1)  # sequences in flight to the engine
    target_request_timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _endpoint_for_engine(self) -> TargetStatesConfig:
        if self.target_backend == "vllm" and not self.target_endpoint:
            raise ValueError(
                "target_backend vllm needs target_endpoint (the vLLM server's URL, e.g. http://127.0.0.1:8000; "
                "start it with `regen launch-vllm --target PATH --hidden-states DIR`)"
            )
        if self.target_backend == "vllm" and not self.target_states_dir:
            raise ValueError(
                "target_backend vllm needs target_states_dir (the folder given to `regen launch-vllm "
                "--hidden-states DIR`; the trainer reads states files only inside it)"
            )
        return self


class OptimisationConfig(_Section):
    # what the draft learns at each position: the target's distribution over the draft vocabulary ("soft",
    # the EAGLE-3 objective) or its argmax ("hard")
    target: Literal["soft", "hard"] = "soft"
    # training-time test
    ttt_length: int = Field(default=7, ge=1)
    ttt_decay: float = Field(default=0.8, gt=0, le=1)
    # optimizer and schedule
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    # cosine length; None = estimated from the run's prompt count, epochs, batch size and ranks
    total_steps: int | None = Field(default=None, ge=1)
    grad_clip: float = Field(default=0.5, gt=0)
    bf16: bool = True  # bf16 parameters + fp32 master weights on GPU; the CPU always runs fp32


class CheckpointsConfig(_Section):
    # after every N consumed shards, and every N steps inside a shard (0 = off)
    checkpoint_every_shards: int = Field(default=1, ge=1)
    checkpoint_every_steps: int = Field(default=0, ge=0)
    keep_checkpoints: int = Field(default=3, ge=1)


class EvaluationConfig(_Section):
    # held-out evaluation (evaluate.py, docs/training.md): prompts whose id schemas.heldout holds out
    # are never trained on; up to eval_max_samples of their samples (cut at eval_max_length) are scored
    # every eval_every_steps (0 = only at the end) and at the end; the best checkpoint is the one with
    # the highest accept length at eval_accept_k draft tokens (capped at ttt_length; 3 = SGLang's 3/1/4)
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)  # 0 = no held-out split, no eval
    eval_seed: int = 0
    eval_every_steps: int = Field(default=500, ge=0)
    eval_max_samples: int = Field(default=256, ge=1)
    eval_max_length: int = Field(default=2048, ge=8)
    eval_accept_k: int = Field(default=3, ge=1)


class TrackingConfig(_Section):
    log_every_steps: int = Field(default=10, ge=1)
    # trackers for train and eval scalars: TensorBoard event files in OUT/tb by default; wandb and
    # mlflow are optional extras (regen[wandb], regen[mlflow]); "none" alone turns tracking off
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        default_factory=lambda: ["tensorboard"]
    )


class TrainConfig(_Section):
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    target_states: TargetStatesConfig = Field(default_factory=TargetStatesConfig)
    optimisation: OptimisationConfig = Field(default_factory=OptimisationConfig)
    checkpoints: CheckpointsConfig = Field(default_factory=CheckpointsConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data: Any) -> Any:
        return nest(data)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> TrainConfig:
        """BaseModel.model_copy, with a flat field name in `update` copied into its section: pydantic
        would set it as a stray attribute beside the section and the field would keep its old value."""
        if update:
            sections = {}
            for key, value in nest(dict(update)).items():
                if key in SECTIONS and isinstance(value, dict):
                    value = getattr(self, key).model_copy(update=value, deep=deep)
                sections[key] = value
            update = sections
        return super().model_copy(update=update, deep=deep)

    def flat_dict(self) -> dict:
        """Every field under its own name, sections dropped: what checkpoints record (and train.yaml
        of earlier releases held); TrainConfig.model_validate reads it back."""
        return {k: v for section in self.model_dump(mode="json").values() for k, v in section.items()}

    @classmethod
    def load(cls, path: str | Path | None, **overrides) -> TrainConfig:
        """train.yaml (nested, or the flat keys of earlier releases), then `overrides` (flat field
        names, None = not given) on top."""
        data: dict = {}
        if path:
            try:
                # no aliases, bounded depth (schemas/yamlfile.py): an alias bomb is refused at its first alias
                data = load_yaml(Path(path).read_text(encoding="utf-8"), what="train.yaml") or {}
            except OSError as e:
                raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
            except (YamlRefused, UnicodeDecodeError) as e:
                raise ConfigError(f"--config {path}: {e}") from None
            if not isinstance(data, dict):
                raise ConfigError(
                    f"--config {path}: expected a mapping of TrainConfig fields (docs/training.md)"
                )
        try:
            data = nest(data)
            for key, value in overrides.items():
                if value is not None:
                    section = data.setdefault(SECTION_OF[key], {})
                    if isinstance(section, dict):
                        section[key] = value
            return cls(**data)
        except (ValidationError, ValueError) as e:
            problems = _problems(e) if isinstance(e, ValidationError) else str(e)
            raise ConfigError(f"train config {path or ''}: {problems}") from None


SECTIONS: dict[str, type[_Section]] = {
    name: info.annotation
    for name, info in TrainConfig.model_fields.items()
    if isinstance(info.annotation, type)
}
# field name -> its section, read off the section models (a flat key of earlier releases finds its place)
SECTION_OF: dict[str, str] = {key: name for name, model in SECTIONS.items() for key in model.model_fields}


def nest(data: Any) -> Any:
    """A train.yaml mapping with its flat keys moved into their sections; anything else as it came."""
    if not isinstance(data, dict):
        return data
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k in SECTIONS}
    for key, value in data.items():
        if key in SECTIONS:
            continue
        section = SECTION_OF.get(key)
        if section is None or not isinstance(out.get(section, {}), dict):
            out[key] = value  # unknown, or beside a malformed section: the model's error names it
            continue
        target = out.setdefault(section, {})
        if key in target:
            raise ValueError(
                f"{key} is given twice, at the top level and under {section}: keep {section}.{key}"
            )
        target[key] = value
    return out


def _problems(err: ValidationError) -> str:
    """One line per field, each input shown cut short: pydantic's own text repeats whole inputs."""
    out = []
    for e in err.errors(include_url=False):
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        got = "" if e["type"] == "missing" or not e["loc"] else f" (got {reprlib.repr(e.get('input'))})"
        out.append(f"{where}: {e['msg'].removeprefix('Value error, ')}{got}")
    return "; ".join(out)
