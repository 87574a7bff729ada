"""A run's held-out prompts read back from its prompt shards, as the target was asked them.

Which prompts are held out is schemas.heldout's rule (a hash of seed and prompt id); this module only
reads the run's prompt shards (paths from RunLayout, shard list from the manifest) and keeps the rows
that rule holds out, grouped by their `source`. A prompt is the row's messages up to its last user turn
(the turn the target answered), in the "template" form the chat API takes, with the row's tools.
Rows without messages (pretokenized passthrough) or without a user turn are skipped and counted.
Sending the prompts and measuring the draft is `regen eval-draft`'s (regen_service.deploy.evaldraft).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from regen_service.state.runinfo import load_manifest, load_run_mix
from regen_service.state.storage import RunLayout
from schemas.conversation import Message
from schemas.heldout import HeldOutSplit


@dataclass
class HeldOutPrompts:
    by_source: dict[str, list[dict]]  # source -> [{"prompt_id", "messages", "tools"?}], shard order
    sources: list[str]  # every source of the run, held-out prompts or not
    temperature: float | None  # the run's sampling temperature (its mix)
    num_skipped: int = 0  # held-out rows with no chat prompt to send
    num_rows: int = 0  # rows read
    missing: list[str] = field(default_factory=list)  # sources with no held-out prompt


def prompt_messages(messages: list[dict]) -> list[dict] | None:
    """The stored ("arrow") messages up to and including the last user turn, in "template" form."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is None:
        return None
    return [Message.from_dict(m).to_dict("template") for m in messages[: last_user + 1]]


def load_held_out(
    layout: RunLayout, split: HeldOutSplit, max_per_source: int | None = None
) -> HeldOutPrompts:
    """The run's held-out prompts per source (at most max_per_source each, the first in shard order)."""
    manifest = load_manifest(layout)
    try:
        temperature = load_run_mix(layout).sampling.temperature
    except (OSError, ValueError):
        temperature = None
    out = HeldOutPrompts(by_source={}, sources=sorted(manifest.sources), temperature=temperature)
    for shard in sorted(manifest.shards, key=lambda s: s.shard_id):
        table = layout.storage.read_table(layout.prompt_shard(shard.shard_id))
        cols = table.select(["prompt_id", "source", "messages", "tools"]).to_pylist()
        out.num_rows += len(cols)
        for row in cols:
            if not split.holds_out(row["prompt_id"]):
                continue
            kept = out.by_source.setdefault(row["source"], [])
            if max_per_source is not None and len(kept) >= max_per_source:
                continue
            messages = prompt_messages(row["messages"] or [])
            if messages is None:
                out.num_skipped += 1
                continue
            item = {"prompt_id": row["prompt_id"], "messages": messages}
            if row["tools"]:
                item["tools"] = json.loads(row["tools"])
            kept.append(item)
    out.by_source = {s: rows for s, rows in sorted(out.by_source.items()) if rows}
    out.missing = [s for s in out.sources if s not in out.by_source]
    return out
