"""Build SGLang's launch command for the target, with a preflight that refuses a draft served wrong.

`build_launch(LaunchSpec)` returns the argv; with a draft it first validates the draft against the
target's config (validate.py) and forces `--speculative-algorithm EAGLE3` for an EAGLE-3 draft,
because under `EAGLE` the server feeds the draft only its final hidden state, skips `fc` and
accepts nothing (accept length 1.00) without an error. The CLI (`regen launch-sglang`) prints or
execs it; running SGLang itself is left to the GPU host.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from regen_service.draft import mla_format as mla
from regen_service.draft import sglang_format as fmt
from regen_service.draft.report import DraftReport
from regen_service.draft.validate import validate_draft
from regen_service.errors import ConfigError
from regen_service.work.client.auth import load_api_key

API_KEY_ENV = "REGEN_ENDPOINT_API_KEY"
API_KEY_FILE_ENV = "REGEN_ENDPOINT_API_KEY_FILE"
# Kimi-K2.5 (see shared/reference/sglang-api.md); operators add or override through --extra.
KIMI_FLAGS = ("--trust-remote-code", "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2")


class SpecParams(BaseModel):
    """The three numbers SGLang wants together (set all or none); defaults are the public Kimi drafts'."""

    model_config = ConfigDict(extra="forbid")

    num_steps: int = Field(default=3, ge=1, le=16)
    eagle_topk: int = Field(default=1, ge=1, le=16)
    num_draft_tokens: int = Field(default=4, ge=2)

    @model_validator(mode="after")
    def _consistent(self) -> SpecParams:
        if self.eagle_topk == 1 and self.num_draft_tokens != self.num_steps + 1:
            # SGLang would silently rewrite it; refuse so the printed command is what runs.
            raise ValueError(
                f"with --speculative-eagle-topk 1 SGLang uses num_draft_tokens = num_steps + 1 = "
                f"{self.num_steps + 1}, not {self.num_draft_tokens}: pass --spec-draft-tokens "
                f"{self.num_steps + 1} or raise --spec-topk"
            )
        # The draft tree offers topk candidates at the first step and topk*topk at each later one;
        # SGLang picks num_draft_tokens - 1 of them (plus the root).
        most = self.eagle_topk + (self.num_steps - 1) * self.eagle_topk**2 + 1
        if self.num_draft_tokens > most:
            raise ValueError(
                f"--spec-draft-tokens {self.num_draft_tokens} exceeds the {most} tokens a tree of "
                f"{self.num_steps} steps x topk {self.eagle_topk} can hold; lower it or raise steps/topk"
            )
        return self


class LaunchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str
    draft: str | None = None
    speculative_algorithm: str | None = None
    spec: SpecParams = Field(default_factory=SpecParams)
    tp: int = Field(default=8, ge=1)
    host: str = "0.0.0.0"
    port: int = Field(default=30000, ge=1, le=65535)
    api_key: SecretStr | None = None
    extra: list[str] = Field(default_factory=list)


class Launch(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    argv: list[str]
    report: DraftReport | None = None
    env: dict[str, str] = Field(default_factory=dict)  # what the server's environment needs on top

    def redacted(self) -> list[str]:
        out = list(self.argv)
        for i, a in enumerate(out[:-1]):
            if a == "--api-key":
                out[i + 1] = "***"
        return out

    def shell(self) -> str:
        prefix = [f"{k}={v}" for k, v in self.env.items()]
        return shlex.join([*(["env", *prefix] if prefix else []), *self.redacted()])


def api_key_from_env() -> SecretStr | None:
    """REGEN_ENDPOINT_API_KEY, else the file REGEN_ENDPOINT_API_KEY_FILE names; None when neither is set."""
    if os.environ.get(API_KEY_ENV):
        return load_api_key(env_var=API_KEY_ENV)
    if os.environ.get(API_KEY_FILE_ENV):
        return load_api_key(file=os.environ[API_KEY_FILE_ENV])
    return None


def draft_architecture(draft: Path) -> str | None:
    try:
        archs = json.loads((draft / fmt.CONFIG_FILE).read_text()).get("architectures") or [None]
    except (OSError, json.JSONDecodeError):
        return None
    return archs[0]


# Both EAGLE-3 draft architectures SGLang serves (Llama-style and MLA) need the aux-state capture.
EAGLE3_ARCHITECTURES = (fmt.ARCHITECTURE, mla.ARCHITECTURE)


def _eagle_refusal(draft: str, arch: str = fmt.ARCHITECTURE) -> str:
    return (
        f"refusing --speculative-algorithm EAGLE for {draft}: it is an EAGLE-3 draft ({arch}). "
        "Under EAGLE the target passes only its final hidden state to the draft, the fc shape check is "
        "skipped, the draft sees the wrong input and nothing is accepted (accept length 1.00), with no "
        "error. Use --speculative-algorithm EAGLE3 (the default here)"
    )


def build_launch(spec: LaunchSpec) -> Launch:
    """The argv for `python -m sglang.launch_server`; raises ConfigError when the preflight fails."""
    target = Path(spec.target)
    argv = ["python", "-m", "sglang.launch_server", "--model-path", spec.target, "--tp", str(spec.tp)]
    argv += ["--host", spec.host, "--port", str(spec.port), *KIMI_FLAGS, "--enable-metrics"]
    report = None
    if spec.draft:
        draft = Path(spec.draft)
        cfg = target / fmt.CONFIG_FILE if target.is_dir() else target
        if not cfg.is_file():
            raise ConfigError(
                f"cannot check the draft: {cfg} not found. --target must be the local model directory "
                "(holding config.json) so the draft can be validated against it"
            )
        report = validate_draft(draft, fmt.load_target_info(cfg))
        if not report.ok:
            raise DraftPreflightError(f"draft {draft} failed validation; not launching", report)
        arch = draft_architecture(draft)
        algo = (spec.speculative_algorithm or fmt.SPEC_ALGORITHM).upper()
        if arch in EAGLE3_ARCHITECTURES and algo != fmt.SPEC_ALGORITHM:
            raise ConfigError(
                _eagle_refusal(spec.draft, arch) if algo == "EAGLE" else f"{algo} cannot serve {arch}"
            )
        argv += ["--speculative-algorithm", algo, "--speculative-draft-model-path", spec.draft]
        argv += ["--speculative-num-steps", str(spec.spec.num_steps)]
        argv += ["--speculative-eagle-topk", str(spec.spec.eagle_topk)]
        argv += ["--speculative-num-draft-tokens", str(spec.spec.num_draft_tokens)]
    elif spec.speculative_algorithm:
        raise ConfigError("--speculative-algorithm needs --draft DIR (the draft model to serve)")
    if spec.api_key:
        argv += ["--api-key", spec.api_key.get_secret_value()]
    argv += spec.extra
    return Launch(argv=argv, report=report)


class DraftPreflightError(ConfigError):
    """The draft failed validation; `report` lists every problem with its fix."""

    def __init__(self, message: str, report: DraftReport):
        super().__init__(message)
        self.report = report
