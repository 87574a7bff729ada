"""Build vLLM's launch command for the target: plain, with an EAGLE-3 draft, or capturing hidden states.

`build_vllm_launch(VllmLaunchSpec)` returns the argv (and the environment the engine needs) for
`python -m vllm.entrypoints.openai.api_server` (the module form: the `vllm` console script of the CPU
build looks itself up under another package name and fails). Three modes:
- plain: regeneration traffic (`regen worker --endpoint`);
- `draft`: EAGLE-3 speculative decoding, after validate-draft passed for vLLM's conventions (aux ids as
  layer inputs, no d2t when the draft vocabulary is the target's); `method` is always `eagle3`;
- `hidden_states_dir`: the trainer's target backend (train/engine_target.py): vLLM 0.32's
  `extract_hidden_states` method capturing the inputs of the aux layers plus the last layer's output,
  written per request by regen's connector (train/vllm_connector.py, found through PYTHONPATH).
Running vLLM is the operator's (or a test's) business; the CLI (`regen launch-vllm`) prints or execs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

import regen_service
from regen_service.deploy.launch import DraftPreflightError, Launch
from regen_service.draft import sglang_format as fmt
from regen_service.draft.validate import validate_draft
from regen_service.errors import ConfigError

CONNECTOR = "RegenHiddenStatesConnector"
CONNECTOR_MODULE = "regen_service.train.vllm_connector"


class VllmLaunchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str
    served_model_name: str | None = None
    draft: str | None = None
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    hidden_states_dir: str | None = None
    aux_layer_ids: list[int] | None = None  # captured layer inputs (hidden-state mode); None = default
    tp: int = Field(default=1, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_model_len: int | None = Field(default=None, ge=16)
    dtype: str = "auto"
    python: str = Field(default_factory=lambda: sys.executable)
    # per GPU; None = read from the first visible GPU when there is one (no check on CPU-only hosts)
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    api_key: SecretStr | None = None
    extra: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_mode(self) -> VllmLaunchSpec:
        if self.draft and self.hidden_states_dir:
            raise ValueError("--draft and --hidden-states are separate servers: pass one of them")
        return self


def _target_info(target: Path) -> fmt.TargetInfo:
    cfg = target / fmt.CONFIG_FILE if target.is_dir() else target
    if not cfg.is_file():
        raise ConfigError(
            f"{cfg} not found: --target must be the local model directory (holding config.json), so the "
            "draft and the captured layers can be checked against it"
        )
    return fmt.load_target_info(cfg)


def hidden_state_layers(target: fmt.TargetInfo, aux_layer_ids: list[int] | None) -> list[int]:
    """What the engine captures for the trainer: the aux layer inputs, then the last layer's output."""
    from regen_service.draft.aux_layers import checked_aux_layer_ids

    return [*checked_aux_layer_ids(aux_layer_ids, target.num_layers), target.num_layers]


def weights_bytes(target: Path) -> int:
    return sum(f.stat().st_size for f in target.glob("*.safetensors")) if target.is_dir() else 0


def _gpu_memory_gib() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def check_fits(spec: VllmLaunchSpec) -> None:
    """Refuse a target whose weights alone overflow the GPUs it would be split over (vLLM would load for
    minutes, then die out of memory), naming the tensor-parallel size that holds it."""
    gib = spec.gpu_memory_gib or _gpu_memory_gib()
    need = weights_bytes(Path(spec.target)) / 2**30
    if not gib or not need:
        return
    usable = gib * spec.gpu_memory_utilization
    if need / spec.tp > 0.9 * usable:  # the rest is the KV cache's, and the captured states'
        least = -(-need // (0.9 * usable))
        raise ConfigError(
            f"{spec.target}: {need:.0f} GiB of weights over --tp {spec.tp} is {need / spec.tp:.0f} GiB per GPU, "
            f"more than fits in {usable:.0f} GiB ({gib:.0f} GiB x gpu_memory_utilization "
            f"{spec.gpu_memory_utilization}) with room for the cache: use --tp {int(least)} or more (with "
            "expert parallelism for a MoE), or GPUs with more memory"
        )


def build_vllm_launch(spec: VllmLaunchSpec) -> Launch:
    """The argv for vLLM's OpenAI server; raises ConfigError (DraftPreflightError) when a check fails."""
    target = Path(spec.target)
    check_fits(spec)
    argv = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.target]
    argv += ["--served-model-name", spec.served_model_name or target.name]
    argv += ["--host", spec.host, "--port", str(spec.port), "--tensor-parallel-size", str(spec.tp)]
    argv += ["--dtype", spec.dtype, "--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.max_model_len:
        argv += ["--max-model-len", str(spec.max_model_len)]
    env: dict[str, str] = {}
    report = None
    if spec.draft:
        report = validate_draft(spec.draft, _target_info(target), "vllm")
        if not report.ok:
            raise DraftPreflightError(f"draft {spec.draft} failed validation for vLLM; not launching", report)
        config = {
            "method": "eagle3",
            "model": spec.draft,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
        argv += ["--speculative-config", json.dumps(config)]
    if spec.hidden_states_dir:
        layers = hidden_state_layers(_target_info(target), spec.aux_layer_ids)
        config = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        }
        transfer = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(Path(spec.hidden_states_dir).resolve())},
        }
        argv += ["--speculative-config", json.dumps(config), "--kv-transfer-config", json.dumps(transfer)]
        # The engine imports the connector from regen's source tree (or from regen installed beside it).
        env["PYTHONPATH"] = str(Path(regen_service.__file__).resolve().parent.parent)
    if spec.api_key:
        argv += ["--api-key", spec.api_key.get_secret_value()]
    argv += spec.extra
    return Launch(argv=argv, report=report, env=env)
