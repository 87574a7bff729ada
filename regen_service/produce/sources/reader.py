"""Reading one source's rows, in file order, as (row_index, row) pairs.

`path` sources: .json (a JSON array, or JSON lines despite the extension), .jsonl, .parquet,
relative to the mix file. `hf` sources: `datasets.load_dataset(**hf)` with local files only (e.g.
`{path: json, data_files: data/x.jsonl}`); relative data_files resolve against the mix folder.

A line that is not valid UTF-8 or not valid JSON, a row that is not an object, or one over the
source's bounds (`max_row_bytes`, `max_nesting_depth`: checked before a long line is even parsed, and
without recursion; binary values, i.e. images, are bounded by the mix's `images.max_image_bytes`
instead) is yielded as a `BadRow` (row_index, reason, raw text) so the producer quarantines
it and moves on; a file that cannot be read at all (including a `.parquet` that is not Parquet) raises
ConfigError naming the source, in one line. Normalizing rows is the normalizers' job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from regen_service.errors import ConfigError
from schemas.mix import MixSpec, SourceSpec


class BadRow(NamedTuple):
    row_index: int
    reason: str
    raw: str


def _not_object(i: int, value: Any) -> BadRow:
    kind = "null" if value is None else type(value).__name__
    return BadRow(i, f"row: expected a JSON object, got {kind}", json.dumps(value, ensure_ascii=False)[:4096])


def _too_long(i: int, size: int, limit: int, raw: str) -> BadRow:
    return BadRow(i, f"row: too long ({size} bytes > max_row_bytes {limit})", raw[:4096])


def _too_deep(i: int, limit: int, raw: str) -> BadRow:
    return BadRow(i, f"row: nested deeper than max_nesting_depth {limit}", raw[:4096])


def _row_bounds(i: int, value: Any, source: SourceSpec, raw: str = "") -> Any:
    """The row, or a BadRow if it is deeper or (roughly: strings and bytes) larger than the bounds.
    An explicit stack, so a 200k-deep row costs memory proportional to it and no recursion."""
    size, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, bytes):
            pass  # binary values are images (a Hugging Face Image column): max_image_bytes bounds them
        elif isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict | list | tuple):
            if depth > source.max_nesting_depth:
                return _too_deep(i, source.max_nesting_depth, raw)
            children = item.items() if isinstance(item, dict) else enumerate(item)
            for k, v in children:
                size += len(k) if isinstance(k, str) else 8
                stack.append((v, depth + 1))
        else:
            size += 8
        if size > source.max_row_bytes:
            return _too_long(i, size, source.max_row_bytes, raw)
    return value


def _json_lines(data: bytes, source: SourceSpec) -> Iterator[tuple[int, dict | BadRow]]:
    index = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue  # blank lines (a trailing newline, CRLF files) are not rows
        if len(line) > source.max_row_bytes:  # refused before decoding or parsing it
            raw = line[:4096].decode("utf-8", "replace")
            yield index, _too_long(index, len(line), source.max_row_bytes, raw)
            index += 1
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            yield (
                index,
                BadRow(index, f"row: invalid UTF-8 at byte {err.start} of the line", repr(line[:4096])),
            )
            index += 1
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            yield index, BadRow(index, f"row: not valid JSON ({err.msg} at char {err.pos})", text)
        except RecursionError:  # the C decoder's own depth guard, far below a 200k-deep row
            yield index, _too_deep(index, source.max_nesting_depth, text)
        else:
            yield index, _checked(index, value, source, text)
        index += 1


def _checked(i: int, value: Any, source: SourceSpec, raw: str = "") -> dict | BadRow:
    value = _row_bounds(i, value, source, raw)  # first: a deep non-object must not reach json.dumps
    if isinstance(value, BadRow | dict):
        return value
    return _not_object(i, value)


def _json_file(data: bytes, where: str, source: SourceSpec) -> Iterator[tuple[int, dict | BadRow]]:
    head = data.lstrip()[:1]
    if head != b"[":
        yield from _json_lines(data, source)
        return
    try:
        rows = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ConfigError(
            f"{where}: not a valid JSON array ({why}); fix the file or convert it to JSON lines"
        ) from None
    for i, value in enumerate(rows):
        yield i, _checked(i, value, source)


def _parquet(path: str) -> Iterator[tuple[int, dict | BadRow]]:
    import pyarrow.parquet as pq

    # Through a Python file object, as Storage.read_table does: pyarrow 26 aborts at interpreter exit
    # ("terminate called without an active exception") when a process mixes path reads and file-object reads.
    index = 0
    with open(path, "rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=8192):
            for row in batch.to_pylist():
                yield index, row
                index += 1


def hf_kwargs(mix: MixSpec, source: SourceSpec) -> dict:
    """load_dataset arguments with relative data_files (and a relative data_dir) made absolute."""
    kwargs = source.hf.model_dump(exclude_none=True)
    paths = mix.paths.of(source)
    if "data_files" in kwargs:
        kwargs["data_files"] = paths.data_files
    if isinstance(kwargs.get("data_dir"), str):
        kwargs["data_dir"] = paths.data_dir
    return kwargs


def _undecoded(feature):
    """The feature with every `Image` left undecoded: rows then hold `{bytes, path}` dicts, which the
    image reader checks itself (datasets would hand over PIL objects, decoded without our bounds)."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, datasets.List | datasets.Sequence):
        return type(feature)(_undecoded(feature.feature), length=feature.length)
    if isinstance(feature, dict):
        return {k: _undecoded(v) for k, v in feature.items()}
    return feature


def _hf(mix: MixSpec, source: SourceSpec) -> Iterator[tuple[int, dict | BadRow]]:
    import datasets

    kwargs = hf_kwargs(mix, source)
    try:
        ds = datasets.load_dataset(**kwargs)
        features = datasets.Features({k: _undecoded(v) for k, v in ds.features.items()})
        if features != ds.features:
            ds = ds.cast(features)
    except Exception as err:  # datasets raises many types; all mean "this source cannot be read"
        raise ConfigError(f"source {source.name!r}: load_dataset({kwargs}) failed: {err}") from err
    index = 0
    for batch in ds.iter(batch_size=4096):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            yield index, _row_bounds(index, dict(zip(columns, values, strict=True)), source)
            index += 1


def read_rows(mix: MixSpec, source: SourceSpec) -> Iterator[tuple[int, dict | BadRow]]:
    """Every row of the source in order; row_index counts rows (not lines) from 0."""
    if source.hf is not None:
        yield from _hf(mix, source)
        return
    path = mix.paths.of(source).path
    where = f"source {source.name!r} ({path})"
    if not Path(path).is_file():
        raise ConfigError(f"{where}: file not found; paths are relative to the mix file's folder")
    if path.endswith(".parquet"):
        import pyarrow as pa

        try:
            for index, row in _parquet(path):
                yield index, _row_bounds(index, row, source)
        except pa.ArrowInvalid as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"{where}: not a Parquet file ({first}); check the file or its extension"
            ) from None
        except OSError as err:
            raise ConfigError(f"{where}: cannot read parquet ({err})") from None
        return
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read ({err.strerror})") from None
    if path.endswith(".jsonl"):
        yield from _json_lines(data, source)
    else:
        yield from _json_file(data, where, source)
