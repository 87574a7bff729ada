"""Export a trainer checkpoint as a draft SGLang loads: model.safetensors + config.json, then validate.

Reads the trainer's contract (`checkpoints/step-NNNNNNNN/state.pt` holding `draft_state_dict`,
`draft_config`, `aux_layer_ids` as captured layer INPUTS, `target_num_layers`); the trainer itself is
someone else's. The files are written to a temporary sibling directory, validated with validate.py,
and only moved into place when validation passes, so a half-right draft never sits where a launch
script would pick it up. Names and config fields come from sglang_format.py.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from regen_service.draft import mla_format as mla
from regen_service.draft import sglang_format as fmt
from regen_service.draft.report import DraftReport
from regen_service.draft.validate import validate_draft
from regen_service.errors import ConfigError

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "keep")


class ExportRefused(ConfigError):
    """Validation found problems in the exported draft; `report` lists them."""

    def __init__(self, message: str, report: DraftReport, kept: Path | None = None):
        super().__init__(message)
        self.report = report
        self.kept = kept


def resolve_checkpoint(path: str | Path) -> Path:
    """A step dir, or the trainer's OUT dir / checkpoints dir (followed through `latest`)."""
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        if (candidate / "state.pt").is_file():
            return candidate
        latest = candidate / "latest"
        if latest.is_file():
            from regen_service.draft.checkpoint import latest_step

            step = latest_step(candidate)  # refuses a name leading outside the checkpoints folder
            if not (step / "state.pt").is_file():
                raise ConfigError(f"{latest} names {step.name!r} but {step}/state.pt does not exist")
            return step
    raise ConfigError(
        f"no checkpoint at {p}: pass a step directory holding state.pt, or the trainer's --out directory "
        "(its checkpoints/latest names the newest step)"
    )


def _load_state(step: Path) -> dict:
    # weights_only, no fallback: a planted pickle is refused (UnsafeCheckpointError), never run.
    from regen_service.draft.checkpoint import load_checkpoint

    return load_checkpoint(step / "state.pt", mmap=True)


def build_config(draft_config: dict, aux_inputs: list[int], engine: fmt.Engine = "sglang") -> dict:
    """The draft's config.json from the trainer's draft_config and the captured aux layer inputs, with
    the aux ids in `engine`'s convention (recorded under "regen" so validate-draft can tell them apart).
    A draft_config naming the MLA architecture (`architectures` or `draft_arch: "mla"`) gets the MLA
    draft's config (mla_format.build_config)."""
    is_mla = mla.is_mla(draft_config) or draft_config.get("draft_arch") == "mla"
    required = mla.REQUIRED_CONFIG_FIELDS if is_mla else fmt.REQUIRED_CONFIG_FIELDS
    missing = [k for k in required if draft_config.get(k) is None]
    if missing:
        raise ConfigError(f"checkpoint draft_config lacks {', '.join(missing)}; the trainer must record them")
    if is_mla:
        return _with_aux(mla.build_config(draft_config), aux_inputs, engine)
    cfg = {
        "architectures": [fmt.ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **fmt.DEFAULT_CONFIG_FIELDS,
    }
    for key in (*fmt.LAYER_CONFIG_FIELDS, "draft_vocab_size", "target_hidden_size", "rope_scaling"):
        if draft_config.get(key) is not None:
            cfg[key] = draft_config[key]
    cfg.setdefault("target_hidden_size", cfg["hidden_size"])
    cfg["tie_word_embeddings"] = False
    # EAGLE-3.1 flags and extra decoder layers, which SGLang 0.5.23 and vLLM 0.32 build from the config
    for key in ("fc_norm", "norm_before_fc", "norm_output"):
        if draft_config.get(key):
            cfg[key] = True
    cfg["num_hidden_layers"] = int(draft_config.get("num_hidden_layers") or 1)
    return _with_aux(cfg, aux_inputs, engine)


def _with_aux(cfg: dict, aux_inputs: list[int], engine: fmt.Engine) -> dict:
    cfg.setdefault("target_hidden_size", cfg["hidden_size"])
    cfg["eagle_config"] = {
        # Training captured layer INPUTS; SGLang's config names layer OUTPUTS and adds 1, vLLM does not.
        "eagle_aux_hidden_state_layer_ids": fmt.aux_inputs_to_config(aux_inputs, engine),
        "use_aux_hidden_state": True,
    }
    cfg["regen"] = {"engine": engine, "aux_layer_inputs": [int(i) for i in aux_inputs]}
    return cfg


def write_draft(
    out: Path, tensors: dict, cfg: dict, dtype: str = "bfloat16", metadata: dict | None = None
) -> None:
    """Write model.safetensors (float tensors cast to dtype; d2t int64, t2d bool) and config.json."""
    import torch
    from safetensors.torch import save_file

    target_dtype = None if dtype == "keep" else getattr(torch, dtype)
    clean = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        if name == "d2t":
            t = t.to(torch.int64)
        elif name == "t2d":
            t = t.to(torch.bool)
        elif target_dtype is not None and t.is_floating_point():
            t = t.to(target_dtype)
        clean[name] = t.contiguous()
    if dtype != "keep":
        cfg = {**cfg, "torch_dtype": dtype}
    out.mkdir(parents=True, exist_ok=True)
    save_file(clean, str(out / fmt.WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
    (out / fmt.CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def finalize(tmp: Path, out: Path, report: DraftReport, keep_failed: bool, what: str) -> None:
    """Move a validated draft into place, or refuse (removing it unless keep_failed)."""
    if not report.ok:
        kept = None
        if keep_failed:
            kept = tmp
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ExportRefused(
            f"{what} refused: {len(report.errors)} problem(s); nothing written to {out}", report, kept
        )
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ConfigError(f"{out} exists and is not empty; pass --overwrite or another --out")
    tmp.rename(out)


def prepare_out(out: Path, overwrite: bool) -> Path:
    """A temporary sibling of out (same filesystem, so the final rename is atomic)."""
    out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ConfigError(f"{out} exists and is not empty; pass --overwrite or another --out")
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    target: fmt.TargetInfo | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    keep_failed: bool = False,
    engine: fmt.Engine = "sglang",
) -> DraftReport:
    """Export for `engine` and validate; raises ExportRefused (files removed, or kept in a temp dir)."""
    step = resolve_checkpoint(ckpt)
    state = _load_state(step)
    for key in ("draft_state_dict", "draft_config", "aux_layer_ids", "target_num_layers"):
        if key not in state:
            raise ConfigError(f"{step}/state.pt lacks {key!r}: not a regen trainer checkpoint")
    tensors = {fmt.canonical_key(k): v for k, v in state["draft_state_dict"].items()}
    cfg = build_config(dict(state["draft_config"]), list(state["aux_layer_ids"]), engine)
    # the held-out split it was trained with, so `regen eval-draft --run RUN --draft DIR` scores exactly the
    # prompts the trainer never saw and scored (cli/evaldraft.recorded_split reads it back)
    split = state.get("train_config") or {}
    if split.get("eval_fraction") is not None:
        cfg["regen"].update(
            eval_fraction=float(split["eval_fraction"]), eval_seed=int(split.get("eval_seed") or 0)
        )
    if fmt.embedding_shared(cfg):
        tensors.pop("embed_tokens.weight", None)  # both engines use the target's embedding
    # else a draft narrower/wider than its target keeps the embedding it was trained with: SGLang's
    # set_embed does not share the target's then, and validation refuses a draft without one
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        # The identity map: vLLM refuses a d2t it did not allocate, SGLang reads its absence as identity.
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    if target is None:
        # No target config given: check against what the checkpoint says it was trained for.
        target = fmt.TargetInfo(
            cfg["target_hidden_size"],
            state["target_num_layers"],
            cfg["vocab_size"],
            source=f"{step}/state.pt",
        )
    out = Path(out)
    tmp = prepare_out(out, overwrite)
    write_draft(tmp, tensors, cfg, dtype, metadata={"regen_source": str(step)})
    report = validate_draft(tmp, target, engine)
    finalize(tmp, out.resolve(), report, keep_failed, "export")
    report.path = str(out)
    return report
