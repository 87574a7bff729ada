"""Prompts with their original answers, cut from Python sources: the data of the quality benchmark.

Three sources, each a prompt a code model can answer and the answer the file's author wrote:
- `fn_body`: a function's signature and docstring -> its body;
- `module_start`: a module's docstring -> the module's first lines after it (imports, first definitions);
- `class_start`: a class statement and its docstring -> the class's first lines after it.
Files are read in sorted order and parsed with `ast` (files that do not parse are skipped), so the
same tree gives the same pairs. `pairs_from_files` caps pairs per file and source (a huge file does not
dominate) and answers by lines and characters; `write_jsonl` writes them in regen's `prompt_response`
format (`prompt`, `response`, plus `package`), which the producer reads as a source. Which packages
the target trained on and which are held out is small_target.py's.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
from pathlib import Path

SOURCES = ("fn_body", "module_start", "class_start")
PROMPT_HEAD = {
    "fn_body": "Complete the body of this Python function.\n\n",
    "module_start": "Write the beginning of a Python module whose docstring is:\n\n",
    "class_start": "Continue this Python class.\n\n",
}


def python_files(root: str | Path, max_file_bytes: int = 400_000) -> list[Path]:
    """Every .py file under root, sorted, skipping huge generated ones."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if f.endswith(".py") and p.is_file() and 0 < p.stat().st_size <= max_file_bytes:
                out.append(p)
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _lines(text: str, start: int, end: int) -> str:
    """Source lines start..end (1-based, inclusive)."""
    return "\n".join(text.splitlines()[start - 1 : end])


def _docstring_node(node) -> ast.Expr | None:
    body = getattr(node, "body", None)
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first
    return None


def _ok(answer: str, max_lines: int, max_chars: int) -> bool:
    n = answer.count("\n") + 1
    return 2 <= n <= max_lines and 20 <= len(answer) <= max_chars and answer.strip() != "pass"


def file_pairs(text: str, per_file: int = 6, max_lines: int = 30, max_chars: int = 1400) -> Iterator[dict]:
    """(source, prompt, response) dicts from one file's text."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return
    doc = _docstring_node(tree)
    if doc is not None and len(tree.body) > 1:
        first = tree.body[1].lineno
        answer = _lines(text, first, min(first + max_lines - 1, len(text.splitlines()))).rstrip()
        if _ok(answer, max_lines, max_chars) and len(doc.value.value.strip()) >= 20:
            yield {"source": "module_start", "prompt": PROMPT_HEAD["module_start"] + doc.value.value.strip(),
                   "response": answer}  # fmt: skip
    counts = dict.fromkeys(SOURCES, 0)
    for node in ast.walk(tree):
        kind = (
            "fn_body"
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            else "class_start"
            if isinstance(node, ast.ClassDef)
            else None
        )
        if kind is None or counts[kind] >= per_file:
            continue
        d = _docstring_node(node)
        if d is None or len(node.body) < 2 or len(d.value.value.strip()) < 10:
            continue
        head = _lines(text, node.lineno, d.end_lineno)
        start = node.body[1].lineno
        end = node.end_lineno if kind == "fn_body" else min(node.end_lineno, start + max_lines - 1)
        answer = _lines(text, start, end).rstrip()
        if _ok(answer, max_lines, max_chars) and len(head) <= max_chars:
            counts[kind] += 1
            yield {"source": kind, "prompt": PROMPT_HEAD[kind] + head, "response": answer}


def pairs_from_files(files: list[tuple[str, Path]], per_file: int = 6) -> list[dict]:
    """[(package, path)] -> pairs with their package, in file order."""
    out = []
    for package, path in files:
        text = read_text(path)
        if text:
            for p in file_pairs(text, per_file):
                out.append({**p, "package": package})
    return out


def write_jsonl(pairs: list[dict], out_dir: str | Path) -> dict[str, Path]:
    """One prompt_response JSONL file per source (source -> path)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for src in SOURCES:
        rows = [p for p in pairs if p["source"] == src]
        if not rows:
            continue
        paths[src] = out_dir / f"{src}.jsonl"
        with open(paths[src], "w", encoding="utf-8") as f:
            for r in rows:
                f.write(
                    json.dumps({"prompt": r["prompt"], "response": r["response"], "package": r["package"]})
                    + "\n"
                )
    return paths
