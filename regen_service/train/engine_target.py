"""The target backend served by vLLM: hidden states from an engine that holds the target, not a local copy.

A 1T-parameter MoE (Kimi-K2.5) fits no trainer process; vLLM holds it with tensor/expert parallelism and,
started with the `extract_hidden_states` method (deploy/launch_vllm.py), captures the residual stream
entering the aux layers plus the last layer's output. For each training sequence this backend sends the
token ids to `/v1/completions` (one token generated), waits on the flock of the file the engine names in
`kv_transfer_params.hidden_states_path` (vllm_connector.py writes it; only a file inside the engine's
`--hidden-states DIR`, given here as `target_states_dir`, is read), and reads `hidden_states`
[T, 4, H]: the three aux layers, concatenated to [T, 3H] as HFTarget gives them, and the final layer,
through the target's own final norm and lm_head (the only target weights loaded here, with the
embedding the draft shares) to the target's prediction per position. The files must be on a filesystem
this process reads (the engine's host; /dev/shm is fastest); each is deleted once read (engine_files.py).
A sample whose context holds images goes through `/v1/chat/completions` instead, its images inline, and
trains on the engine's expanded sequence (`example_states`, vl_samples.py). Which shards to train on,
and the training itself, are the loop's (loop.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch

from regen_service.errors import ConfigError
from regen_service.train.data import collate
from regen_service.train.engine_files import EngineStateError, load_head_weights, read_state_file
from regen_service.train.target import TargetBackend, checked_aux_layer_ids
from regen_service.train.target_head import target_step
from regen_service.train.vl_samples import VlContext, align, request_messages


class VllmTarget(TargetBackend):
    """Same interface as target.HFTarget: forward(input_ids, attention_mask) -> (aux [B,T,3H], argmax [B,T])."""

    def __init__(
        self,
        path: str,
        endpoint: str,
        device: str | torch.device = "cpu",
        aux_layer_ids: list[int] | None = None,
        *,
        states_dir: str | Path | None = None,
        model: str | None = None,
        num_parallel_requests: int = 8,
        request_timeout_s: float = 600.0,
        api_key: str | None = None,
        read_image: Callable[[str], bytes] | None = None,
    ):
        self.path = path
        self._read_image = read_image  # a stored image's bytes, by its storage path (samples with images)
        if not states_dir:
            raise ConfigError(
                "target_states_dir is not set: set it to the folder the engine writes hidden states to "
                "(`regen launch-vllm --hidden-states DIR`; vLLM creates it at its first request)"
            )
        self.states_dir = states_dir  # resolved at each read: confined() follows what it is then
        self._timeout_s = request_timeout_s
        self.device = torch.device(device)
        # config.json read as data: the engine runs the target's code (Kimi-K2.5's is remote code), the
        # trainer only needs its text model's sizes, so it never imports the folder's Python.
        try:
            raw = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--target {path}: not a local model directory with a config.json ({e})") from e
        tc = SimpleNamespace(**(raw.get("text_config") or raw))
        self.text_config = tc
        self.num_layers: int = tc.num_hidden_layers
        self.hidden_size: int = tc.hidden_size
        self.vocab_size: int = tc.vocab_size
        self.aux_layer_ids = checked_aux_layer_ids(aux_layer_ids, self.num_layers)
        # the placeholder the engine widens to an image's tokens (Kimi-K2.5's <|media_pad|>)
        self.image_token_id = raw.get("media_placeholder_token_id", raw.get("image_token_id"))
        w = load_head_weights(path)
        self._embed = w["embed"]
        # Kimi-K2.5's head is 163840 x 7168: bf16 on a GPU (2.3 GB), fp32 where the CPU computes it.
        head_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self._norm_w = w["norm"].to(self.device, torch.float32)
        self._lm_head = w["lm_head"].to(self.device, head_dtype)
        self._eps = float(getattr(tc, "rms_norm_eps", 1e-6))
        self.endpoint = endpoint.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.endpoint,
            headers=headers,
            timeout=request_timeout_s,
            limits=httpx.Limits(max_connections=num_parallel_requests),
        )
        self._pool = ThreadPoolExecutor(num_parallel_requests, thread_name_prefix="regen-states")
        self.model = model or self._served_model()
        self._check_capture()

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._embed

    def _served_model(self) -> str:
        try:
            data = self._http.get("/v1/models").json().get("data") or []
        except (httpx.HTTPError, ValueError) as e:
            raise ConfigError(f"--target-endpoint {self.endpoint}: no vLLM answers there ({e})") from None
        if not data:
            raise ConfigError(f"--target-endpoint {self.endpoint} serves no model")
        return data[0]["id"]

    def _check_capture(self) -> None:
        """One short sequence: the engine must capture aux layers + the last layer, and the last one must
        predict what the engine itself generates (else the layers it captures are not the ones we train on)."""
        probe = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]) % self.vocab_size
        states, generated = self._states(probe[0].tolist())
        if states.shape[1] != 4 or states.shape[2] != self.hidden_size:
            raise ConfigError(
                f"--target-endpoint {self.endpoint} captures hidden states of shape {list(states.shape)}, not "
                f"[T, 4, {self.hidden_size}] (the three aux layers and the last layer): start it with "
                "`regen launch-vllm --target ... --hidden-states DIR`, which sets eagle_aux_hidden_state_layer_ids "
                f"to {[*self.aux_layer_ids, self.num_layers]}"
            )
        if int(self._head(states[-1:, 3], None)[0]) != generated:
            raise ConfigError(
                f"--target-endpoint {self.endpoint}: the last captured layer does not predict what the engine "
                f"generates: it serves another model than {self.path}, or captures other layers than "
                f"{[*self.aux_layer_ids, self.num_layers]}; restart it with `regen launch-vllm`"
            )

    def _states(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
        got, generated, _ = self._post("/v1/completions", body)
        if got["token_ids"].tolist() != ids:
            raise EngineStateError(f"{self.endpoint} wrote another sequence's states than the one sent")
        return got["hidden_states"], generated

    def _chat_states(self, ctx: VlContext) -> tuple[list[int], torch.Tensor]:
        """A sample with images: its conversation through the chat API, the images inline, rendered by
        the engine's own template and processor (which widens each image placeholder to the image's
        tokens) -> (the engine's token ids, their states)."""
        if self._read_image is None:
            raise ConfigError("a sample holds images but this target backend was given no image store")
        body = {
            "messages": request_messages(ctx, self._read_image),
            "max_tokens": 1,
            "temperature": 0,
            "return_token_ids": True,
            "add_generation_prompt": False,  # the sample ends with the answer: render it, ask nothing
            "chat_template_kwargs": json.loads(ctx.template_kwargs),
        }
        got, _, prompt_ids = self._post("/v1/chat/completions", body)
        if prompt_ids is None or got["token_ids"].tolist() != prompt_ids:
            raise EngineStateError(
                f"{self.endpoint} wrote another sequence's states than the prompt it names"
            )
        return prompt_ids, got["hidden_states"]

    def _post(self, route: str, body: dict) -> tuple[dict[str, torch.Tensor], int, list[int] | None]:
        """One request of one generated token -> (its states file, the token, the prompt ids it reports)."""
        try:
            r = self._http.post(route, json={"model": self.model, **body})
        except httpx.HTTPError as e:
            raise EngineStateError(f"{self.endpoint}: {type(e).__name__} {e}") from None
        if r.status_code != 200:
            raise EngineStateError(f"{self.endpoint} answered {r.status_code}: {r.text[:300]}")
        try:
            data = r.json()
            path = (data.get("kv_transfer_params") or {}).get("hidden_states_path")
            generated = int(data["choices"][0]["token_ids"][0])
            prompt_ids = data.get("prompt_token_ids") or data["choices"][0].get("prompt_token_ids")
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise EngineStateError(
                f"{self.endpoint} answered {route} with {r.text[:200]!r}, not a completion carrying "
                "choices[0].token_ids and kv_transfer_params.hidden_states_path"
            ) from None
        if not path:
            raise ConfigError(
                f"--target-endpoint {self.endpoint} returns no hidden_states_path: it runs without the "
                "extract_hidden_states method; start it with `regen launch-vllm --target ... --hidden-states DIR`"
            )
        return read_state_file(path, self.states_dir, self._timeout_s), generated, prompt_ids

    def _example(self, ex) -> tuple[list[int], list[int], torch.Tensor]:
        """(ids, mask, states) of one sample on the sequence the engine ran: a text sample as it is, a
        sample with images on the engine's expanded sequence (vl_samples.align), states cut to match."""
        ids, mask = ex.ids.tolist(), ex.mask.tolist()
        if getattr(ex, "vl", None) is None:
            return ids, mask, self._states(ids)[0]
        if self.image_token_id is None:
            raise ConfigError(
                f"--target {self.path}: its config.json names no image placeholder token "
                "(media_placeholder_token_id or image_token_id), but the run holds images"
            )
        engine_ids, states = self._chat_states(ex.vl)
        ids, mask = align(engine_ids, ids, mask, int(self.image_token_id))
        return ids, mask, states[: len(ids)]

    def example_states(
        self,
        examples: list,
        draft_token_ids: torch.Tensor | None = None,
        pad_to: Callable[[int], int] | None = None,
    ):
        """As TargetBackend.example_states, samples with images included: the batch holds the engine's
        expanded sequences (image tokens as the target saw them, never in the loss mask), padded after
        the engine answered (an image's expansion is known only then); the engine sees no pad token and
        the pad positions' states are zeros (_assemble)."""
        done = list(self._pool.map(self._example, examples))
        n = max(len(i) for i, _, _ in done)
        batch = collate(
            [SimpleNamespace(ids=torch.tensor(i), mask=torch.tensor(m)) for i, m, _ in done],
            pad_to=pad_to(n) if pad_to else None,
        )
        aux, pred, draft = self._assemble(
            [st for _, _, st in done], batch["input_ids"].shape, draft_token_ids
        )
        return batch, aux, pred, draft

    def _head(self, last: torch.Tensor, draft_token_ids: torch.Tensor | None):
        """One sequence's last captured layer [n, H] -> (argmax [n], draft-vocab logits [n, N] or None)."""
        # normed in fp32 with the fp32 norm weight whatever the file holds, then cast to the head's dtype
        pred, draft = target_step(
            last.to(self.device, torch.float32)[None], self._norm_w, self._eps, self._lm_head, draft_token_ids
        )
        return pred[0], None if draft is None else draft[0]

    @torch.no_grad()
    def states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        draft_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """As HFTarget.states: the last captured layer through the final norm and lm_head (target_head.
        target_step: one pass over the full head, a chunk of positions at a time, for the argmax and the
        draft-vocab columns)."""
        b, t = input_ids.shape
        lengths = attention_mask.sum(-1).tolist() if attention_mask is not None else [t] * b
        seqs = [input_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]
        results = list(self._pool.map(self._states, seqs))
        return self._assemble([st for st, _ in results], (b, t), draft_token_ids)

    def _assemble(self, states: list[torch.Tensor], shape, draft_token_ids):
        """Per-sequence states [n, 4, H] -> the batch's aux [B, T, 3H], argmax [B, T], draft logits."""
        b, t = shape
        aux = torch.zeros(b, t, 3 * self.hidden_size, dtype=torch.bfloat16, device=self.device)
        pred = torch.zeros(b, t, dtype=torch.int64, device=self.device)
        draft = None
        if draft_token_ids is not None:
            draft = torch.zeros(b, t, len(draft_token_ids), dtype=torch.float32, device=self.device)
        for i, st in enumerate(states):
            n = st.shape[0]
            aux[i, :n] = st[:, :3].reshape(n, -1).to(self.device, aux.dtype)
            pred[i, :n], d = self._head(st[:, 3], draft_token_ids)
            if draft is not None:
                draft[i, :n] = d
        return aux, pred, draft

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()
