"""Durable progress inside one shard: every answered prompt survives a kill -9 of its worker.

On a local data root each holder of the shard appends one JSON line per finished row to its own
log under outputs/parts/shard-NNNNN/ with a single O_APPEND write, so a kill can at worst tear the
line being written (dropped on read, and that prompt asked again: it was in flight). On other fsspec
stores (no append) rows are buffered and flushed as small Parquet part files, each written atomically,
every `flush_rows` rows or `flush_interval_s` seconds. Either way `load()` returns the rows already
done so a redelivered shard skips them; turning them into the final shard is regen_service.work.shard_runner's job.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

import pyarrow as pa

from regen_service.state.storage import RunLayout
from schemas.rows import OutputRow, output_rows, output_table

log = logging.getLogger(__name__)


class ShardLog:
    def __init__(
        self,
        layout: RunLayout,
        shard_id: int,
        owner: str,
        *,
        flush_rows: int = 64,
        flush_interval_s: float = 1.0,
    ):
        self.layout = layout
        self.storage = layout.storage
        self.dir = layout.parts_dir(shard_id)
        self.owner = owner
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self._fd: int | None = None
        self._buffer: list[OutputRow] = []
        self._last_flush = time.monotonic()

    # --- reading ------------------------------------------------------------------------------------
    def load(self) -> dict[str, OutputRow]:
        """Rows already made durable by any holder of this shard, by prompt id (first one wins)."""
        done: dict[str, dict] = {}
        for path in self.storage.ls(self.dir):
            name = path.rsplit("/", 1)[1]
            if name.startswith(".tmp-"):
                continue
            if name.endswith(".jsonl"):
                rows = self._read_log(path)
            elif name.endswith(".parquet"):
                rows = output_rows(self.storage.read_table(path))
            else:
                continue
            for row in rows:
                done.setdefault(row.prompt_id, row)
        return done

    def _read_log(self, path: str) -> list[OutputRow]:
        rows = []
        for i, line in enumerate(self.storage.read_bytes(path).splitlines()):
            try:
                rows.append(OutputRow.from_record(json.loads(line)))
            except ValueError:
                # A line torn by a kill mid-write: that prompt was in flight and will be asked again.
                log.warning("dropping torn line %d of %s", i, path)
        return rows

    # --- writing ------------------------------------------------------------------------------------
    def append(self, row: OutputRow) -> None:
        if self.storage.is_local:
            if self._fd is None:
                self.storage.makedirs(self.dir)
                self._fd = os.open(
                    f"{self.dir}/{self.owner}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
                )
            os.write(
                self._fd,
                (json.dumps(row.to_record(), ensure_ascii=False, separators=(",", ":")) + "\n").encode(),
            )
            return
        self._buffer.append(row)
        if (
            len(self._buffer) >= self.flush_rows
            or time.monotonic() - self._last_flush >= self.flush_interval_s
        ):
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        table: pa.Table = output_table(self._buffer)
        self.storage.write_table_atomic(f"{self.dir}/part-{self.owner}-{uuid.uuid4().hex[:8]}.parquet", table)
        self._buffer = []
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.close()
        self.storage.remove(self.dir, recursive=True)
