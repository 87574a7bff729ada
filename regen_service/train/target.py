"""The target backend: a Hugging Face causal LM from a local path, run without gradients.

It gives what the draft trains on: the three auxiliary hidden states (INPUTS of layers
`aux_layer_ids`, SGLang's convention; default [2, L//2, L-3], i.e. hidden_states[2], [L//2], [L-3]
of output_hidden_states, where hidden_states[0] is the embedding output) concatenated to 3H, and
the target's greedy next token per position; `states(..., draft_token_ids=...)` also gives the
target's logits over the draft vocabulary (soft targets): the final hidden state goes through lm_head
once, position chunk by position chunk, for both (target_head.head_outputs, shared with the vLLM
backend), so no [B, T, V] logits of a 163840-token vocabulary exist. Multimodal targets keep the text model's config under
`text_config`; sizes are read from there. Never downloads (local_files_only). Serving the target
through SGLang for training is left to others; this backend is the HF one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from regen_service.draft.aux_layers import checked_aux_layer_ids
from regen_service.errors import ConfigError
from regen_service.train.data import collate, pad_time
from regen_service.train.target_head import head_outputs


def text_config(config):
    return getattr(config, "text_config", None) or config


# The one-line refusal of image rows where the target runs in-process: the HF backend runs the target's
# text model on token ids only, so the image tokens would carry no image at all.
VL_NEEDS_ENGINE = (
    "the run holds rows with images, and target_backend hf feeds the target token ids only (its image "
    "tokens would carry no image): train with --target-backend vllm --target-endpoint URL "
    "--target-states-dir DIR (a vLLM started by `regen launch-vllm --hidden-states DIR`), which puts "
    "the images in the prompt"
)


class TargetBackend:
    """What the trainer asks of a target backend (HFTarget here, engine_target.VllmTarget): `states`
    (aux hidden, greedy next token, draft-vocab logits), plus the sizes and the embedding it shares."""

    def states(self, input_ids, attention_mask=None, draft_token_ids=None):
        raise NotImplementedError

    def example_states(
        self,
        examples: list,
        draft_token_ids: torch.Tensor | None = None,
        pad_to: Callable[[int], int] | None = None,
    ):
        """Samples (data.Example, eval_set.EvalSample) -> (batch, aux, greedy next token, draft-vocab
        logits): the batch as data.collate makes it, on the sequences the states belong to. Text samples
        go as they are; a backend that can put images in the prompt (engine_target.VllmTarget) overrides
        this for samples with images (vl_samples.py). `pad_to`: the batch's padded length as a function
        of its longest sequence (lengths.bucketer); the target runs on the unpadded batch and its states
        get zeros at the pad positions, which carry loss_mask 0 and attention_mask 0."""
        if any(getattr(e, "vl", None) is not None for e in examples):
            raise ConfigError(VL_NEEDS_ENGINE)
        n = max(e.ids.numel() for e in examples)
        batch = collate(examples, pad_to=pad_to(n) if pad_to else None)
        t = batch["input_ids"].shape[1]
        aux, pred, draft = self.states(
            batch["input_ids"][:, :n], batch["attention_mask"][:, :n], draft_token_ids
        )
        return batch, pad_time(aux, t), pad_time(pred, t), pad_time(draft, t)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (aux hidden [B, T, 3H], target's greedy next token per position [B, T])."""
        aux, pred, _ = self.states(input_ids, attention_mask)
        return aux, pred

    __call__ = forward

    def close(self) -> None:
        """Nothing to release by default (the engine backend closes its connections)."""


class HFTarget(TargetBackend):
    def __init__(
        self,
        path: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        aux_layer_ids: list[int] | None = None,
        model=None,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.path = path
        self.device = torch.device(device)
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if model is None:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, local_files_only=True, dtype=dtype, trust_remote_code=trust_remote_code
                )
            except OSError as e:
                raise ConfigError(f"--target {path}: not a local Hugging Face model directory ({e})") from e
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        tc = text_config(self.model.config)
        self.num_layers: int = tc.num_hidden_layers
        self.hidden_size: int = tc.hidden_size
        self.vocab_size: int = tc.vocab_size
        self.text_config = tc
        self.aux_layer_ids = checked_aux_layer_ids(aux_layer_ids, self.num_layers)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @torch.no_grad()
    def states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        draft_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (aux hidden [B, T, 3H], greedy next token [B, T], logits over `draft_token_ids` [B, T, N] or None)."""
        # the base model, not the causal LM: its last hidden state (after the final norm) goes through
        # lm_head here, a chunk at a time, instead of the LM's full [B, T, V] logits
        out = self.model.get_decoder()(
            input_ids=input_ids.to(self.device),
            attention_mask=None if attention_mask is None else attention_mask.to(self.device),
            output_hidden_states=True,
            use_cache=False,
        )
        hs = out.hidden_states
        aux = torch.cat([hs[i] for i in self.aux_layer_ids], -1)
        pred, draft = head_outputs(
            out.last_hidden_state, self.model.get_output_embeddings().weight, draft_token_ids
        )
        return aux, pred, draft
