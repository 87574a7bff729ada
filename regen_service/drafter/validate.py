"""Is this draft directory something the serving engine (SGLang, or vLLM) loads correctly? Every way it
could load silently wrong.

`validate_draft(dir, target, engine)` returns a report with ALL problems found (code, message, fix) and a
summary; it reads only the safetensors header plus the small `d2t`/`t2d` tensors, with numpy, so it
runs anywhere in a second. Callers: `regen validate-draft`, `regen export`, `regen convert-draft` and
the `regen launch-sglang` preflight. What SGLang expects is defined in sglang_format.py, not here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from regen_service.drafter import sglang_format as fmt

_NP_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_CONVERT_HINT = (
    "this is the vllm-project/speculators naming; run `regen convert-draft SRC --out DIR` to rewrite it in "
    "SGLang's format"
)


class Problem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    fix: str
    severity: Literal["error", "warning"] = "error"


class DraftReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    problems: list[Problem] = Field(default_factory=list)
    summary: dict = Field(default_factory=dict)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def add(self, code: str, message: str, fix: str, severity: str = "error") -> None:
        self.problems.append(Problem(code=code, message=message, fix=fix, severity=severity))


def _read_small_tensor(path: Path, entry: dict):
    import numpy as np

    dt = _NP_DTYPES.get(entry["dtype"])
    if dt is None:
        return None
    b, e = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(entry["data_start"] + b)
        return np.frombuffer(f.read(e - b), dtype=dt).reshape(entry["shape"])


def validate_draft(
    draft_dir: str | Path, target: fmt.TargetInfo | None = None, engine: fmt.Engine = "sglang"
) -> DraftReport:
    """All problems that would make `engine` refuse this draft or, worse, load it silently wrong."""
    d = Path(draft_dir)
    rep = DraftReport(path=str(d))
    cfg_path = d / fmt.CONFIG_FILE
    files = sorted(d.glob("*.safetensors"))
    if not d.is_dir():
        rep.add("not_found", f"{d} is not a directory", "pass the exported draft directory")
        return rep
    if not cfg_path.is_file():
        rep.add("config_missing", f"{cfg_path} does not exist", "export the draft with `regen export`")
        return rep
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        rep.add("config_invalid", f"{cfg_path} is not valid JSON ({e})", "re-export the draft")
        return rep
    if not files:
        rep.add(
            "weights_missing",
            f"no *.safetensors file in {d}",
            "write the weights as model.safetensors (`regen export` or `regen convert-draft` do)",
        )
        return rep
    header: dict[str, dict] = {}
    owner: dict[str, Path] = {}
    for f in files:
        for name, entry in fmt.read_safetensors_header(f).items():
            header[name] = entry
            owner[name] = f

    _check_config(rep, cfg, target)
    tensors = {fmt.canonical_key(k): v for k, v in header.items()}
    _check_keys(rep, cfg, tensors, engine)
    if all(k in cfg for k in fmt.REQUIRED_CONFIG_FIELDS):
        _check_shapes(rep, cfg, tensors, target)
        _check_vocab_map(rep, cfg, header, owner, target)
    _check_aux(rep, cfg, target, engine)
    rep.summary = _summary(cfg, header, files, target, engine)
    return rep


def _check_config(rep: DraftReport, cfg: dict, target: fmt.TargetInfo | None) -> None:
    archs = cfg.get("architectures") or []
    if archs != [fmt.ARCHITECTURE]:
        rep.add(
            "architecture",
            f"architectures is {archs!r}, not [{fmt.ARCHITECTURE!r}]: SGLang picks the model class from it, "
            "builds a different model and fails at load with KeyError 'midlayer.self_attn.qkv_proj.weight' "
            "(or, for an EAGLE-1 class, runs a draft that ignores the aux hidden states)",
            f'set "architectures": ["{fmt.ARCHITECTURE}"] in config.json (regen export writes it)',
        )
    missing = [k for k in fmt.REQUIRED_CONFIG_FIELDS if k not in cfg]
    if missing:
        rep.add(
            "config_fields",
            f"config.json lacks {', '.join(missing)}",
            "add them from the training config (regen export writes every field SGLang reads)",
        )
    if cfg.get("num_hidden_layers", 1) != 1:
        rep.add(
            "num_layers",
            f"num_hidden_layers is {cfg['num_hidden_layers']}: SGLang then builds extra decoder layers this "
            "draft has no weights for (they stay random)",
            'set "num_hidden_layers": 1 (an EAGLE-3 draft has one decoder layer)',
        )
    if cfg.get("tie_word_embeddings"):
        rep.add(
            "tied_embeddings",
            "tie_word_embeddings is true: SGLang then uses the (target's) embedding as lm_head over the full "
            "vocabulary and ignores lm_head.weight",
            'set "tie_word_embeddings": false',
        )
    if target is not None and "vocab_size" in cfg and int(cfg["vocab_size"]) != target.vocab_size:
        rep.add(
            "vocab_size",
            f"vocab_size is {cfg['vocab_size']} but the target's is {target.vocab_size}: SGLang sizes the "
            "embedding and the t2d map from it",
            f'set "vocab_size": {target.vocab_size} (the target\'s, not the draft vocabulary)',
        )
    if target is not None and cfg.get("target_hidden_size") not in (None, target.hidden_size):
        rep.add(
            "target_hidden_size",
            f"target_hidden_size is {cfg['target_hidden_size']} but the target's hidden size is "
            f"{target.hidden_size}",
            "this draft was trained for another target; train one against this target",
        )


def _check_keys(rep: DraftReport, cfg: dict, tensors: dict, engine: fmt.Engine) -> None:
    known = set(fmt.REQUIRED_KEYS) | set(fmt.OPTIONAL_KEYS)
    unknown = sorted(k for k in tensors if k not in known)
    if unknown:
        speculators = any(k.startswith("layers.") for k in unknown)
        shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
        rep.add(
            "unknown_keys",
            f"{len(unknown)} tensor(s) SGLang's loader would SKIP without a message: {shown}; the draft "
            "would run with those weights random",
            _CONVERT_HINT
            if speculators
            else "rename them to SGLang's names (midlayer.*, fc, norm, lm_head, d2t, t2d) or drop them",
        )
    if "fc.bias" in tensors and not cfg.get("bias"):
        rep.add(
            "fc_bias_skipped",
            'fc.bias is present but config.json has no `"bias": true`, so SGLang builds fc without a bias '
            "and skips it silently",
            'set "bias": true in config.json (or drop fc.bias if it is all zeros)',
        )
    # A draft over the whole target vocabulary needs no id map: vLLM then builds none and refuses a
    # `d2t` tensor at load (model_executor/models/llama_eagle3.py); SGLang reads an absent map as identity.
    identity = cfg.get("draft_vocab_size") is not None and cfg.get("draft_vocab_size") == cfg.get(
        "vocab_size"
    )
    if identity and engine == "vllm" and ("d2t" in tensors or "t2d" in tensors):
        rep.add(
            "vocab_map_identity",
            "draft_vocab_size equals vocab_size, so vLLM builds no draft-to-target map and fails to load "
            "the d2t/t2d tensors this draft carries",
            "drop d2t and t2d (`regen export --engine vllm` does), or train with a smaller draft_vocab_size",
        )
    for key in fmt.REQUIRED_KEYS:
        if key in tensors or (identity and key in ("d2t", "t2d")):
            continue
        if key == "d2t":
            rep.add(
                "d2t_missing",
                "d2t is missing: serving then maps draft ids to the FIRST draft_vocab_size target ids, "
                "nearly every draft token is wrong and acceptance collapses, silently",
                "export d2t (int64 offsets, target_id = i + d2t[i]) from the draft vocabulary used in "
                "training; `regen export` writes it from the checkpoint",
            )
        else:
            rep.add(
                "missing_key",
                f"required tensor {key} is missing: SGLang would leave it uninitialized",
                "re-export the draft (`regen export`), or convert it (`regen convert-draft`) if it has "
                "layers.0.* names",
            )


def _check_shapes(rep: DraftReport, cfg: dict, tensors: dict, target: fmt.TargetInfo | None) -> None:
    t_hidden = target.hidden_size if target else int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    for key, want in fmt.expected_shapes(cfg, t_hidden).items():
        if key not in tensors:
            continue
        got = tuple(tensors[key]["shape"])
        if got == want:
            continue
        if key == "fc.weight" and len(got) == 2 and got[1] != want[1]:
            rep.add(
                "fc_width",
                f"fc takes {got[1]} inputs but the target's hidden size is {t_hidden}, so the three "
                f"concatenated aux hidden states are {want[1]} wide",
                "train the draft against this target (or point --target-config at the target it was "
                f"trained for); fc.weight must be [hidden_size, 3 * {t_hidden}]",
            )
        elif key == "lm_head.weight" and len(got) == 2 and got[0] != want[0]:
            rep.add(
                "lm_head_rows",
                f"lm_head has {got[0]} rows but draft_vocab_size is {want[0]}",
                "set draft_vocab_size to the lm_head's row count (the draft vocabulary size used in training)",
            )
        elif key == "d2t":
            rep.add(
                "d2t_length",
                f"d2t has shape {list(got)} but draft_vocab_size is {want[0]}",
                "export d2t from the same draft vocabulary as lm_head (one offset per draft id)",
            )
        elif key == "t2d":
            rep.add(
                "t2d_length",
                f"t2d has shape {list(got)} but vocab_size (target vocabulary) is {want[0]}",
                "t2d must be a bool mask over the target vocabulary; re-export it",
            )
        else:
            rep.add(
                "shape_mismatch",
                f"{key} has shape {list(got)}, config.json implies {list(want)}",
                "make config.json's dims match the trained weights (regen export derives them from the "
                "checkpoint)",
            )


def _check_vocab_map(rep, cfg: dict, header: dict, owner: dict, target: fmt.TargetInfo | None) -> None:
    import numpy as np

    names = {fmt.canonical_key(k): k for k in header}
    vocab = target.vocab_size if target else int(cfg["vocab_size"])
    n_draft = int(cfg["draft_vocab_size"])
    hot = None
    if "d2t" in names:
        raw = names["d2t"]
        d2t = _read_small_tensor(owner[raw], header[raw])
        if d2t is None or d2t.dtype.kind not in "iu" or d2t.ndim != 1:
            rep.add(
                "d2t_dtype",
                f"d2t is {header[raw]['dtype']} {header[raw]['shape']}, not a 1-D integer tensor",
                "write d2t as int64 offsets (target_id = i + d2t[i])",
            )
        elif len(d2t) == n_draft:
            hot = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)
            bad = np.flatnonzero((hot < 0) | (hot >= vocab))
            if bad.size:
                rep.add(
                    "d2t_range",
                    f"d2t maps {bad.size} draft id(s) outside the target vocabulary [0, {vocab}) "
                    f"(first: draft id {bad[0]} -> {hot[bad[0]]})",
                    "d2t holds OFFSETS (target_id - draft_id), not target ids; rebuild it from the draft "
                    "vocabulary of this target's tokenizer",
                )
                hot = None
            elif len(np.unique(hot)) != len(hot):
                rep.add(
                    "d2t_duplicates",
                    "d2t maps several draft ids to the same target id",
                    "rebuild the draft vocabulary: each draft id must map to a distinct target id",
                )
    if hot is not None and "t2d" in names:
        raw = names["t2d"]
        t2d = _read_small_tensor(owner[raw], header[raw])
        if t2d is not None and t2d.ndim == 1 and len(t2d) == vocab:
            mask = t2d.astype(bool)
            if int(mask.sum()) != n_draft or not bool(mask[hot].all()):
                rep.add(
                    "t2d_mismatch",
                    f"t2d marks {int(mask.sum())} target ids but d2t maps to {n_draft} ids, "
                    f"{int((~mask[hot]).sum())} of which t2d does not mark",
                    "derive t2d from d2t: t2d[i + d2t[i]] = True for every draft id i, False elsewhere",
                )


def _check_aux(rep: DraftReport, cfg: dict, target: fmt.TargetInfo | None, engine: fmt.Engine) -> None:
    eagle = cfg.get("eagle_config") or {}
    ids = fmt.aux_ids(cfg)
    if eagle.get("use_aux_hidden_state") is False:
        rep.add(
            "aux_disabled",
            "eagle_config.use_aux_hidden_state is false: the target would not capture the aux layers",
            'set "use_aux_hidden_state": true',
        )
    exported_for = (cfg.get("regen") or {}).get("engine")
    if ids is not None and exported_for in fmt.ENGINES and exported_for != engine:
        rep.add(
            "aux_engine",
            f"config.json was exported for {exported_for}, whose aux-layer ids mean something else than "
            f"{engine}'s (SGLang captures the input of layer id+1, vLLM the input of layer id): served by "
            f"{engine}, the draft would read other layers than it was trained on",
            f"export the checkpoint again with `regen export CKPT --out DIR --engine {engine}`",
        )
    if ids is None:
        rep.add(
            "aux_default",
            "eagle_config.eagle_aux_hidden_state_layer_ids is not set: the engine captures the inputs of "
            "layers [2, L//2, L-3]; fine only if training captured exactly those",
            "write the ids used in training (`regen export` writes them in the engine's convention)",
            severity="warning",
        )
        return
    inputs = fmt.aux_config_to_inputs(ids, engine)
    n = target.num_layers if target is not None else max(inputs) + 1
    problem = fmt.aux_input_problem(inputs, n)
    if problem is None:
        return
    code, why = problem
    offset = inputs[0] - ids[0]
    if code == "aux_range":
        # Said in the config's own terms: that is the file the operator edits.
        lo, hi = 1 - offset, n - 1 - offset
        bad = [i for i in ids if not lo <= i <= hi]
        reads = "captures the input of layer id+1" if engine == "sglang" else "captures the input of layer id"
        why = f"aux layer ids {bad} are outside {lo}..{hi}: {engine} {reads}, one of the target's {n} layers"
    fix = "write the three distinct, increasing ids used in training"
    if target is not None:
        default = fmt.aux_inputs_to_config(fmt.default_aux_inputs(n), engine)
        fix += f" (the default for {n} layers is {default} in {engine}'s convention)"
    rep.add(code, f"eagle_aux_hidden_state_layer_ids {ids}: {why}", fix)


def _summary(cfg: dict, header: dict, files: list[Path], target: fmt.TargetInfo | None, engine: str) -> dict:
    import math

    ids = fmt.aux_ids(cfg)
    params = sum(
        math.prod(e["shape"]) for k, e in header.items() if fmt.canonical_key(k) not in ("d2t", "t2d")
    )
    return {
        "architecture": (cfg.get("architectures") or [None])[0],
        "hidden_size": cfg.get("hidden_size"),
        "intermediate_size": cfg.get("intermediate_size"),
        "num_attention_heads": cfg.get("num_attention_heads"),
        "num_key_value_heads": cfg.get("num_key_value_heads"),
        "target_hidden_size": cfg.get("target_hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "aux_layer_ids_config": ids,
        "aux_layer_inputs": fmt.aux_config_to_inputs(ids, engine) if ids is not None else None,
        "engine": engine,
        "parameters": params,
        "dtypes": sorted({e["dtype"] for e in header.values()}),
        "file_bytes": sum(f.stat().st_size for f in files),
        "target": target.as_dict() if target else None,
    }


def format_report(rep: DraftReport) -> str:
    """Human text: each problem with its fix, then the summary when loadable."""
    lines = []
    for p in rep.problems:
        lines.append(f"{p.severity.upper()} [{p.code}] {p.message}\n    fix: {p.fix}")
    if rep.ok:
        s = rep.summary
        lines.append(f"OK: {rep.path} loads as {s['architecture']}")
        lines.append(
            f"  hidden {s['hidden_size']}, intermediate {s['intermediate_size']}, heads "
            f"{s['num_attention_heads']}/{s['num_key_value_heads']}, target hidden {s['target_hidden_size']}"
        )
        lines.append(f"  vocab {s['vocab_size']} (target), draft vocab {s['draft_vocab_size']}")
        lines.append(
            f"  aux layers ({s['engine']}): config ids {s['aux_layer_ids_config']} = captured inputs "
            f"{s['aux_layer_inputs']}"
        )
        lines.append(
            f"  parameters {s['parameters']:,}, {s['file_bytes'] / 1e6:.1f} MB, dtypes {', '.join(s['dtypes'])}"
        )
    else:
        lines.append(f"REFUSED: {len(rep.errors)} problem(s) in {rep.path}")
    return "\n".join(lines)
