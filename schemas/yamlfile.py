"""The one YAML reader for every file regen reads (the mix, train.yaml): safe, no aliases, bounded depth.

`yaml.safe_load` runs no code but still expands anchors and aliases: a few hundred bytes of aliases of
aliases ("billion laughs") become gigabytes once anything walks the result (pydantic's error text for a
train.yaml spent 112 s and 5.7 GB), and a deeply nested document ends in RecursionError. regen's files
never need either, so both are refused at the first offending event with a one-line YamlRefused naming
the line. What the document must hold is the caller's schema's business, not this module's.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 64  # nested mappings/lists; the deepest real file (a mix's source options) uses about 5


class YamlRefused(ValueError):
    """A YAML document regen will not read (an alias, too deep, or not YAML); the message says why."""


class _Loader(yaml.SafeLoader):
    what = "this file"

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YamlRefused(
                f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not allowed in "
                f"{self.what}; write the value out in full"
            )
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlRefused(
                    f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep; {self.what} never "
                    "needs that: write its fields out plainly"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str, *, what: str = "this file") -> Any:
    """The document in `text`; `what` names the file in messages ("a mix file", "train.yaml")."""
    loader = _Loader(text)
    loader.what = what
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise YamlRefused(f"not valid YAML: {' '.join(str(err).split())}") from None
    finally:
        loader.dispose()
