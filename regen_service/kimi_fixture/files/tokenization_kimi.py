"""Kimi-K2.5's tokenizer, scaled down for tests: a slow (Python) tokenizer over tiktoken.

Fixture copy (regen's own code, written to the interface of the public `tokenization_kimi.py`; see
docs/kimi-k25.md). Like the real one it is `TikTokenTokenizer(PreTrainedTokenizer)`: BPE ranks in
`tiktoken.model` (base64 token, rank), Kimi's pre-tokenization pattern, 256 reserved special ids
right after the base vocabulary (named by `added_tokens_decoder`, the rest `<|reserved_token_N|>`),
tokens shown as byte-level unicode strings, and an `apply_chat_template` that turns `tools` into the
TypeScript-style `tools_ts_str` the template declares (left out when the encoder cannot read a schema,
so the template falls back to JSON). Being slow, it has no offset mapping.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from shutil import copyfile

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

from .tool_declaration_ts import encode_tools_to_typescript_style

logger = logging.getLogger(__name__)
VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
_MAX_CHARS = 400_000  # tiktoken's encode is chunked to bound its regex work


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _deep_sort(obj):
    if isinstance(obj, dict):
        return {k: _deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_deep_sort(x) for x in obj]
    return obj


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]  # noqa: RUF012 - transformers reads it here
    num_reserved_special_tokens = 256
    pat_str = "|".join(
        [
            r"""[\p{Han}]+""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    )

    def __init__(
        self,
        vocab_file,
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        added_tokens_decoder=None,
        **kwargs,
    ):
        self.vocab_file = vocab_file
        ranks = load_tiktoken_bpe(vocab_file)
        base = len(ranks)
        names = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(base, base + self.num_reserved_special_tokens)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=self.pat_str,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words = self.model.n_vocab
        self.byte_encoder = _bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder = {i: "".join(self.byte_encoder[b] for b in tok) for tok, i in ranks.items()}
        self.decoder.update({i: tok for tok, i in self.special_tokens.items()})
        self.encoder = {v: k for k, v in self.decoder.items()}
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    # --- the tiktoken path --------------------------------------------------------------------------
    def encode(self, text, allow_special_tokens=True, **kwargs):
        if kwargs:  # transformers' own path (add_special_tokens=..., truncation=...)
            return super().encode(text, **kwargs)
        ids = []
        for i in range(0, len(text), _MAX_CHARS):
            chunk = text[i : i + _MAX_CHARS]
            if allow_special_tokens:
                ids += self.model.encode(chunk, allowed_special="all")
            else:
                ids += self.model.encode(chunk, disallowed_special=())
        return ids

    def decode(self, token_ids, **kwargs):
        if kwargs:
            return super().decode(token_ids, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.model.decode(list(token_ids))

    # --- PreTrainedTokenizer hooks -------------------------------------------------------------------
    def _tokenize(self, text, **kwargs):
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token):
        return self.encoder.get(token, self.special_tokens.get(str(self.unk_token)))

    def _convert_id_to_token(self, index):
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens):
        text = "".join(tokens)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", "replace")

    @staticmethod
    def clean_up_tokenization(out_string):
        return out_string

    @property
    def vocab_size(self):
        return self.n_words

    def get_vocab(self):
        return dict(self.encoder)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        out = os.path.join(
            save_directory, (filename_prefix + "-" if filename_prefix else "") + "tiktoken.model"
        )
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(
        self, conversation, tools=None, tokenize=False, add_generation_prompt=True, thinking=True, **kwargs
    ):
        tools = _deep_sort(tools)
        if tools:
            # As the real tokenizer: a schema the encoder cannot read leaves tools_ts_str out, and
            # the template then declares the tools as compact JSON.
            try:
                kwargs["tools_ts_str"] = encode_tools_to_typescript_style(tools)
            except Exception as e:  # any encoder failure means the JSON form, as in the real one
                logger.warning("tools not declared TypeScript-style (%s); the template uses JSON", e)
        return super().apply_chat_template(
            conversation,
            tools=tools,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            **kwargs,
        )
