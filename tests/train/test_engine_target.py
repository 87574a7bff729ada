"""The vLLM target backend's own pieces that need no engine: finding the head weights of a sharded
multimodal checkpoint (Kimi-K2.5 names), and reading a states file only once its writer let go."""

from __future__ import annotations

import fcntl
import json
import threading
import time

import torch
from safetensors.torch import save_file

from regen_service.train.engine_files import load_head_weights, read_state_file


def test_head_weights_of_a_sharded_multimodal_checkpoint(tmp_path):
    h, v = 8, 20
    shard1 = {
        "vision_tower.encoder.final_layernorm.weight": torch.full((4,), 9.0),
        "language_model.model.embed_tokens.weight": torch.ones(v, h),
        "language_model.model.layers.0.input_layernorm.weight": torch.full((h,), 5.0),
    }
    shard2 = {
        "language_model.model.norm.weight": torch.full((h,), 2.0),
        "language_model.lm_head.weight": torch.full((v, h), 3.0),
        "mm_projector.pre_norm.weight": torch.full((4,), 7.0),
    }
    save_file(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {k: "model-00001-of-00002.safetensors" for k in shard1}
    index.update({k: "model-00002-of-00002.safetensors" for k in shard2})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    w = load_head_weights(tmp_path)
    assert w["embed"].shape == (v, h) and float(w["embed"][0, 0]) == 1.0
    assert float(w["norm"][0]) == 2.0  # the text model's final norm, not the vision tower's or a layer's
    assert float(w["lm_head"][0, 0]) == 3.0


def test_tied_embeddings_use_the_embedding_as_head(tmp_path):
    save_file({"model.embed_tokens.weight": torch.ones(5, 4), "model.norm.weight": torch.ones(4)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    w = load_head_weights(tmp_path)
    assert torch.equal(w["lm_head"], w["embed"])


def test_a_states_file_is_read_only_after_its_writer_releases_the_lock(tmp_path):
    path = str(tmp_path / "req.safetensors")
    lock_fd = open(path + ".lock", "w")  # noqa: SIM115 - held across the thread below
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the engine holds it while it writes

    def writer():
        time.sleep(0.3)
        save_file({"hidden_states": torch.ones(3, 4, 2), "token_ids": torch.arange(3)}, path)
        lock_fd.close()

    threading.Thread(target=writer).start()
    t0 = time.monotonic()
    data = read_state_file(path, tmp_path)
    assert time.monotonic() - t0 >= 0.25 and data["hidden_states"].shape == (3, 4, 2)
    assert not (tmp_path / "req.safetensors").exists() and not (tmp_path / "req.safetensors.lock").exists()
