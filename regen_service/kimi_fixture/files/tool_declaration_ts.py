"""TypeScript-style tool declarations, as Kimi-K2.5's tokenizer writes them into `tools_ts_str`.

Fixture copy (regen's own code, written to the format of the public encoder; see docs/kimi-k25.md):
`# Tools\n\n## functions\nnamespace functions {\n<one `type NAME = (_: {...}) => any;` per function,
preceded by its description as `// ` comments>\n}\n`. Object fields: required ones first, then
optional ones (`name?:`), each group sorted by name; descriptions, enums, arrays, defaults and
numeric/string constraints follow the same rules. `integer` becomes `number`.
"""

from __future__ import annotations

import json

_INDENT = "  "


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _doc(schema: dict, indent: str) -> str:
    lines = []
    if isinstance(schema, dict) and schema.get("description"):
        lines.append(_comment(schema["description"], indent))
    keys = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum")}
    typ = schema.get("type") if isinstance(schema, dict) else None
    allowed = keys.get("number" if typ == "integer" else typ, ())
    if typ == "array":
        allowed = ("maxItems", "minItems")
    cons = {k: schema[k] for k in allowed if k in schema}
    if cons and "enum" not in schema:
        lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in sorted(cons.items())))
    return "".join(line + "\n" for line in lines)


def _type(schema, indent: str) -> str:
    if schema is True or schema == {}:
        return "any"
    if not isinstance(schema, dict):
        return "null"
    if "anyOf" in schema:
        return " | ".join(_type(s, indent) for s in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(json.dumps(e) if isinstance(e, str) else str(e) for e in schema["enum"])
    typ = schema.get("type")
    if isinstance(typ, list):
        names = {"integer": "number", "object": "{}", "array": "Array<any>"}
        return " | ".join(names.get(t, t) for t in typ)
    if typ == "object":
        return _object(schema, indent)
    if typ == "array":
        item = schema.get("items") or {}
        doc = _doc(item, indent + _INDENT)
        inner = _type(item, indent + _INDENT)
        return f"Array<\n{doc}{indent}{_INDENT}{inner}\n{indent}>" if doc else f"Array<{_type(item, indent)}>"
    return "number" if typ == "integer" else str(typ or "any")


def _object(schema: dict, indent: str) -> str:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    order = sorted(n for n in props if n in required) + sorted(n for n in props if n not in required)
    fields = []
    for name in order:
        prop = props[name]
        inner = indent + _INDENT
        doc = _doc(prop, inner)
        if isinstance(prop, dict) and prop.get("default") is not None:
            d = prop["default"]
            shown = repr(d) if isinstance(d, int | float | bool) else json.dumps(d, ensure_ascii=False)
            doc += f"{inner}// Default: {shown}\n"
        opt = "" if name in required else "?"
        fields.append(f"{doc}{inner}{name}{opt}: {_type(prop, inner)}")
    extra = schema.get("additionalProperties")
    if extra is not None:
        kind = "any" if extra is True else "never" if extra is False else _type(extra, indent + _INDENT)
        fields.append(f"{indent}{_INDENT}[k: string]: {kind}")
    if not fields:
        return "{}"
    return "{\n" + ",\n".join(fields) + "\n" + indent + "}"


def _function(fn: dict) -> str:
    parts = []
    if fn.get("description"):
        parts.append(_comment(fn["description"], ""))
    parts.append(
        f"type {fn.get('name', 'function')} = (_: {_object(fn.get('parameters') or {}, '')}) => any;"
    )
    return "\n".join(parts)


def encode_tools_to_typescript_style(tools: list[dict]) -> str:
    """OpenAI-style tools ({"type": "function", "function": {...}}) -> the TypeScript declaration."""
    functions = [
        _function(t["function"]) for t in tools or [] if t.get("type") == "function" and t.get("function")
    ]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
