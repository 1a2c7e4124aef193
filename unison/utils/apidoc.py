"""Generates docs/api.md, the reference of every public name, from the docstrings."""

from __future__ import annotations

import enum
import importlib
import inspect
import re

MODULES = (
    "unison",
    "unison.engine",
    "unison.distributed",
    "unison.metrics",
    "unison.handlers",
    "unison.checkpoint",
    "unison.config",
    "unison.recipe",
    "unison.testing",
    "unison.utils",
)


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    paragraph = doc.split("\n\n")[0].strip()
    return " ".join(paragraph.split())


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]  # callables only reach here; others raise, handled
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # function defaults print their address


def api_markdown() -> str:
    """The API reference page."""
    lines = [
        "# API reference",
        "",
        "Every public name, by module, with its signature and the first paragraph of its",
        "docstring (the docstrings hold the details, examples and the Distributed: notes).",
        "Generated from the package; a test keeps this page equal to it.",
        "",
    ]
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        lines += [f"## `{module_name}`", "", _summary(module), ""]
        for name in sorted(getattr(module, "__all__", [])):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                kind = "class"
            elif callable(obj):
                kind = "function"
            else:
                lines += [f"- **`{name}`** = `{obj!r}`", ""]
                continue
            if inspect.isclass(obj) and issubclass(obj, enum.Enum):  # its members, not Enum's constructor
                members = ", ".join(f"`{m.name}`" for m in obj)
                summary = _summary(obj)
                lead = summary if summary.endswith(":") else f"{summary} Members:"
                lines += [f"### `{module_name}.{name}`", "", f"*enum* — {lead} {members}.", ""]
                continue
            lines += [
                f"### `{module_name}.{name}{_signature(obj)}`",
                "",
                f"*{kind}* — {_summary(obj) or 'no summary.'}",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"
