"""The data root: where a run's files live, and how they are written so that readers never see half a file.

Storage is the truth of a run (the ledger in Redis is a cache of it). The layout under the data root:

    runs/<run_id>/mix.yaml                    the mix as given
    runs/<run_id>/mix.json                    the mix with every path made absolute (runinfo)
    runs/<run_id>/manifest.json               RunManifest (shards, per-source counts)
    runs/<run_id>/prompts/shard-00000.parquet prompt shards (PROMPT_SCHEMA)
    runs/<run_id>/quarantine.parquet          rows that could not be normalized, with reasons
    runs/<run_id>/images/<sha256>.<ext>       each distinct image of the prompts, once (png|jpg|gif|webp)
    runs/<run_id>/reuse.parquet               prompt id -> (run, shard) already answering it (reuse)
    runs/<run_id>/outputs/shard-00000.parquet final output shards (OUTPUT_SCHEMA)
    runs/<run_id>/outputs/parts/shard-00000/part-<ts>-<n>.parquet   durable progress inside a shard

Every file is written under a temporary name in the same folder and renamed into place on a local or
shared file system. On object stores (S3 and its kin: no rename, a "move" is a copy and a delete) it
is written straight to its key: one PUT, and S3 makes an object visible whole or not at all ("updates
to a single key are atomic ... never partial or corrupt data", the AWS S3 consistency model), so a
worker killed mid-write leaves nothing, not half a shard. What to write is the caller's business.
`check_data_root` is the preflight every command runs before it works: one clear line, nothing written.

Ids and paths from outside (a CLI argument, a Celery message, a directory listing) are untrusted:
`check_run_id` is the one validator of run ids (the producer's own pattern: the mix name's characters,
`<name>-<12 hex>`), RunLayout refuses any other, and `Storage.path` refuses a part that could leave
the data root (`..`, `.`, a separator, an absolute path), so no id can make a worker write elsewhere.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from regen_service.errors import ConfigError, DataRootUnreachableError
from schemas.tables import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, SCHEMA_VERSION_KEY

# What run_id_for produces: the mix name (schemas.mix NAME_PATTERN) + "-" + 12 hex digits. Tests and
# older runs use shorter names of the same characters, so the suffix is not required; no '.' or '/'.
RUN_ID_PATTERN = re.compile(r"[a-z0-9_-]{1,128}")
# What output_shard writes: five digits, more from shard 100000 on.
_OUTPUT_NAME = re.compile(r"shard-(\d{5,9})\.parquet")
_IMAGE_NAME = re.compile(r"[0-9a-f]{64}\.(png|jpg|gif|webp)")

log = logging.getLogger(__name__)


class BadRunIdError(ConfigError):
    """A run id that is not one the producer could have made (and could name a path elsewhere)."""


def check_run_id(run_id: object) -> str:
    """`run_id` if the producer could have made it; else BadRunIdError saying what a run id looks like."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise BadRunIdError(
            f"invalid run id {str(run_id)[:200]!r}: a run id is the mix name and a hash as `regen enqueue` "
            "prints it (lowercase letters, digits, '_' and '-', at most 128 characters, e.g. "
            "my-mix-0123456789ab); `regen status` lists the runs"
        )
    return run_id


def _check_part(part: str) -> str:
    if not part or part in (".", "..") or "/" in part or "\\" in part or "\x00" in part:
        raise ConfigError(f"refused storage path part {part!r}: it would leave the data root")
    return part


# Stores where one PUT makes an object appear whole: written straight to the final key.
_WHOLE_OBJECT_PUT = {"s3", "s3a", "gs", "gcs", "memory"}


class Storage:
    """A thin wrapper over one fsspec filesystem rooted at the data root."""

    def __init__(self, root: str):
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.root = self.root.rstrip("/")
        protocols = set(self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.is_local = "file" in protocols
        self.whole_object_put = bool(protocols & _WHOLE_OBJECT_PUT)
        self.url = root

    def path(self, *parts: str) -> str:
        """root/part/part...: each part one plain name, so the result always lies under the root."""
        return "/".join([self.root, *(_check_part(p) for p in parts)])

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def ls(self, path: str) -> list[str]:
        if not self.fs.exists(path):
            return []
        return sorted(self.fs.ls(path, detail=False))

    def write_bytes_atomic(self, path: str, data: bytes) -> None:
        if self.whole_object_put:  # visible whole or not at all (module docstring); no folders either
            self.fs.pipe_file(path, data)
            return
        parent = path.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[1]}"
        if self.is_local:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def write_json_atomic(self, path: str, obj) -> None:
        self.write_bytes_atomic(path, json.dumps(obj, indent=2, sort_keys=True).encode())

    def read_json(self, path: str):
        return json.loads(self.read_bytes(path))

    def write_table_atomic(self, path: str, table: pa.Table) -> None:
        meta = dict(table.schema.metadata or {})
        # a table that names its version keeps it (an image prompt shard says "2"); others say the default
        meta.setdefault(SCHEMA_VERSION_KEY, SCHEMA_VERSION.encode())
        table = table.replace_schema_metadata(meta)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        self.write_bytes_atomic(path, buf.getvalue())

    def read_table(self, path: str) -> pa.Table:
        with self.fs.open(path, "rb") as f:
            # One thread: Arrow's CPU pool, once started, aborts a process that exits soon after
            # ("terminate called without an active exception", SIGABRT; apache/arrow#34314, open). A
            # `regen enqueue --strict` that read the quarantine and failed hit it 3 times in 8.
            table = pq.read_table(f, use_threads=False)
        version = (table.schema.metadata or {}).get(SCHEMA_VERSION_KEY, b"?").decode()
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(
                f"{path}: schema version {version}, this regen reads {', '.join(READABLE_SCHEMA_VERSIONS)}; "
                "use the regen release that wrote it"
            )
        return table

    def remove(self, path: str, recursive: bool = False) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=recursive)


def check_data_root(url: str) -> None:
    """DataRootUnreachableError (one line: what, why, how to fix) unless the data root answers a
    listing. Local paths pass (they are made on first write). Reads only: nothing is written."""
    if "://" not in url or url.startswith("file://"):
        return
    fix = ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), AWS_ENDPOINT_URL for an "
           "S3-compatible store, and the bucket in REGEN_DATA_ROOT")  # fmt: skip
    try:
        storage = Storage(url)
        bucket, _, key = storage.root.partition("/")
        if hasattr(storage.fs, "call_s3"):  # s3fs: one LIST of at most one key under the root
            storage.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)
        else:
            storage.fs.ls(bucket)
    except ImportError as e:  # fsspec names the package a protocol needs
        raise DataRootUnreachableError(f"data root {url}: {e} (for s3:// install regen[s3])") from None
    except FileNotFoundError as e:
        if _s3_error_code(e) != "NoSuchBucket":  # a 404 without S3's error body: no S3 API answered
            raise DataRootUnreachableError(
                f"data root {url}: the endpoint answered 404 without an S3 error (is the endpoint an S3 API?); {fix}"
            ) from None
        raise DataRootUnreachableError(
            f"data root {url}: the bucket {url.split('://', 1)[1].split('/', 1)[0]!r} does not exist; {fix}"
        ) from None
    except PermissionError as e:
        raise DataRootUnreachableError(f"data root {url}: access refused ({_first_line(e)}); {fix}") from None
    except Exception as e:  # an endpoint that is no object store answers anything at all
        raise DataRootUnreachableError(
            f"data root {url} cannot be listed ({type(e).__name__}: {_first_line(e)}); is the endpoint an S3 "
            f"API? {fix}"
        ) from None


def _s3_error_code(e: BaseException) -> str | None:
    """The S3 error code (NoSuchBucket, AccessDenied, ...) s3fs's error carries from botocore, if any."""
    response = getattr(e.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run's files: the one place that names them (readers and writers ask here)."""

    storage: Storage
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def run_dir(self) -> str:
        return self.storage.path("runs", self.run_id)

    @property
    def mix_path(self) -> str:
        return f"{self.run_dir}/mix.yaml"

    @property
    def manifest_path(self) -> str:
        return f"{self.run_dir}/manifest.json"

    @property
    def resolved_mix_path(self) -> str:
        return f"{self.run_dir}/mix.json"

    @property
    def reuse_path(self) -> str:
        return f"{self.run_dir}/reuse.parquet"

    @property
    def quarantine_path(self) -> str:
        return f"{self.run_dir}/quarantine.parquet"

    @property
    def outputs_dir(self) -> str:
        return f"{self.run_dir}/outputs"

    @property
    def images_dir(self) -> str:
        return f"{self.run_dir}/images"

    def image_path(self, file_name: str) -> str:
        """runs/<run>/images/<sha256>.<ext>: one file per distinct image (schemas.media.ImageRef.file_name)."""
        if not _IMAGE_NAME.fullmatch(file_name):
            raise ConfigError(
                f"refused image file name {file_name[:100]!r}: expected <sha256>.png|jpg|gif|webp"
            )
        return f"{self.images_dir}/{file_name}"

    def prompt_shard(self, shard_id: int) -> str:
        return f"{self.run_dir}/prompts/shard-{shard_id:05d}.parquet"

    def output_shard(self, shard_id: int) -> str:
        return f"{self.outputs_dir}/shard-{shard_id:05d}.parquet"

    def parts_dir(self, shard_id: int) -> str:
        return f"{self.outputs_dir}/parts/shard-{shard_id:05d}"

    def output_shard_ids(self) -> set[int]:
        """Shards whose final output file exists: the completion markers (the names output_shard gives)."""
        done = set()
        for p in self.storage.ls(self.outputs_dir):
            name = p.rsplit("/", 1)[1]
            if m := _OUTPUT_NAME.fullmatch(name):
                done.add(int(m[1]))
            elif name.startswith("shard-") and name.endswith(".parquet"):
                # not a name output_shard gives (planted, or copied in by hand): never a completion marker
                log.warning("ignoring %s: not a shard file name (shard-NNNNN.parquet)", p)
        return done

    @staticmethod
    def list_runs(storage: Storage) -> list[str]:
        """Run ids found under the data root's runs/ (a planted folder whose name is no run id is skipped)."""
        names = [p.rsplit("/", 1)[1] for p in storage.ls(storage.path("runs"))]
        return [n for n in names if RUN_ID_PATTERN.fullmatch(n)]
