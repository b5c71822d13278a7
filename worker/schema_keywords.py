"""JSON Schema keywords xgrammar 0.2.9 compiles without enforcing them.

xgrammar's JSON Schema converter drops some validation keywords silently: a schema with
``uniqueItems`` compiles to "any array of the items", so the constrained output can break
the schema it claims to satisfy. :func:`unenforced_keyword` finds the first such keyword in
a schema so the compile can refuse it, as vLLM does for xgrammar
(``has_xgrammar_unsupported_json_features`` in ``vllm/v1/structured_output/backend_xgrammar.py``).
The list was read off xgrammar 0.2.9's output (the grammar of a schema with the keyword is
the grammar without it, or ignores it): ``not``, ``if`` / ``then`` / ``else``,
``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``uniqueItems``, ``contains``,
``minContains``, ``maxContains``, and a ``$ref`` outside the document (xgrammar compiles it
to any JSON value).

The walk follows only the places that hold subschemas (``properties``, ``items``,
``anyOf``, ``$defs``, ...), so a property *named* ``not`` or an ``enum`` value holding the
word is not mistaken for the keyword; it is iterative (no recursion limit on deep schemas).
"""

from __future__ import annotations

from typing import Any

UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
)
"""Keywords xgrammar 0.2.9 leaves unenforced (``uniqueItems: false`` is the default and allowed)."""

_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: Any) -> tuple[str, str] | None:
    """The first keyword of ``schema`` that xgrammar would not enforce, or None.

    Args:
        schema: a parsed JSON Schema (dicts, lists, booleans).

    Returns:
        ``(keyword, where)``, ``where`` a JSON pointer to the subschema holding it
        (``"#/properties/tags"``), or None when every keyword is enforced.
    """
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in UNENFORCED:
            if key in node and not (key == "uniqueItems" and node[key] is False):
                return key, where
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return "$ref", where
        for key in _ONE:
            if key in node:
                stack.append((node[key], f"{where}/{key}"))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
    return None
