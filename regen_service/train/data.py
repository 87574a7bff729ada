"""Output shards -> token ids + assistant-only loss masks -> padded batches.

A row with token ids (`input_ids`/`loss_mask` non-null: api generate, or pretokenized) is used as
is: those are the target's exact tokens. Any other row is rendered with the target tokenizer's chat
template over `messages` and `tools` (thinking included wherever the template keeps it). The loss
mask then covers every assistant turn: from the end of the template's assistant header (what
`add_generation_prompt` appends) through the template's end-of-turn marker, both found once per
tokenizer by rendering a probe conversation. Masks come from tokenizing the text in segments cut at
those markers, so slow tokenizers (Kimi-K2.5's tiktoken one: no offset mapping) work too. Rows with an `error` are skipped; sequences are cut at
max_length early (token columns in Arrow, rendered text before it is tokenized whole), so one huge row
costs memory for max_length tokens, not for the row. Which shards to read, and when, is the trainer's.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import torch

from regen_service.errors import ConfigError
from regen_service.train import samples as S
from regen_service.train.vl_samples import VlContext, context_for
from schemas.rows import OutputRow, output_rows

_SENTINEL = "REGEN_PROBE_9f3b"
CUT_MARGIN = (
    64  # tokens tokenized past max_length, then dropped: a cut text's last word may split differently
)


@dataclass
class Example:
    ids: torch.Tensor  # int64 [T]
    mask: torch.Tensor  # int64 [T], 1 on assistant tokens
    vl: VlContext | None = None  # the images in its context, for the engine (vl_samples.py); None: text


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template and marks assistant tokens."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        probe = [{"role": "user", "content": "ping"}]
        with_gen = self._render(probe, add_generation_prompt=True)
        self.header = with_gen[len(self._render(probe)) :]
        done = self._render([*probe, {"role": "assistant", "content": _SENTINEL}])
        self.end = done.split(_SENTINEL, 1)[1].strip() or (tokenizer.eos_token or "")

    def _render(self, messages, tools=None, add_generation_prompt=False) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render(self, messages, tools=None, *, add_generation_prompt=False, thinking: bool = True) -> str:
        """The template's text with its `thinking` switch (Kimi's kwarg; templates without it ignore it)."""
        return self.tok.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
        )

    @property
    def drops_thinking(self) -> bool:
        """Whether the template drops an earlier turn's thinking once the conversation goes on (Kimi's
        does): then one rendering of a finished conversation is not what the target saw per turn."""
        probe = [
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": "pong", "reasoning_content": _SENTINEL},
            {"role": "user", "content": "again"},
        ]
        return _SENTINEL not in self._render(probe, add_generation_prompt=True)

    def spans(self, text: str, n_assistant: int) -> list[tuple[int, int]]:
        # History turns may render a shorter header than the generation prompt (e.g. an empty
        # "<think></think>" instead of "<think>"): use the longest header prefix found often enough.
        header = self.header
        while header and text.count(header) < n_assistant:
            header = header[:-1]
        if not header:
            return []
        out, pos = [], 0
        while (start := text.find(header, pos)) >= 0:
            start += len(header)
            end = text.find(self.end, start) if self.end else -1
            end = len(text) if end < 0 else end + len(self.end)
            out.append((start, end))
            pos = end
        return out

    def encode(self, messages: list[dict], tools: list | None, max_length: int | None = None) -> Example:
        text = self._render(messages, tools=tools)
        n_asst = sum(1 for m in messages if m.get("role") == "assistant")
        ids, mask = self.tokenize_spans(text, self.spans(text, n_asst), max_length)
        return Example(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64))

    def _enough_text(self, text: str, max_length: int) -> str:
        """A prefix of `text` whose tokens start with the whole text's first max_length tokens: grown
        from 8 characters per token until it gives CUT_MARGIN tokens more than needed (a cut only
        changes the tokens of the word it falls in), so a huge row is never tokenized whole."""
        n = 8 * (max_length + CUT_MARGIN)
        while n < len(text):
            if len(self.tok(text[:n], add_special_tokens=False)["input_ids"]) >= max_length + CUT_MARGIN:
                return text[:n]
            n *= 2
        return text

    def tokenize_spans(
        self, text: str, spans: list[tuple[int, int]], max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """(ids, mask) of `text`, mask 1 on the tokens inside `spans`, without offset mappings (slow
        tokenizers have none): the text is tokenized segment by segment, cut at the span edges. The
        edges sit on template markers (special tokens), so the segments' ids joined must equal the
        whole text's ids; if not, a fast tokenizer falls back to its offsets, a slow one is an error.
        With max_length, only a prefix of the text long enough for max_length tokens is tokenized."""
        if max_length is not None:
            text = self._enough_text(text, max_length)
            spans = [(s, min(e, len(text))) for s, e in spans if s < len(text)]
            ids, mask = self.tokenize_spans(text, spans)
            return ids[:max_length], mask[:max_length]
        cuts = sorted({0, len(text), *(p for span in spans for p in span)})
        ids: list[int] = []
        mask: list[int] = []
        for a, b in itertools.pairwise(cuts):
            seg = self.tok(text[a:b], add_special_tokens=False)["input_ids"]
            inside = int(any(s <= a and b <= e for s, e in spans))
            ids += seg
            mask += [inside] * len(seg)
        whole = self.tok(text, add_special_tokens=False)["input_ids"]
        if ids == whole:
            return ids, mask
        if getattr(self.tok, "is_fast", False):
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            offs = enc["offset_mapping"]
            return enc["input_ids"], [int(any(s <= a < e for s, e in spans)) for a, _ in offs]
        raise ConfigError(
            f"tokenizer {type(self.tok).__name__} cannot mark assistant tokens in its chat template: the "
            f"template's assistant header {self.header!r} or end marker {self.end!r} does not fall on a "
            "token boundary, and the tokenizer has no offset mapping. Use a tokenizer whose template "
            "markers are special tokens, or regenerate with api: generate (rows then carry token ids)"
        )


def template_messages(row: OutputRow) -> list[dict]:
    """The chat template's input for a row's conversation: its messages in the same "template" form
    the generation request was rendered from (schemas.conversation.Message.to_dict)."""
    return [m.to_dict("template") for m in row.messages or ()]


def _row_examples(
    row: OutputRow, renderer_factory, samples: str, stats: dict, max_length: int, image_path=None
) -> list[Example]:
    """One row -> its examples: per generation (samples.py) where asked and possible, else the row;
    none longer than max_length (token lists cut before they become tensors). A row with images keeps
    each sample's context for the engine (vl_samples.VlContext; `image_path`: stored file name -> path)."""
    images = any(m.images for m in row.messages or ())
    # A row with images trains from its messages even when it has token ids (api generate on SGLang):
    # the engine takes images only with messages (its chat API), and a sample must be the sequence the
    # engine renders, so the answer is the template's tokenization of its text, not the server's ids.
    tokens = bool(row.input_ids) and row.loss_mask is not None and not images
    stats["token_rows" if tokens else "template_rows"] += 1
    if tokens:
        pairs = S.token_generations(row, max_length) if samples == "per_generation" else None
        if pairs is None:
            return [Example(torch.tensor(row.input_ids), torch.tensor(row.loss_mask, dtype=torch.int64))]
        stats["generation_samples"] += len(pairs)
        return S.as_examples(pairs, Example)
    renderer = renderer_factory()
    tools = json.loads(row.tools) if row.tools else None
    messages = template_messages(row)
    if images:
        stats["image_rows"] += 1
        if image_path is None:
            raise ConfigError("a row holds images but the trainer was given no image store to read them from")
    if samples == "per_generation":
        pairs = S.template_generations(renderer, messages, tools, row.turns or [], max_length)
        if pairs is not None:
            stats["generation_samples"] += len(pairs)
            out = S.as_examples(pairs, Example)
            if images:  # turn i's sample is the rendering of messages[: i + 1] (samples.generation_turns)
                for ex, (i, thinking) in zip(out, S.generation_turns(messages, row.turns or []), strict=True):
                    ex.vl = context_for(messages[: i + 1], image_path, thinking=thinking)
            return out
    ex = renderer.encode(messages, tools, max_length)
    ex.vl = context_for(messages, image_path) if images else None
    return [ex]


def _cut_token_columns(table: pa.Table, max_length: int) -> pa.Table:
    """input_ids and loss_mask cut to max_length in Arrow, before any row becomes Python lists: a
    30M-token row would otherwise take gigabytes of Python ints to be cut to 8192 tokens anyway."""
    for name in ("input_ids", "loss_mask"):
        if name in table.column_names:
            i = table.column_names.index(name)
            table = table.set_column(i, name, pc.list_slice(table.column(name), 0, max_length))
    return table


def table_examples(
    table: pa.Table,
    renderer_factory,
    max_length: int,
    samples: str = "conversation",
    image_path: Callable[[str], str] | None = None,
) -> tuple[list[Example], dict]:
    """Rows of one output shard -> examples. renderer_factory() is only called if a row needs it.
    samples: "conversation" (one per row) or "per_generation" (one per answered turn, samples.py).
    image_path: a stored image's file name -> its path (RunLayout.image_path), for rows with images."""
    stats = {"rows": table.num_rows, "errors": 0, "token_rows": 0, "template_rows": 0, "no_loss": 0}
    stats.update(generation_samples=0, image_rows=0)
    examples = []
    # `images`: the messages' image parts (OUTPUT_SCHEMA_IMAGES), put back on them by output_rows
    cols = ("messages", "tools", "input_ids", "loss_mask", "error", "turns", "images")
    for row in output_rows(
        _cut_token_columns(table.select([c for c in cols if c in table.column_names]), max_length)
    ):
        if row.error:
            stats["errors"] += 1
            continue
        for ex in _row_examples(row, renderer_factory, samples, stats, max_length, image_path):
            ex = Example(ex.ids[:max_length].to(torch.int64), ex.mask[:max_length].to(torch.int64), ex.vl)
            if int(ex.mask.sum()) == 0 or ex.ids.numel() < 2:
                stats["no_loss"] += 1
                continue
            examples.append(ex)
    return examples, stats


def shuffled(examples: list[Example], seed: int, shard_id: int, epoch: int) -> list[Example]:
    order = list(range(len(examples)))
    random.Random(f"{seed}:{shard_id}:{epoch}").shuffle(order)
    return [examples[i] for i in order]


def collate(examples: list[Example], pad_id: int = 0, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """The batch padded to its longest example, or to `pad_to` tokens when given (a length bucket,
    lengths.py): pads sit after each example's tokens with loss_mask and attention_mask 0."""
    t = max(e.ids.numel() for e in examples)
    if pad_to is not None:
        if pad_to < t:
            raise ValueError(f"pad_to {pad_to} is shorter than the batch's longest example ({t} tokens)")
        t = pad_to
    ids = torch.full((len(examples), t), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(examples), t), dtype=torch.int64)
    attn = torch.zeros((len(examples), t), dtype=torch.int64)
    for i, e in enumerate(examples):
        n = e.ids.numel()
        ids[i, :n], mask[i, :n], attn[i, :n] = e.ids, e.mask, 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def pad_time(x: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """x [B, T, ...] with zeros appended along T up to t (None stays None): target states of a batch
    padded after they were computed, so the target never runs on pad tokens."""
    if x is None or x.shape[1] >= t:
        return x
    pad = x.new_zeros((x.shape[0], t - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], 1)


def rank_batches(examples: list[Example], batch_size: int, rank: int, world: int) -> tuple[list, int]:
    """This rank's batches (stride split) and the step count every rank runs (the longest share's)."""
    mine = examples[rank::world]
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    longest = -(-len(examples[0::world]) // batch_size) if examples else 0
    return batches, longest
