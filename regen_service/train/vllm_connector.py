"""Runs INSIDE a vLLM server: writes each request's captured hidden states to a file, on GPU or CPU.

vLLM 0.32's `extract_hidden_states` speculative method stores the residual stream entering the layers
named in `eagle_aux_hidden_state_layer_ids` into a cache-only attention layer, and
`ExampleHiddenStatesConnector` (distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py)
copies a finished request's slots out of that cache into `<shared_storage_path>/<request>.safetensors`
(`hidden_states` [T, layers, H], `token_ids` [T]), holding an exclusive flock on `<file>.lock` until the
write is done. Its copy uses CUDA streams, events and pinned memory only: on a CPU-only vLLM the copy
fails in its writer thread and the request still returns a `hidden_states_path` that never appears.
This subclass does the CPU copy synchronously and leaves the GPU path to vLLM's own code.

Loaded by vLLM through `--kv-transfer-config '{"kv_connector": "RegenHiddenStatesConnector",
"kv_connector_module_path": "regen_service.train.vllm_connector", ...}'` (deploy/launch_vllm.py builds
it). Imports vllm: never import it from regen itself. Reading the files is engine_target.py's job.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Copied:
    """Stands for the CUDA event the base class polls: a synchronous CPU copy is done at once."""

    def query(self) -> bool:
        return True


class RegenHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(
                {"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()},
                pending.filename,
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting on LOCK_SH
        self._req_copy_events[pending.req_id] = _Copied()
