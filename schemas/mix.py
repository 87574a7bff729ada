"""The dataset mix: what to regenerate, against which target, with which settings.

A mix is a YAML file validated once (extra keys are errors, so a typo never silently means "default").
`load_mix` turns pydantic's errors into lines that name the field and what it accepts, and resolves
every relative path once against the mix file's folder (`MixSpec.paths`, beside the fields as written:
the run id hashes those, so a moved mix folder keeps its id). Reading the
datasets the mix names is the sources' job (regen_service.produce.sources), not this module's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.media import ImagesSpec
from schemas.yamlfile import YamlRefused, load_yaml

Api = Literal["chat", "generate"]
Turns = Literal["all", "last"]
Thinking = Literal["keep", "strip", "off"]
Format = Literal["sharegpt", "messages", "instruction", "prompt_response", "pretokenized"]

NAME_PATTERN = r"^[a-z0-9_-]+$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetSpec(_Strict):
    model: str = Field(min_length=1, description="served model name; must match what the endpoint reports")
    api: Api = "chat"
    tokenizer: str | None = Field(
        default=None,
        description="local tokenizer path; required for api: generate (chat template client side)",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="allow the tokenizer folder's own Python code (auto_map, e.g. Kimi-K2.5's "
        "tokenization_kimi.py) to run when regen loads it; never on unless set",
    )

    @model_validator(mode="after")
    def _generate_needs_tokenizer(self) -> TargetSpec:
        if self.api == "generate" and not self.tokenizer:
            raise ValueError(
                "api: generate builds input_ids client side and needs target.tokenizer "
                "(a local path to the target's tokenizer); set it, or use api: chat"
            )
        return self


class SamplingSpec(_Strict):
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_new_tokens: int = Field(default=16384, ge=1)
    seed: int | None = None

    def settings_hash(self) -> str:
        """Short hash of the sampling settings; part of what makes an answer reusable."""
        blob = json.dumps(self.model_dump(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class RegenerateSpec(_Strict):
    turns: Turns = "all"
    thinking: Thinking = "keep"


class HFSourceSpec(_Strict):
    """Arguments for datasets.load_dataset: an allow-list, nothing else passes through.

    Only options that select local data are accepted; anything that could run code is refused:
    `trust_remote_code` by name (with a message saying why), dataset scripts by the `datasets>=4`
    floor (script support was removed), and every other load_dataset keyword (features, download
    and cache settings, builder kwargs) as an unknown field.
    """

    path: str = Field(min_length=1, description="a builder name (json, parquet, csv) or a local folder")
    name: str | None = Field(default=None, description="the dataset configuration")
    split: str = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    data_dir: str | None = None
    revision: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_remote_code(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trust_remote_code" in data:
            raise ValueError(
                "trust_remote_code is refused: a source never runs code from a dataset repository; "
                "convert the dataset to json/jsonl/parquet files and point `path` (or hf: {path: json, "
                "data_files: ...}) at them. Allowed hf options: path, name, split, data_files, data_dir, "
                "revision"
            )
        return data


# Bounds on one row, checked while the source is read (a row over them is quarantined with the
# reason). Kimi-K2.5's 256K-token context is about 1 MB of text: 4 MiB is far beyond any prompt it
# can answer while keeping a planted 50 MB row from being tokenized at all.
DEFAULT_MAX_ROW_BYTES = 4 << 20
DEFAULT_MAX_NESTING_DEPTH = 64


class SourceSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    path: str | None = Field(default=None, description=".json, .jsonl or .parquet; relative to the mix file")
    hf: HFSourceSpec | None = None
    format: Format
    max_samples: int | None = Field(default=None, ge=1)
    fields: dict[str, str] = Field(
        default_factory=dict, description="renames: {canonical_field: dataset_field}"
    )
    max_row_bytes: int = Field(
        default=DEFAULT_MAX_ROW_BYTES, ge=1, description="a longer row is quarantined as too long"
    )
    max_nesting_depth: int = Field(
        default=DEFAULT_MAX_NESTING_DEPTH, ge=2, le=1000, description="deeper JSON is quarantined"
    )

    @model_validator(mode="after")
    def _one_location(self) -> SourceSpec:
        if (self.path is None) == (self.hf is None):
            raise ValueError(
                f"source {self.name!r}: give exactly one of `path` (a local file) or `hf` (load_dataset args)"
            )
        if self.path is not None and not self.path.endswith((".json", ".jsonl", ".parquet")):
            raise ValueError(
                f"source {self.name!r}: path must end in .json, .jsonl or .parquet, got {self.path!r}"
            )
        return self


DataFiles = str | list[str] | dict[str, str | list[str]] | None


class SourcePaths(_Strict):
    """One source's file locations, absolute (URLs pass through): `path`, or hf's data_files / data_dir."""

    path: str | None = None
    data_files: DataFiles = None
    data_dir: str | None = None


class MixPaths(_Strict):
    """Every path a mix names, resolved once against the mix file's folder (`MixSpec.paths`)."""

    tokenizer: str | None = None
    sources: dict[str, SourcePaths] = Field(default_factory=dict)  # by source name

    def of(self, source: SourceSpec) -> SourcePaths:
        return self.sources[source.name]


class MixSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="lowercase letters, digits, '_' and '-'")
    target: TargetSpec
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    regenerate: RegenerateSpec = Field(default_factory=RegenerateSpec)
    shard_size: int = Field(default=256, ge=1, le=100_000)
    seed: int = 0
    sources: list[SourceSpec] = Field(min_length=1)
    # image bounds (schemas.media.ImagesSpec); None means the defaults, and leaves the run id of a mix
    # that does not say `images:` what it was before images existed (identity_dict)
    images: ImagesSpec | None = None
    # where relative paths resolve; set by load_mix, not by the YAML
    base_dir: str | None = Field(default=None, exclude=True)
    _paths: MixPaths | None = PrivateAttr(default=None)

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, sources: list[SourceSpec]) -> list[SourceSpec]:
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"source names must be unique; repeated: {dupes}")
        return sources

    def resolve(self, relative: str) -> str:
        """A path from the mix, made absolute against the mix file's folder (URLs pass through)."""
        if "://" in relative or Path(relative).is_absolute() or self.base_dir is None:
            return relative
        return str(Path(self.base_dir) / relative)

    @property
    def paths(self) -> MixPaths:
        """The mix's paths made absolute, resolved once (by parse_mix, at load); the fields keep what
        the file says, so the run id (a hash of them) does not depend on where the mix lies."""
        return self._paths or self.resolve_paths()

    def resolve_paths(self) -> MixPaths:
        self._paths = MixPaths(
            tokenizer=self.resolve(self.target.tokenizer) if self.target.tokenizer else None,
            sources={s.name: self._source_paths(s) for s in self.sources},
        )
        return self._paths

    def _source_paths(self, source: SourceSpec) -> SourcePaths:
        if source.hf is None:
            return SourcePaths(path=self.resolve(source.path) if source.path else None)
        data_dir = source.hf.data_dir
        return SourcePaths(
            data_files=self._resolve_files(source.hf.data_files),
            data_dir=self.resolve(data_dir) if isinstance(data_dir, str) else data_dir,
        )

    def _resolve_files(self, files: DataFiles) -> DataFiles:
        if isinstance(files, str):
            return self.resolve(files)
        if isinstance(files, list):
            return [self.resolve(f) for f in files]
        if isinstance(files, dict):
            return {k: self._resolve_files(v) for k, v in files.items()}
        return files

    @property
    def image_bounds(self) -> ImagesSpec:
        return self.images or ImagesSpec()

    def identity_dict(self) -> dict:
        """What the run id hashes: the mix as JSON, without `images` when the mix does not set it."""
        d = self.model_dump(mode="json")
        if d.get("images") is None:
            d.pop("images", None)
        return d

    def regen_key(self) -> str:
        """What makes two answers interchangeable: model, api, sampling and regeneration settings."""
        blob = json.dumps(
            {
                "model": self.target.model,
                "api": self.target.api,
                "sampling": self.sampling.model_dump(),
                "regenerate": self.regenerate.model_dump(),
            },
            sort_keys=True,
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


class MixError(ValueError):
    """A mix file that cannot be used; the message lists every problem with its field path."""


def format_validation_error(err: ValidationError, where: str) -> str:
    lines = [f"{where}: {err.error_count()} problem(s) in the mix:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling (see the mix reference in the README)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def parse_mix(data: Any, *, where: str = "mix", base_dir: str | None = None) -> MixSpec:
    if not isinstance(data, dict):
        raise MixError(
            f"{where}: the mix must be a YAML mapping with name, target, sources; got {type(data).__name__}"
        )
    try:
        mix = MixSpec.model_validate(data)
    except ValidationError as err:
        raise MixError(format_validation_error(err, where)) from None
    mix.base_dir = base_dir
    mix.resolve_paths()  # every path, once
    return mix


def load_mix(path: str | Path) -> MixSpec:
    """Read and validate a mix file; relative source paths resolve against its folder."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise MixError(f"{p}: cannot read the mix file ({err.strerror})") from None
    try:
        data = load_yaml(text, what="a mix file")
    except YamlRefused as err:
        raise MixError(f"{p}: {err}") from None
    return parse_mix(data, where=str(p), base_dir=str(p.resolve().parent))
