"""The contract layer of regen: pydantic models and pyarrow schemas shared by every process.

Producers, workers, the trainer and operators' tools agree on these shapes and nothing else.
This package imports pydantic, pyarrow and the standard library only (no celery, httpx or torch),
so that any process can read a run's files without pulling in the service.
"""

from schemas.conversation import (
    Conversation,
    Message,
    MessageForm,
    PromptRecord,
    Role,
    ToolCall,
    compute_prompt_id,
)
from schemas.media import ImageRef, ImagesSpec
from schemas.mix import (
    HFSourceSpec,
    MixSpec,
    RegenerateSpec,
    SamplingSpec,
    SourceSpec,
    TargetSpec,
    load_mix,
)
from schemas.prompt_rows import prompt_row, prompts_from_table
from schemas.records import RunManifest, ShardDoneEvent, SourceStats
from schemas.rows import OutputRow, Turn, output_rows, output_table
from schemas.tables import (
    OUTPUT_SCHEMA,
    OUTPUT_SCHEMA_IMAGES,
    PROMPT_SCHEMA,
    QUARANTINE_SCHEMA,
    SCHEMA_VERSION,
)

__all__ = [
    "OUTPUT_SCHEMA",
    "OUTPUT_SCHEMA_IMAGES",
    "PROMPT_SCHEMA",
    "QUARANTINE_SCHEMA",
    "SCHEMA_VERSION",
    "Conversation",
    "HFSourceSpec",
    "ImageRef",
    "ImagesSpec",
    "Message",
    "MessageForm",
    "MixSpec",
    "OutputRow",
    "PromptRecord",
    "RegenerateSpec",
    "Role",
    "RunManifest",
    "SamplingSpec",
    "ShardDoneEvent",
    "SourceSpec",
    "SourceStats",
    "TargetSpec",
    "ToolCall",
    "Turn",
    "compute_prompt_id",
    "load_mix",
    "output_rows",
    "output_table",
    "prompt_row",
    "prompts_from_table",
]
