"""The simulated inference engine: prompt -> tokens counted -> answer -> a Run that yields progress.

Both APIs come through here: `prepare_generate` / `prepare_chat` count prompt tokens, enforce the
context length and build the deterministic answer; `start` decides the attempt's faults and hands
the request to the scheduler (or, in instant mode, to nobody). A Run's `updates()` yields how many
tokens are out so far. How those tokens are shaped into JSON or SSE is left to native.py and
openai_api.py.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from regen_service.sim.answers import Answer, answer_key, build_answer, think_mode, tools_in_prompt
from regen_service.sim.capacity import Job, QueueFull, Scheduler
from regen_service.sim.config import SimConfig
from regen_service.sim.faults import NO_FAULT, FaultDecider, FaultPlan
from regen_service.sim.hf import load_tokenizer
from regen_service.sim.images import MEDIA_PAD, BadImage, SimImage, chat_images, extra_tokens, generate_images
from regen_service.sim.stats import Stats


class BadRequest(Exception):
    """The request itself is wrong; the message goes back to the client as a 400."""


class ContextTooLong(BadRequest):
    def __init__(self, num_tokens: int, context_length: int) -> None:
        super().__init__(
            f"The input ({num_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )


class Lost(Exception):
    """The request vanished with an outage; its connection is already gone."""


@dataclass
class Prepared:
    rid: str
    prompt_tokens: int
    answer: Answer
    num_tokens: int  # tokens produced when no fault interferes: the answer cut at max_new_tokens
    t_arrival: float
    accept_length: float = 0.0  # speculative accept length of this request (0: speculation off)

    @property
    def cut(self) -> bool:
        return self.num_tokens < len(self.answer.ids)


class Engine:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.tok = load_tokenizer(cfg.tokenizer_path, trust_remote_code=cfg.trust_remote_code)
        self.stats = Stats()
        self.scheduler = Scheduler(lambda: self.cfg, self.stats)
        self._faults = FaultDecider(cfg.seed)
        self.hf = None
        if cfg.hf_model_path:
            from regen_service.sim.hf_backend import HFAnswerer

            self.hf = HFAnswerer(cfg.hf_model_path, cfg.answer_len_max)

    def natural_finish(self, prep: Prepared) -> dict:
        if prep.cut:
            return {"type": "length", "length": prep.num_tokens}
        return {"type": "stop", "matched": self.tok.im_end_id}

    def _check_context(self, prompt_tokens: int) -> int:
        """Raise for a prompt that does not fit; return the room left for new tokens."""
        ctx = self.cfg.context_length
        if prompt_tokens >= ctx:
            self.stats.num_context_errors += 1
            raise ContextTooLong(prompt_tokens, ctx)
        return ctx - prompt_tokens

    def _images(self, images: list[SimImage], placeholders: int | None) -> int:
        """Prompt tokens the images add (see images.py); BadRequest when their number does not match
        the prompt's image placeholders (`placeholders`; None: chat, where parts place them)."""
        if placeholders is not None and images and placeholders != len(images):
            raise BadRequest(
                f"the prompt has {placeholders} image placeholder(s) ({MEDIA_PAD}) and image_data has "
                f"{len(images)} image(s); they must match one to one"
            )
        self.stats.images(len(images))
        return extra_tokens(images, self.cfg.image_token_px)

    def prepare_generate(self, text, input_ids, max_new_tokens, rid, image_data=None) -> Prepared:
        t0 = time.monotonic()
        try:
            images = generate_images(image_data)
        except BadImage as e:
            self.stats.num_bad_images += 1
            raise BadRequest(str(e)) from None
        # The answer follows the images too (two pictures, two answers); text-only keys are unchanged.
        seen = [im.sha256 for im in images]
        if input_ids is not None:
            if not isinstance(input_ids, list) or not all(isinstance(i, int) for i in input_ids):
                raise BadRequest("input_ids must be a list of integers")
            pads = input_ids.count(self.tok.media_pad_id) if images else None
            prompt_tokens = len(input_ids) + self._images(images, pads)
            self._check_context(prompt_tokens)
            prompt_text = self.tok.decode(input_ids[-4096:])
            key = answer_key(self.cfg.seed, "ids", [input_ids, seen] if seen else input_ids)
        elif isinstance(text, str):
            pads = text.count(MEDIA_PAD) if images else None
            prompt_tokens = self.tok.count(text) + self._images(images, pads)
            self._check_context(prompt_tokens)
            prompt_text = text
            key = answer_key(self.cfg.seed, "text", [text, seen] if seen else text)
        else:
            raise BadRequest("Either text or input_ids should be provided.")
        room = self.cfg.context_length - prompt_tokens
        tools, last_user = tools_in_prompt(prompt_text) if "tool_declare" in prompt_text else (None, False)
        max_new = _max_new(max_new_tokens, 128, room)
        if self.hf is not None:
            ids = input_ids if input_ids is not None else self.tok.encode(text)
            answer = self.hf.answer(ids, max_new)
        else:
            answer = build_answer(key, self.cfg, self.tok, think_mode(prompt_text), tools, last_user)
        return self._prepared(rid, prompt_tokens, answer, max_new, t0, prompt_text)

    def prepare_chat(self, messages, tools, template_kwargs, max_tokens, rid) -> Prepared:
        t0 = time.monotonic()
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of objects")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list")
        if not isinstance(template_kwargs, dict):
            raise BadRequest("chat_template_kwargs must be an object")
        try:
            images = chat_images(messages)
        except BadImage as e:
            self.stats.num_bad_images += 1
            raise BadRequest(str(e)) from None
        try:
            prompt_text, prompt_tokens = self.tok.render_chat(messages, tools, template_kwargs)
        except Exception as e:  # a template error is the request's fault, as in SGLang
            raise BadRequest(f"Failed to apply the chat template: {e}") from e
        prompt_tokens += self._images(images, None)
        room = self._check_context(prompt_tokens)
        key = answer_key(self.cfg.seed, "chat", {"messages": messages, "tools": tools or None})
        eligible = bool(tools) and messages[-1].get("role") == "user"
        max_new = _max_new(max_tokens, room, room)
        if self.hf is not None:
            answer = self.hf.answer(self.tok.encode(prompt_text), max_new)
        else:
            answer = build_answer(key, self.cfg, self.tok, think_mode(prompt_text), tools, eligible)
        return self._prepared(rid, prompt_tokens, answer, max_new, t0, prompt_text)

    def _prepared(
        self, rid, prompt_tokens: int, answer: Answer, max_new: int, t0: float, prompt_text: str
    ) -> Prepared:
        rid = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
        accept = self.cfg.accept_length_for(prompt_text)
        return Prepared(rid, prompt_tokens, answer, min(len(answer.ids), max_new), t0, accept)

    def start(self, prep: Prepared, faults: bool = True) -> Run:
        """Decide this attempt's faults and admit it; raises QueueFull (answered as 503)."""
        cfg = self.cfg
        plan = self._faults.decide(cfg, prep.num_tokens) if faults else NO_FAULT
        if plan.kind == "503":
            self.stats.num_503 += 1
            raise QueueFull
        job = None
        if not cfg.instant:
            prefill_s = prep.prompt_tokens / cfg.prefill_tok_s if cfg.prefill_tok_s else 0.0
            job = Job(plan.num_stop(prep.num_tokens), prefill_s, plan.stall_at, cfg.stall_s)
            try:
                self.scheduler.submit(job)
            except QueueFull:
                self.stats.num_503 += 1
                raise
        self.stats.started(prep.prompt_tokens)
        return Run(self, prep, plan, job)

    @staticmethod
    def spec_fields(completion_tokens: int, accept_length: float) -> dict:
        if accept_length <= 0 or completion_tokens <= 0:
            return {}
        verify_ct = math.ceil(completion_tokens / accept_length)
        return {"spec_verify_ct": verify_ct, "spec_accept_length": completion_tokens / verify_ct}


class Run:
    """One admitted attempt. `updates()` yields the number of tokens out; the last value is num_stop."""

    def __init__(self, engine: Engine, prep: Prepared, plan: FaultPlan, job: Job | None) -> None:
        self.engine, self.prep, self.plan, self.job = engine, prep, plan, job
        self.num_stop = plan.num_stop(prep.num_tokens)
        self._closed = False

    async def updates(self) -> AsyncIterator[int]:
        if self.job is None:
            stall_at = self.plan.stall_at
            if stall_at is not None and stall_at < self.num_stop:
                self.engine.stats.num_stalls_injected += 1
                yield stall_at
                await asyncio.sleep(self.engine.cfg.stall_s)
            self.engine.stats.add_tokens(self.num_stop)
            yield self.num_stop
            return
        job, last = self.job, 0
        while True:
            await job.changed.wait()
            job.changed.clear()
            if job.done and job.k < self.num_stop:
                raise Lost
            if job.k > last:
                last = job.k
                yield last
            if job.done:
                return

    async def drain(self) -> int:
        """Wait for the end (non-streaming); returns the number of tokens out."""
        k = 0
        async for k in self.updates():  # noqa: B007  (the last value is the answer)
            pass
        return k

    def finish(self, completion_tokens: int) -> dict:
        """Count the attempt as completed; returns the speculative meta fields, if any."""
        spec = self.engine.spec_fields(completion_tokens, self.prep.accept_length)
        if self.plan.kind != "abort":  # an aborted answer is not a completed one
            e2e = time.monotonic() - self.prep.t_arrival
            self.engine.stats.finished(e2e, completion_tokens, spec.get("spec_verify_ct", 0))
        return spec

    def close(self) -> None:
        """Always called when the handler leaves: frees the slot of a client that went away."""
        if self._closed:
            return
        self._closed = True
        if self.job is not None and not self.job.done:
            self.engine.stats.num_client_disconnects += 1
            self.engine.scheduler.cancel(self.job)


def _max_new(value, default: int, room: int) -> int:
    if value is None:
        return min(default, room)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"max_new_tokens must be a non-negative integer, got {value!r}")
    return min(value, room)
