"""A local Hugging Face tokenizer for the simulator, loaded without importing torch where possible.

A directory with `tokenizer.json` is read with the `tokenizers` library and its chat template is
rendered by transformers' own torch-free renderer, so prompt token counts match what SGLang's
`apply_chat_template` gives. Anything else (e.g. Kimi's tiktoken tokenizer with remote code) falls
back to `transformers.AutoTokenizer` (local files only, never a download; this imports torch where
it is installed). Code shipped in the folder (an `auto_map` in its configs) runs only with
`trust_remote_code` (`regen sim --trust-remote-code`); without it such a folder is refused with a
message naming the flag. The synthetic vocabulary and the tokenizer interface are in tokenize.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from regen_service.errors import ConfigError
from regen_service.sim.tokenize import IM_END, WORDS, SyntheticTokenizer, Tokenizer, word_weights

# transformers' clean_up_tokenization, applied when the tokenizer config asks for it
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


def _auto_map(root: Path) -> str | None:
    """The config file of `root` that asks for remote code (an `auto_map`), if any."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            conf = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(conf, dict) and conf.get("auto_map"):
            return name
    return None


class HFTokenizer:
    def __init__(self, path: str, *, trust_remote_code: bool = False) -> None:
        self.path = path
        self.trust_remote_code = trust_remote_code
        root = Path(path)
        if (root / "tokenizer.json").is_file():
            self._load_light(root)
        else:
            self._load_auto(path)
        end = self._token_id(IM_END)
        self.im_end_id = end if end is not None else self._eos_id
        self.media_pad_id = self._token_id("<|media_pad|>")

    def _load_light(self, root: Path) -> None:
        from tokenizers import Tokenizer

        self._tk = Tokenizer.from_file(str(root / "tokenizer.json"))
        conf_file = root / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: SGLang uses the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        self._template = template
        self._cleanup = bool(conf.get("clean_up_tokenization_spaces", False))
        self._specials = {
            k: (v["content"] if isinstance(v, dict) else v)
            for k, v in conf.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        eos = self._specials.get("eos_token")
        self._eos_id = self._tk.token_to_id(eos) if eos else None
        self._auto = None

    def _load_auto(self, path: str) -> None:
        from transformers import AutoTokenizer

        asks = _auto_map(Path(path))
        if asks and not self.trust_remote_code:
            raise ConfigError(
                f"the tokenizer at {path} ships Python code ({asks} has an auto_map); it runs only if you "
                "pass --trust-remote-code (do so only for a folder you trust, e.g. the target's own files)"
            )
        self._auto = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=self.trust_remote_code
        )
        self._eos_id = self._auto.eos_token_id

    def _token_id(self, token: str) -> int | None:
        if self._auto is not None:
            tid = self._auto.convert_tokens_to_ids(token)
            return None if tid is None or tid == self._auto.unk_token_id else tid
        return self._tk.token_to_id(token)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode(self, text: str) -> list[int]:
        if self._auto is not None:
            return list(self._auto.encode(text, add_special_tokens=False))
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._auto is not None:
            return self._auto.decode(ids, skip_special_tokens=False)
        text = self._tk.decode(ids, skip_special_tokens=False)
        if self._cleanup:
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text

    def filler(self, rng: random.Random, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            ids += self.encode(" " + " ".join(rng.choices(WORDS, cum_weights=word_weights(), k=n - len(ids))))
        return ids[:n]

    def render_chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> tuple[str, int]:
        if self._auto is not None:
            text = self._auto.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
            )
        else:
            from transformers.utils.chat_template_utils import render_jinja_template

            if not self._template:
                raise ValueError(f"the tokenizer at {self.path} has no chat template")
            rendered, _ = render_jinja_template(
                [messages], tools=tools or None, chat_template=self._template, add_generation_prompt=True,
                **(self._specials | kwargs),
            )  # fmt: skip
            text = rendered[0]
        return text, self.count(text)


def load_tokenizer(path: str | None, *, trust_remote_code: bool = False) -> Tokenizer:
    """The synthetic vocabulary, or the local Hugging Face tokenizer at `path` (HFTokenizer)."""
    if not path:
        return SyntheticTokenizer()
    return HFTokenizer(path, trust_remote_code=trust_remote_code)
