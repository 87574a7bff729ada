"""An in-process engine for the Regenerator: a Hugging Face model on this machine instead of SGLang.

Where no server can run (a GPU box without Redis or an engine, a CPU test), `LocalEngine` stands in for
the EndpointPool: `complete("generate", payload, prompt_len=...)` is the call the Regenerator makes,
and what comes back is the Completion an SGLang `/generate` reply becomes (raw text with the stop
token, exact output ids, finish reason). Requests that arrive together (the Regenerator answers rows
concurrently) are gathered and run as batches, longest prompts first, by a `sampler`: a function
from a list of prompt ids and the request's sampling params to (output ids, finish reason) per prompt.
`hf_sampler` samples from a causal LM as a server would (temperature, top_p, top_k, the stop token
kept in the ids); `replay_sampler` answers with fixed token ids (a dataset's own answers, tokenized)
so original and regenerated data go through the same code path and land in the same row format.
Only api `generate` is served. Regenerate.py and the shard layout are unchanged by this module.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

from regen_service.errors import ConfigError
from regen_service.work.client.http import Completion

Sampler = Callable[[list[list[int]], dict], list[tuple[list[int], str]]]


class LocalEngine:
    def __init__(self, sampler: Sampler, tokenizer, batch_size: int = 512, name: str = "local"):
        self.sampler, self.tokenizer, self.batch_size, self.name = sampler, tokenizer, batch_size, name
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self.batches = 0

    async def complete(self, api: str, payload: dict, *, prompt_len: int | None = None) -> Completion:
        if api != "generate":
            raise ConfigError(f"LocalEngine serves api generate only, not {api!r}")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(payload["input_ids"]), dict(payload.get("sampling_params") or {}), fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            n = -1
            while n != len(self._pending):  # let every request that is on its way join the batch
                n = len(self._pending)
                await asyncio.sleep(0)
            work, self._pending = self._pending, []
            work.sort(key=lambda w: -len(w[0]))
            for i in range(0, len(work), self.batch_size):
                chunk = work[i : i + self.batch_size]
                t0 = time.perf_counter()
                try:
                    outs = self.sampler([w[0] for w in chunk], chunk[0][1])
                except Exception as e:
                    for *_, fut in chunk:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                dt = time.perf_counter() - t0
                self.batches += 1
                for (ids, _, fut), (out, finish) in zip(chunk, outs, strict=True):
                    fut.set_result(self._completion(ids, out, finish, dt))
                await asyncio.sleep(0)

    def _completion(self, prompt: list[int], out: list[int], finish: str, dt: float) -> Completion:
        return Completion(
            text=self.tokenizer.decode(out, skip_special_tokens=False),
            output_ids=list(out),
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(out),
            latency_s=dt,
            decode_tok_s=len(out) / dt if dt > 0 else None,
            endpoint=self.name,
        )


def _cut(row: list[int], stop: int, pad: int, limit: int) -> tuple[list[int], str]:
    """Output ids up to and including the first stop token; 'stop' or 'length'."""
    if stop in row:
        return row[: row.index(stop) + 1], "stop"
    return [t for t in row if t != pad][:limit], "length"


def hf_sampler(model, tokenizer, device, seed: int = 0) -> Sampler:
    """Sampling from a causal LM: left-padded batches through `generate`, the stop token kept."""
    stop, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    calls = [0]

    @torch.no_grad()
    def sample(prompts: list[list[int]], sp: dict) -> list[tuple[list[int], str]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        temp = float(sp.get("temperature", 1.0))
        top_k = int(sp.get("top_k", -1) or -1)
        kw = {"do_sample": temp > 0, "max_new_tokens": int(sp.get("max_new_tokens", 256))}
        if temp > 0:
            kw.update(temperature=temp, top_p=float(sp.get("top_p", 1.0)), top_k=top_k if top_k > 0 else 0)
        torch.manual_seed(int(sp.get("sampling_seed", seed)) * 100_003 + calls[0])
        calls[0] += 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            eos_token_id=stop,
            pad_token_id=pad,
            **kw,
        )
        gen = out[:, width:].tolist()
        return [_cut(g, stop, pad, kw["max_new_tokens"]) for g in gen]

    return sample


def replay_sampler(answers: dict[tuple[int, ...], list[int]]) -> Sampler:
    """Answers with the token ids stored for each prompt (KeyError for a prompt it does not know)."""

    def sample(prompts: list[list[int]], sp: dict) -> list[tuple[list[int], str]]:
        limit = int(sp.get("max_new_tokens", 1 << 30))
        out = []
        for p in prompts:
            ids = answers[tuple(p)]
            out.append((ids[:limit], "stop" if len(ids) <= limit else "length"))
        return out

    return sample
