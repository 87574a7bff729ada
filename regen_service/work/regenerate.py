"""Regenerator: one prompt record in, one OutputRow (schemas.rows) out, every answer from the target.

`turns: all` answers each assistant turn in order, every request carrying the target's own earlier
answers (the dataset's are replaced); `turns: last` answers only the final one. A conversation that
ends with a user (or tool) message gets a new assistant turn appended.

Tool results (documented in docs/client.md): the dataset's tool messages stay in place after a
regenerated turn that made tool calls (their tool_call_id re-pointed, by position, to the target's
call ids). When the regenerated turn made no tool call but the dataset continues with tool results,
or made calls the dataset has no results for, the conversation stops there: the row ends with the
target's answer, because anything later answers a conversation the target did not have, and keeping
the dataset's turn would put non-target text where the trainer expects the target's.

Every request carries the target's full history, reasoning included (the template decides what it
shows); `thinking: strip` drops reasoning from the stored row only. api generate turns record the
exact prompt ids they were generated from (`prompt_len`/`prompt_ids`), for per-generation training.

Image parts (issue 24) ride in every request whose history holds them, read once per row from the
run's image store (work/images.py): as OpenAI `image_url` parts with data URLs (api chat), or as
SGLang's `image_data` beside the prompt ids, whose template rendered each image's placeholder (api
generate). A missing or altered image, or more image bytes than the worker's bound, fails the row
(ImageUnavailableError / RequestImagesTooLargeError, both terminal) before anything is sent.

Row-level failures never raise: they land in `error` / `error_class` with the finished turns kept,
their text scrubbed of secrets (client.auth.scrub_secrets). EndpointTerminalError (every endpoint
refused the key or serves another model) is not the row's fault and propagates: the worker hands the
shard back rather than finalizing it. Writing rows (run_id, reused_from, Parquet) is the worker's job.
"""

from __future__ import annotations

import asyncio
import time

from regen_service.errors import ConfigError, RetriesExhaustedError, RowTerminalError
from regen_service.work.chat_template import loss_mask_for, parse_tool_calls, prompt_ids, split_thinking
from regen_service.work.client.auth import scrub_secrets
from regen_service.work.client.http import Completion
from regen_service.work.client.pool import EndpointPool
from regen_service.work.images import RunImages, chat_messages, image_data, images_of
from schemas.conversation import Message, PromptRecord
from schemas.mix import MixSpec
from schemas.prompt_rows import tools_to_json
from schemas.rows import OutputRow, Turn


class Regenerator:
    def __init__(
        self, pool: EndpointPool, mix: MixSpec, tokenizer=None, images: RunImages | None = None
    ) -> None:
        if mix.target.api == "generate" and tokenizer is None:
            raise ConfigError(
                "api: generate needs the target tokenizer (mix target.tokenizer), loaded by the caller"
            )
        self.pool = pool
        self.mix = mix
        self.tokenizer = tokenizer
        self.images = images  # the run's image store; None: a caller with text-only prompts
        self.api = mix.target.api
        self.thinking = mix.regenerate.thinking
        # Per-row constants, hashed once (the mix does not change under a Regenerator).
        self._sampling_hash = mix.sampling.settings_hash()
        self._regen_key = mix.regen_key()

    # --- requests ----------------------------------------------------------------------------
    def _sampling(self) -> dict:
        s = self.mix.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p}

    async def _ask(
        self, history: list[Message], tools, urls: dict[str, str]
    ) -> tuple[Completion, Message, list[int] | None]:
        """One assistant turn: the completion, the message to store, and (generate) the prompt ids.
        `urls` holds the row's images as data URLs (sha256 -> URL), read once per row."""
        s = self.mix.sampling
        if self.api == "generate":
            # Rendering and tokenizing a long conversation takes seconds: never on the event loop,
            # where it would stall every other request (and the lease heartbeat) of the worker.
            ids = await asyncio.to_thread(
                prompt_ids, self.tokenizer, history, tools, thinking=self.thinking != "off"
            )
            params = {**self._sampling(), "max_new_tokens": s.max_new_tokens, "skip_special_tokens": False}
            if s.seed is not None:
                params["sampling_seed"] = s.seed
            body = {"input_ids": ids, "sampling_params": params}
            if images_of(history):
                # SGLang decodes input_ids to text when image_data comes with them and expands each
                # image placeholder the template rendered (Kimi: <|media_pad|>) to the image's tokens.
                body["image_data"] = image_data(history, urls)
            c = await self.pool.complete("generate", body, prompt_len=len(ids))
            reasoning, answer = split_thinking(c.text, prompt_opens_think=self.thinking != "off")
            content, calls = parse_tool_calls(answer)
        else:
            ids = None
            payload = {
                "model": self.mix.target.model,
                "messages": chat_messages(history, urls),
                **self._sampling(),
                "max_completion_tokens": s.max_new_tokens,
                "separate_reasoning": True,
            }
            if tools:
                payload["tools"] = list(tools)
            if s.seed is not None:
                payload["seed"] = s.seed
            if self.thinking == "off":
                payload["chat_template_kwargs"] = {"thinking": False}
            c = await self.pool.complete("chat", payload)
            reasoning, content, calls = c.reasoning_content, c.content or "", c.tool_calls
            if reasoning is None and "</think>" in content:
                # The server runs without a reasoning parser: split it here the same way.
                reasoning, content = split_thinking(content, prompt_opens_think=True)
            # Raw text as generated after the prompt's `<think>`: reasoning, `</think>`, answer.
            c.text = f"{reasoning}</think>{content}" if reasoning is not None else content
        # The reasoning stays in the history later requests carry, even under `thinking: strip`: the
        # template keeps it for in-progress tool-call turns, so the target must see it there. What
        # `strip` drops is dropped from the stored row only (_finish).
        msg = Message(
            role="assistant",
            content=content,
            reasoning_content=reasoning,
            tool_calls=tuple(calls) if calls else None,
        )
        return c, msg, ids

    # --- conversation ------------------------------------------------------------------------
    def _targets(self, messages: list[Message]) -> set[int]:
        assistants = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if messages[-1].role != "assistant":
            assistants.append(len(messages))  # a new turn, appended
        return set(assistants) if self.mix.regenerate.turns == "all" else {assistants[-1]}

    async def regenerate(self, record: PromptRecord) -> OutputRow:
        row = self._base(record)
        if record.input_ids is not None:
            row.input_ids, row.loss_mask = list(record.input_ids), list(record.loss_mask)
            row.turns = []
            return row
        conv = record.conversation
        messages = list(conv.messages)
        targets = self._targets(messages)
        history: list[Message] = []
        turns: list[Turn] = []
        outputs: list[list[int]] = []
        prompts: list[list[int] | None] = []  # per turn: the prompt ids it was generated from
        last_ids: list[int] | None = None
        t0 = time.monotonic()
        i = 0
        try:
            urls = await self._load_images(messages)
            while i <= len(messages):
                if i not in targets:
                    if i < len(messages):
                        history.append(messages[i])
                    i += 1
                    continue
                c, msg, ids = await self._ask(history, conv.tools, urls)
                history.append(msg)
                turns.append(self._turn(len(history) - 1, c))
                prompts.append(ids if c.output_ids is not None else None)
                if c.output_ids is not None:
                    outputs.append(list(c.output_ids))
                    last_ids = ids
                i += 1
                tools_after = []
                while i < len(messages) and messages[i].role == "tool":
                    tools_after.append(messages[i])
                    i += 1
                if bool(tools_after) != bool(msg.tool_calls) and i < len(messages) + (not tools_after):
                    break  # the target's turn and the dataset's continuation disagree: stop here
                history.extend(_repoint(tools_after, msg))
        except RowTerminalError as e:
            row.error, row.error_class = scrub_secrets(str(e)), "terminal_row"
        except RetriesExhaustedError as e:
            row.error, row.error_class = scrub_secrets(str(e)), "retries_exhausted"
        self._finish(row, history, turns, outputs, last_ids, time.monotonic() - t0)
        _attach_prompts(row, turns, prompts)
        return row

    async def _load_images(self, messages: list[Message]) -> dict[str, str]:
        if not images_of(messages):
            return {}
        if self.images is None:
            # The in-process path (local_run's engine) takes token ids only: the target would answer
            # a picture it never saw, so the row fails instead.
            raise RowTerminalError(
                f"the prompt has {len(images_of(messages))} image part(s) and this regenerator sends no "
                "images (in-process engine); regenerate it with `regen worker`"
            )
        return await self.images.load(messages)

    # --- row ---------------------------------------------------------------------------------
    def _base(self, record: PromptRecord) -> OutputRow:
        return OutputRow(
            prompt_id=record.prompt_id,
            source=record.source,
            row_index=record.row_index,
            model=self.mix.target.model,
            api=self.api,
            sampling_hash=self._sampling_hash,
            regen_key=self._regen_key,
            tools=tools_to_json(record.conversation.tools) if record.conversation else None,
            attempts=0,
        )

    @staticmethod
    def _turn(index: int, c: Completion) -> Turn:
        return Turn(
            message_index=index,
            text=c.text,
            output_ids=list(c.output_ids) if c.output_ids is not None else None,
            finish_reason=c.finish_reason,
            prompt_tokens=c.prompt_tokens,
            completion_tokens=c.completion_tokens,
            ttft_s=c.ttft_s,
            decode_tok_s=c.decode_tok_s,
            latency_s=c.latency_s,
            endpoint=c.endpoint,
            attempts=c.attempts,
        )

    def _finish(
        self, row: OutputRow, history, turns: list[Turn], outputs, last_ids, elapsed_s: float
    ) -> None:
        speeds = [t.decode_tok_s for t in turns if t.decode_tok_s is not None]
        if self.thinking == "strip":
            answered = {t.message_index for t in turns}
            history = [
                m.model_copy(update={"reasoning_content": None}) if i in answered else m
                for i, m in enumerate(history)
            ]
        row.messages = tuple(history)
        row.turns = turns
        row.finish_reason = turns[-1].finish_reason if turns else None
        # summed over turns: tokens the target processed and produced for this row
        row.prompt_tokens = sum(t.prompt_tokens or 0 for t in turns)
        row.completion_tokens = sum(t.completion_tokens or 0 for t in turns)
        row.endpoint = turns[-1].endpoint if turns else None
        row.attempts = sum(t.attempts for t in turns)
        row.latency_s = elapsed_s
        row.ttft_s = turns[0].ttft_s if turns else None
        row.decode_tok_s = sum(speeds) / len(speeds) if speeds else None
        row.input_ids = row.loss_mask = None
        if last_ids is not None and outputs:
            row.input_ids = last_ids + outputs[-1]
            row.loss_mask = loss_mask_for(last_ids, outputs[-1], outputs[:-1])


def _attach_prompts(row: OutputRow, turns: list[Turn], prompts: list[list[int] | None]) -> None:
    """Each generate turn's exact prompt: its length, and its ids where they are not a prefix of the
    row's input_ids (an earlier turn whose later re-rendering changed, e.g. dropped its thinking)."""
    final = row.input_ids or []
    for turn, ids in zip(turns, prompts, strict=True):
        if ids is not None:
            turn.prompt_len = len(ids)
            turn.prompt_ids = None if final[: len(ids)] == ids else ids


def _repoint(tool_msgs: list[Message], call_msg: Message) -> list[Message]:
    """The dataset's tool results, answering the target's calls (ids re-pointed by position)."""
    calls = call_msg.tool_calls or ()
    out = []
    for k, m in enumerate(tool_msgs):
        if k < len(calls) and calls[k].id is not None:
            m = m.model_copy(update={"tool_call_id": calls[k].id, "name": m.name or calls[k].name})
        out.append(m)
    return out
