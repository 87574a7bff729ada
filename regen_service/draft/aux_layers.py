"""Which target layers a draft reads: the default three aux layer inputs, and a checked list of them.

The trainer captures these inputs (train/target.py, engine_target.py), its preflight checks them before
a run starts, and the vLLM launch names them again for the hidden-states connector; all three take the
rule from here so a draft trained with some ids is served with the same ones. The engines' own encoding
of the ids in config.json is sglang_format.py's (`aux_inputs_to_config`).
"""

from __future__ import annotations

from regen_service.draft import sglang_format as fmt
from regen_service.errors import ConfigError


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return fmt.default_aux_inputs(num_layers)


def checked_aux_layer_ids(aux_layer_ids: list[int] | None, num_layers: int) -> list[int]:
    """The layer inputs to capture (the default when None); refused unless three distinct, increasing
    inputs of the target's layers, so a draft trained here can be served with the same tensors."""
    if num_layers < 4:
        raise ConfigError(
            f"the target has {num_layers} layers; EAGLE-3 needs three distinct aux layers (>= 4)"
        )
    ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(num_layers)
    problem = fmt.aux_input_problem(ids, num_layers)
    if problem is not None:
        raise ConfigError(
            f"aux_layer_ids: {problem[1]}; set three distinct increasing ids in 1..{num_layers - 1}"
        )
    return ids
