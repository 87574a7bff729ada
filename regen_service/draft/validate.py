"""Is this draft directory something the serving engine (SGLang, or vLLM) loads correctly? Every way it
could load silently wrong.

`validate_draft(dir, target, engine)` returns a report (report.py's DraftReport) with ALL problems found (code, file, key, message,
fix) and a summary naming the engine release whose loaders it follows; it reads only the safetensors
header plus the small `d2t`/`t2d` tensors, with numpy, so it runs anywhere in a second. Callers: `regen
validate-draft`, `regen export`, `regen convert-draft` and the launch preflights. Formats: Llama-style
EAGLE-3 and EAGLE-3.1 (sglang_format.py) and the MLA draft (mla_format.py); config checks live in
validate_config.py, tensor checks in validate_tensors.py, the d2t/t2d map and aux layers here.
"""

from __future__ import annotations

from pathlib import Path

from regen_service.draft import sglang_format as fmt
from regen_service.draft.report import DraftReport
from regen_service.draft.validate_config import check_config, draft_kind, format_name, required_fields
from regen_service.draft.validate_tensors import (
    check_tensors,
    read_safetensors_header,
    read_small_tensor,
    resolved_names,
)

_AUX_KEY = "eagle_config.eagle_aux_hidden_state_layer_ids"


def validate_draft(
    draft_dir: str | Path, target: fmt.TargetInfo | None = None, engine: fmt.Engine = "sglang"
) -> DraftReport:
    """All problems that would make `engine` refuse this draft or, worse, load it silently wrong."""
    d = Path(draft_dir)
    rep = DraftReport(path=str(d))
    cfg_path = d / fmt.CONFIG_FILE
    files = sorted(d.glob("*.safetensors"))
    if not d.is_dir():
        rep.add("not_found", f"{d} is not a directory", "pass the exported draft directory", file=str(d))
        return rep
    if not cfg_path.is_file():
        rep.add(
            "config_missing",
            f"{cfg_path} does not exist",
            "export the draft with `regen export`",
            file=fmt.CONFIG_FILE,
        )
        return rep
    try:
        cfg = fmt.read_config_json(cfg_path, "draft config")
    except ValueError as e:
        rep.add("config_invalid", str(e), "re-export the draft", file=fmt.CONFIG_FILE)
        return rep
    if not files:
        rep.add(
            "weights_missing",
            f"no *.safetensors file in {d}",
            "write the weights as model.safetensors (`regen export` or `regen convert-draft` do)",
            file=fmt.WEIGHTS_FILE,
        )
        return rep
    header: dict[str, dict] = {}
    owner: dict[str, Path] = {}
    for f in files:
        try:
            entries = read_safetensors_header(f)
        except ValueError as e:
            rep.add(
                "weights_invalid",
                str(e),
                "re-export the draft (`regen export` or `regen convert-draft` write valid safetensors)",
                file=f.name,
            )
            return rep
        for name, entry in entries.items():
            header[name] = entry
            owner[name] = f

    kind = draft_kind(cfg)
    check_config(rep, cfg, target, engine)
    if all(cfg.get(k) is not None for k in required_fields(cfg)):
        t_hidden = target.hidden_size if target else fmt.config_target_hidden(cfg)
        check_tensors(rep, cfg, header, owner, kind, t_hidden, engine)
        _check_vocab_map(rep, cfg, header, owner, kind, target, engine)
    _check_aux(rep, cfg, target, engine)
    rep.summary = _summary(cfg, header, files, target, engine, kind)
    return rep


def _check_vocab_map(
    rep, cfg: dict, header: dict, owner: dict, kind: str, target: fmt.TargetInfo | None, engine: fmt.Engine
) -> None:
    import numpy as np

    names = resolved_names(header, kind, engine)
    vocab = target.vocab_size if target else int(cfg["vocab_size"])
    n_draft = int(cfg["draft_vocab_size"])
    hot = None
    if "d2t" in names:
        raw = names["d2t"]
        d2t = read_small_tensor(owner[raw], header[raw])
        if d2t is None or d2t.dtype.kind not in "iu" or d2t.ndim != 1:
            rep.add(
                "d2t_dtype",
                f"d2t is {header[raw]['dtype']} {header[raw]['shape']}, not a 1-D integer tensor",
                "write d2t as int64 offsets (target_id = i + d2t[i])",
                file=owner[raw].name,
                key=raw,
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
                    file=owner[raw].name,
                    key=raw,
                )
                hot = None
            elif len(np.unique(hot)) != len(hot):
                rep.add(
                    "d2t_duplicates",
                    "d2t maps several draft ids to the same target id",
                    "rebuild the draft vocabulary: each draft id must map to a distinct target id",
                    file=owner[raw].name,
                    key=raw,
                )
    if hot is not None and "t2d" in names:
        raw = names["t2d"]
        t2d = read_small_tensor(owner[raw], header[raw])
        if t2d is not None and t2d.ndim == 1 and len(t2d) == vocab:
            mask = t2d.astype(bool)
            if int(mask.sum()) != n_draft or not bool(mask[hot].all()):
                rep.add(
                    "t2d_mismatch",
                    f"t2d marks {int(mask.sum())} target ids but d2t maps to {n_draft} ids, "
                    f"{int((~mask[hot]).sum())} of which t2d does not mark",
                    "derive t2d from d2t: t2d[i + d2t[i]] = True for every draft id i, False elsewhere",
                    file=owner[raw].name,
                    key=raw,
                )


def _check_aux(rep: DraftReport, cfg: dict, target: fmt.TargetInfo | None, engine: fmt.Engine) -> None:
    eagle = cfg.get("eagle_config") or {}
    ids = fmt.aux_ids(cfg)
    if eagle.get("use_aux_hidden_state") is False:
        rep.add(
            "aux_disabled",
            "eagle_config.use_aux_hidden_state is false: the target would not capture the aux layers",
            'set "use_aux_hidden_state": true',
            file=fmt.CONFIG_FILE,
            key="eagle_config.use_aux_hidden_state",
        )
    exported_for = (cfg.get("regen") or {}).get("engine")
    if ids is not None and exported_for in fmt.ENGINES and exported_for != engine:
        rep.add(
            "aux_engine",
            f"config.json was exported for {exported_for}, whose aux-layer ids mean something else than "
            f"{engine}'s (SGLang captures the input of layer id+1, vLLM the input of layer id): served by "
            f"{engine}, the draft would read other layers than it was trained on",
            f"export the checkpoint again with `regen export CKPT --out DIR --engine {engine}`",
            file=fmt.CONFIG_FILE,
            key="regen.engine",
        )
    if ids is None:
        rep.add(
            "aux_default",
            "eagle_config.eagle_aux_hidden_state_layer_ids is not set: the engine captures the inputs of "
            "layers [2, L//2, L-3]; fine only if training captured exactly those",
            "write the ids used in training (`regen export` writes them in the engine's convention)",
            severity="warning",
            file=fmt.CONFIG_FILE,
            key=_AUX_KEY,
        )
        return
    inputs = fmt.aux_config_to_inputs(ids, engine)
    n = target.num_layers if target is not None else max(inputs) + 1
    # Both engines size fc from the number of ids (fmt.num_aux); fc_width checks it against the weights.
    problem = fmt.aux_input_problem(inputs, n, count=None)
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
    fix = "write the distinct, increasing ids used in training"
    if target is not None and n >= 4:
        default = fmt.aux_inputs_to_config(fmt.default_aux_inputs(n), engine)
        fix += f" (the default for {n} layers is {default} in {engine}'s convention)"
    rep.add(code, f"eagle_aux_hidden_state_layer_ids {ids}: {why}", fix, file=fmt.CONFIG_FILE, key=_AUX_KEY)


def _summary(
    cfg: dict, header: dict, files: list[Path], target: fmt.TargetInfo | None, engine: str, kind: str
) -> dict:
    import math

    ids = fmt.aux_ids(cfg)
    params = sum(
        math.prod(e["shape"]) for k, e in header.items() if fmt.canonical_key(k) not in ("d2t", "t2d")
    )
    return {
        "architecture": (cfg.get("architectures") or [None])[0],
        "format": format_name(cfg, kind),
        # the engine release whose loaders this verdict follows (the `serve` extra pins SGLang to it)
        "engine_version": f"sglang {fmt.SGLANG_VERSION}"
        if engine == "sglang"
        else f"vllm {fmt.VLLM_VERSION}",
        "num_hidden_layers": cfg.get("num_hidden_layers", 1),
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
        where = ": ".join(x for x in (p.file, p.key) if x)
        lines.append(
            f"{p.severity.upper()} [{p.code}] {where + ': ' if where else ''}{p.message}\n    fix: {p.fix}"
        )
    if rep.ok:
        s = rep.summary
        lines.append(f"OK: {rep.path} loads as {s['architecture']} ({s['format']}) in {s['engine_version']}")
        lines.append(
            f"  hidden {s['hidden_size']}, intermediate {s['intermediate_size']}, heads "
            f"{s['num_attention_heads']}/{s['num_key_value_heads']}, layers {s['num_hidden_layers']}, target "
            f"hidden {s['target_hidden_size']}"
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
        followed = rep.summary.get("engine_version")
        against = f" (checked against {followed}'s loaders)" if followed else ""
        lines.append(f"REFUSED: {len(rep.errors)} problem(s) in {rep.path}{against}")
    return "\n".join(lines)
