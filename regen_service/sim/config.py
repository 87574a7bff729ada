"""The simulator's configuration: one pydantic model for the command line and for runtime updates.

`regen sim` builds a SimConfig from its flags; `POST /sim/config` merges a partial JSON update into
the live one (`SimConfig.updated`). Fields that shape the process itself (host, port, seed, model,
tokenizer) cannot change at runtime. This module knows nothing about HTTP or scheduling.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Changing these needs a restart: they fix the socket, the answers, or the token ids.
FIXED_AT_START = frozenset(
    {
        "host",
        "port",
        "seed",
        "model",
        "tokenizer_path",
        "hf_model_path",
        "api_key",
    }
)

# The SGLang release whose HTTP surface the simulator follows (reported as `version`).
SGLANG_API_VERSION = "0.5.6"


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    seed: int = 0
    model: str = "moonshotai/Kimi-K2.5"
    tokenizer_path: str | None = None
    # Run Python code shipped in the tokenizer folder (its `auto_map`)? Only on the operator's word.
    trust_remote_code: bool = False
    hf_model_path: str | None = None  # answer with this local causal LM's greedy decoding (hf_backend.py)
    api_key: str | None = None

    # SGLang server flags the simulator honours.
    context_length: int = Field(default=262144, ge=16)
    incremental_streaming_output: bool = False
    reasoning_parser: Literal["kimi_k2", "none"] = "kimi_k2"
    tool_call_parser: Literal["kimi_k2", "none"] = "kimi_k2"

    # Answers (see answers.py): length in tokens, thinking and tool calls.
    answer_len_dist: Literal["lognormal", "uniform", "fixed"] = "lognormal"
    answer_len_mean: int = Field(default=256, ge=1)
    answer_len_max: int = Field(default=4096, ge=1)
    think_prob: float = Field(default=0.5, ge=0, le=1)
    tool_call_prob: float = Field(default=0.3, ge=0, le=1)

    # Images (images.py): the side in pixels of the square one image token covers (Kimi-K2.5's MoonViT:
    # 14 px patches merged 2x2); an image adds ceil(w/px) * ceil(h/px) prompt tokens.
    image_token_px: int = Field(default=28, ge=1)

    # Capacity model (see capacity.py).
    max_running_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=4096, ge=0)
    decode_tok_s: float = Field(default=40.0, ge=0)
    batch_slowdown: float = Field(default=0.01, ge=0)
    prefill_tok_s: float = Field(default=0.0, ge=0)
    tick_s: float = Field(default=0.015, gt=0, le=1)

    # Speculative decoding model: 0 = off.
    spec_accept_length: float = Field(default=0.0, ge=0)
    spec_speedup: float | None = Field(default=None, gt=0)
    # Per-prompt accept lengths, for exact per-source checks (eval-draft): the first rule whose text
    # the rendered prompt contains sets that request's accept length; others get spec_accept_length.
    spec_accept_rules: dict[str, float] = Field(default_factory=dict)

    # Faults, each decided once per request attempt.
    fault_503_rate: float = Field(default=0.0, ge=0, le=1)
    fault_disconnect_rate: float = Field(default=0.0, ge=0, le=1)
    fault_stall_rate: float = Field(default=0.0, ge=0, le=1)
    stall_s: float = Field(default=5.0, ge=0)
    fault_error_event_rate: float = Field(default=0.0, ge=0, le=1)
    fault_abort_rate: float = Field(default=0.0, ge=0, le=1)

    @property
    def instant(self) -> bool:
        """decode_tok_s == 0: answers come back at once, without the scheduler (scale benchmarks)."""
        return self.decode_tok_s == 0

    @property
    def spec_on(self) -> bool:
        return self.spec_accept_length > 0

    def accept_length_for(self, prompt_text: str) -> float:
        """The accept length a request with this prompt reports (0 when speculation is off)."""
        if not self.spec_on:
            return 0.0
        rule = next((v for k, v in self.spec_accept_rules.items() if k in prompt_text), None)
        return self.spec_accept_length if rule is None else rule

    @property
    def effective_spec_speedup(self) -> float:
        if not self.spec_on:
            return 1.0
        if self.spec_speedup is not None:
            return self.spec_speedup
        return max(1.0, self.spec_accept_length * 0.8)

    def per_request_tok_s(self, num_running: int) -> float:
        """Decode speed of each request when `num_running` share the batch."""
        n = max(1, num_running)
        return self.decode_tok_s * self.effective_spec_speedup / (1.0 + self.batch_slowdown * (n - 1))

    @property
    def capacity_tok_s(self) -> float:
        """Aggregate decode tok/s with a full batch: R * D * speedup / (1 + A * (R - 1))."""
        return self.max_running_requests * self.per_request_tok_s(self.max_running_requests)

    @property
    def max_total_num_tokens(self) -> int:
        return max(self.context_length, self.max_running_requests * 8192)

    def updated(self, patch: dict) -> SimConfig:
        """A new config with `patch` applied; raises ValueError for unknown or start-only fields."""
        fixed = sorted(set(patch) & FIXED_AT_START)
        if fixed:
            raise ValueError(f"fields {fixed} are fixed at start; restart `regen sim` to change them")
        return SimConfig.model_validate({**self.model_dump(), **patch})
