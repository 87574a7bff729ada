"""pyarrow schemas of the files a run writes: prompt shards, output shards, quarantine, the reuse map.

Every file carries SCHEMA_VERSION in its metadata (key b"regen.schema_version"); readers check it.
Output rows are typed in schemas.rows (OutputRow, Turn: fields are these columns); prompt shards
convert to and from PromptRecords in schemas.prompt_rows.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.media import IMAGE_PART

SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"regen.schema_version"
# A prompt shard holding images: PROMPT_SCHEMA plus an `images` column. Only such shards carry "2", so
# text-only shards keep their bytes and a regen that predates images refuses an image shard instead of
# reading it as text (it would drop every image silently). Readers take every version listed here.
IMAGES_SCHEMA_VERSION = "2"
READABLE_SCHEMA_VERSIONS = (SCHEMA_VERSION, IMAGES_SCHEMA_VERSION)

TOOL_CALL = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("name", pa.string()),
        ("tool_call_id", pa.string()),
    ]
)

_META = {SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode()}

PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("row_index", pa.int64()),
        ("messages", pa.list_(MESSAGE)),
        ("tools", pa.string()),  # JSON list of OpenAI function schemas, or null
        ("input_ids", pa.list_(pa.int32())),  # pretokenized passthrough only
        ("loss_mask", pa.list_(pa.int8())),
        ("num_dropped_parts", pa.int32()),
    ],
    metadata=_META,
)

# Image parts of the row's messages (schemas.media.IMAGE_PART: message index, character offset, hash, type, size).
PROMPT_SCHEMA_IMAGES = PROMPT_SCHEMA.append(pa.field("images", pa.list_(IMAGE_PART))).with_metadata(
    {SCHEMA_VERSION_KEY: IMAGES_SCHEMA_VERSION.encode()}
)

# One regenerated assistant turn: what the server returned for it, unchanged.
TURN = pa.struct(
    [
        ("message_index", pa.int32()),  # index of this assistant turn in `messages`
        ("text", pa.string()),  # raw text as generated (thinking included when the server sent it)
        ("output_ids", pa.list_(pa.int32())),  # api generate: the server's output_ids, as sent
        ("finish_reason", pa.string()),  # stop | length | tool_calls | abort
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("ttft_s", pa.float64()),
        ("decode_tok_s", pa.float64()),
        ("latency_s", pa.float64()),
        ("endpoint", pa.string()),
        ("attempts", pa.int32()),
        # api generate: the exact prompt this turn was generated from (one training sample per
        # generation): its length, and its ids unless they are the row's input_ids[:prompt_len]
        # (null there, so single-turn rows store their prompt once). Null in rows written before.
        ("prompt_len", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
    ]
)

OUTPUT_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("row_index", pa.int64()),
        ("messages", pa.list_(MESSAGE)),  # the regenerated conversation
        ("tools", pa.string()),
        ("turns", pa.list_(TURN)),
        # Token-exact sequence: pretokenized passthrough, or (api generate) the last request's prompt ids
        # followed by its output ids, with loss_mask 1 on every assistant output span found in it.
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("finish_reason", pa.string()),  # of the last turn
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),  # summed over turns
        ("endpoint", pa.string()),
        ("model", pa.string()),
        ("api", pa.string()),
        ("sampling_hash", pa.string()),
        ("regen_key", pa.string()),
        ("attempts", pa.int32()),
        ("latency_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("decode_tok_s", pa.float64()),
        ("error", pa.string()),  # null when the row was answered
        ("error_class", pa.string()),  # terminal_row | terminal_endpoint | retries_exhausted
        ("reused_from", pa.string()),  # run id the answer was reused from, or null
    ],
    metadata=_META,
)

# An output shard of a run whose prompts hold images: OUTPUT_SCHEMA plus the same `images` column as
# prompt shards (refs: message index, offset, hash, type, size; never bytes), schema version "2". Every
# output shard of such a run carries it (null on text-only rows), so `datasets` reads the run's shards
# as one table; a text-only run's shards are written exactly as before (version "1").
OUTPUT_SCHEMA_IMAGES = OUTPUT_SCHEMA.append(pa.field("images", pa.list_(IMAGE_PART))).with_metadata(
    {SCHEMA_VERSION_KEY: IMAGES_SCHEMA_VERSION.encode()}
)

QUARANTINE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("row_index", pa.int64()),
        ("reason", pa.string()),
        ("raw", pa.string()),  # the row as read, truncated to 4 KiB
    ],
    metadata=_META,
)

# runs/<run>/reuse.parquet: this run's prompt id -> the (run, shard) already holding its answer. No
# version metadata: written so since reuse began, and its bytes stay.
REUSE_SCHEMA = pa.schema([("prompt_id", pa.string()), ("from_run", pa.string()), ("from_shard", pa.int32())])
