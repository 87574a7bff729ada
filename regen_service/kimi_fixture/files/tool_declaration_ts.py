"""TypeScript-style tool declarations, as Kimi-K2.5's tokenizer writes them into `tools_ts_str`.

Fixture copy (regen's own code, written to the behaviour of the public encoder; see docs/kimi-k25.md):
`# Tools\n\n## functions\nnamespace functions {\n<one `type NAME = (_: {...}) => any;` per function,
preceded by its description as `// ` comments>\n}\n`. Object fields: required ones first, then
optional ones (`name?:`), each group sorted by name; `integer` becomes `number`; a list of types
(`["string", "null"]`) becomes a union (`string | null`); enums are unions of JSON literals (strings
quoted as-is); defaults are JSON; `$defs` become `interface NAME {...}` lines before the type and
`$ref`s name them (`#` names the root `parameters`). A schema it cannot read (no `type`, `enum`,
`anyOf` or `$ref`; an unknown type in a list; a dangling `$ref`) raises ValueError: the tokenizer
then leaves `tools_ts_str` out and the template declares the tools as compact JSON instead.
"""

from __future__ import annotations

import json

_INDENT = "  "
_UNION_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}
# Which constraint keys a schema's doc comment shows, by kind (other kinds show none).
_CONSTRAINTS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
    "array": ("maxItems", "minItems"),
}


class _Defs:
    """The `$defs` seen while walking one function's parameters, and whether `#` was referenced."""

    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {}
        self.self_ref = False

    def check(self, ref: str) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        name = ref.split("/")[-1]
        if name not in self.schemas:
            raise ValueError(f"$ref {ref!r} not found")
        return name


def _comment(text: str, indent: str) -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _kind(schema) -> str:
    """Which reading a schema gets, in the encoder's order of precedence."""
    if isinstance(schema, bool):
        return "bool"
    if not isinstance(schema, dict):
        raise ValueError(f"not a JSON schema: {schema!r}")
    if "$ref" in schema:
        return "ref"
    if "anyOf" in schema:
        return "anyOf"
    if "enum" in schema:
        return "enum"
    if "type" in schema:
        typ = schema["type"]
        if isinstance(typ, list):
            unknown = [t for t in typ if t not in _UNION_NAMES]
            if unknown:
                raise ValueError(f"unknown types {unknown} in a type list")
            return "union"
        return typ if typ in ("object", "array") else "scalar"
    if schema == {}:
        return "bool"
    raise ValueError(f"JSON schema without type, enum, anyOf or $ref: {schema!r}")


def _doc(schema, indent: str) -> str:
    """The `// ` lines above a field or array item: description, then constraints (sorted)."""
    kind = _kind(schema)
    if kind == "bool":
        return ""
    lines = [_comment(schema["description"], indent)] if schema.get("description") else []
    keys = _CONSTRAINTS.get(schema["type"], ()) if kind in ("scalar", "array") else ()
    cons = sorted((k, schema[k]) for k in keys if k in schema)
    if cons:
        lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in cons))
    return "".join(line + "\n" for line in lines)


def _type(schema, indent: str, defs: _Defs) -> str:
    kind = _kind(schema)
    if kind == "bool":
        return "any" if schema is True or schema == {} else "null"
    if kind == "ref":
        return defs.check(schema["$ref"])
    if kind == "anyOf":
        return " | ".join(_type(s, indent, defs) for s in schema["anyOf"])
    if kind == "enum":
        return " | ".join(f'"{e}"' if isinstance(e, str) else json.dumps(e) for e in schema["enum"])
    if kind == "union":
        return " | ".join(_UNION_NAMES[t] for t in schema["type"])
    if kind == "object":
        return _object(schema, indent, defs)
    if kind == "array":
        item = schema.get("items") or {}
        inner = indent + _INDENT
        doc = _doc(item, inner)
        if doc:
            return f"Array<\n{doc}{inner}{_type(item, inner, defs)}\n{indent}>"
        return f"Array<{_type(item, indent, defs)}>"
    return "number" if schema["type"] == "integer" else str(schema["type"])


def _field(name: str, prop, required: bool, indent: str, defs: _Defs) -> str:
    doc = _doc(prop, indent)
    default = prop.get("default") if isinstance(prop, dict) else None
    if default is not None:
        doc += f"{indent}// Default: {json.dumps(default, ensure_ascii=False)}\n"
    return f"{doc}{indent}{name}{'' if required else '?'}: {_type(prop, indent, defs)}"


def _fields(schema: dict, indent: str, defs: _Defs) -> list[str]:
    if not schema:
        return []
    if "$defs" in schema:
        defs.schemas.update(schema["$defs"])
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    order = sorted(n for n in props if n in required) + sorted(n for n in props if n not in required)
    inner = indent + _INDENT
    out = [_field(name, props[name], name in required, inner, defs) for name in order]
    extra = schema.get("additionalProperties")
    if extra is not None:
        kind = "any" if extra is True else "never" if extra is False else _type(extra, inner, defs)
        out.append(f"{inner}[k: string]: {kind}")
    return out


def _object(schema: dict, indent: str, defs: _Defs) -> str:
    fields = _fields(schema, indent, defs)
    return "{\n" + ",\n".join(fields) + "\n" + indent + "}" if fields else "{}"


def _function(fn: dict) -> str:
    defs = _Defs()
    params = fn.get("parameters") or {}
    body = _object(params, "", defs)
    interfaces = []
    if defs.self_ref:  # the root becomes an interface: its fields in schema order, no extra key
        required = set(params.get("required") or [])
        props = params.get("properties") or {}
        fields = ",\n".join(_field(n, p, n in required, _INDENT, defs) for n, p in props.items())
        interfaces.append("interface parameters {" + (f"\n{fields}\n" if fields else "") + "}")
        body = "parameters"
    for name, sub in list(defs.schemas.items()):
        described = _comment(sub["description"], "") + "\n" if sub.get("description") else ""
        interfaces.append(f"{described}interface {name} {_type(sub, '', defs)}")
    parts = ["\n".join(interfaces)]
    parts.append(_comment(fn["description"], "") if fn.get("description") else "")
    parts.append(f"type {fn.get('name', 'function')} = (_: {body}) => any;")
    return "\n".join(p for p in parts if p)


def encode_tools_to_typescript_style(tools: list[dict]) -> str:
    """OpenAI-style tools ({"type": "function", "function": {...}}) -> the TypeScript declaration."""
    functions = [
        _function(t["function"]) for t in tools or [] if t.get("type") == "function" and t.get("function")
    ]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
