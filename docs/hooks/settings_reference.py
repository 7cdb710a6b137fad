"""MkDocs hook: the configuration page's tables, generated from `core.settings.Settings`.

The page holds the markers `<!-- inferq:settings -->` and `<!-- /inferq:settings -->`; each
build replaces them, and what stands between them for readers of the source, with one row per
settings field (environment variable, type, default, description, and the pages that explain
the variable), then the default of every table-valued setting, so the page cannot drift from
the code.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from enum import Enum
from pathlib import Path, PurePath
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page
from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[2]
MARKERS = re.compile(r"<!-- inferq:settings -->.*?<!-- /inferq:settings -->", re.DOTALL)
PREFIX = "INFERQ_"


def _import_settings() -> type[BaseModel]:
    """`core.settings.Settings`, importable from the repository root whatever the cwd."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from core.settings import Settings

    return Settings


def env_name(field_name: str) -> str:
    """The environment variable that sets `field_name`."""
    return f"{PREFIX}{field_name.upper()}"


def _cell(text: str) -> str:
    """`text` on one line, its pipes escaped outside code spans (tables leave those alone)."""
    parts = " ".join(text.split()).split("`")
    for index in range(0, len(parts), 2):
        parts[index] = parts[index].replace("|", "\\|")
    return "`".join(parts)


def _type_name(annotation: Any) -> str:
    """A reader's name for a field's type: `int`, `str | none`, `"json" | "text"`."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(f'"{value}"' for value in get_args(annotation))
    if origin in (Union, UnionType):
        return " | ".join(_type_name(arg) for arg in get_args(annotation))
    if annotation is NoneType:
        return "none"
    if origin is not None:
        args = ", ".join(_type_name(arg) for arg in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    """The field's numeric bounds as text (`≥ 0`, `≥ 0, ≤ 19`), or ''."""
    low = high = ""
    for item in field.metadata:
        if isinstance(item, Ge):
            low = f"≥ {item.ge}"
        elif isinstance(item, Gt):
            low = f"> {item.gt}"
        elif isinstance(item, Le):
            high = f"≤ {item.le}"
        elif isinstance(item, Lt):
            high = f"< {item.lt}"
    return ", ".join(part for part in (low, high) if part)


def _plain(value: Any) -> Any:
    """`value` as JSON-ready data (models dumped, enums by value, paths as text)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _is_model_table(value: Any) -> bool:
    """True for a default such as the tier policy: a mapping whose values are models."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(item, BaseModel) for item in value.values())
    )


def _default_text(value: Any) -> str:
    """How the default reads in the table, as it would be written in the environment."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if _is_model_table(value):
        return "the table below"
    plain = _plain(value)
    text = plain if isinstance(plain, str) else json.dumps(plain)
    return f"`{text}`" if text != "" else '`""`'


def _title(markdown: str, fallback: str) -> str:
    """A page's first level-one heading, else `fallback`."""
    match = re.search(r"^#\s+(.+?)\s*$", markdown, flags=re.MULTILINE)
    return match.group(1) if match else fallback


def explaining_pages(page: Page, files: Files) -> dict[str, list[str]]:
    """For each variable name, Markdown links to the other pages that mention it."""
    mentions: dict[str, list[str]] = {}
    here = posixpath.dirname(page.file.src_uri)
    for file in sorted(files.documentation_pages(), key=lambda f: f.src_uri):
        if file.src_uri == page.file.src_uri:
            continue
        text = file.content_string
        link = f"[{_title(text, file.name)}]({posixpath.relpath(file.src_uri, here or '.')})"
        for name in set(re.findall(rf"\b{PREFIX}[A-Z0-9_]+\b", text)):
            mentions.setdefault(name, []).append(link)
    return mentions


def settings_rows(mentions: dict[str, list[str]] | None = None) -> list[dict[str, str]]:
    """One row per settings field: variable, type, default, description, explained in."""
    settings = _import_settings()
    rows = []
    for name, field in settings.model_fields.items():
        variable = env_name(name)
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        rows.append(
            {
                "variable": variable,
                "type": f"{kind} ({bounds})" if bounds else kind,
                "default": _default_text(field.get_default(call_default_factory=True)),
                "description": (field.description or "").strip(),
                "explained_in": ", ".join((mentions or {}).get(variable, [])),
            }
        )
    return rows


def _table_defaults() -> list[str]:
    """A table for each setting whose default is a table of models (the tier policy)."""
    settings = _import_settings()
    lines: list[str] = []
    for name, field in settings.model_fields.items():
        value = field.get_default(call_default_factory=True)
        if not _is_model_table(value):
            continue
        entries = {_plain(key): _plain(item) for key, item in value.items()}
        columns = sorted({column for entry in entries.values() for column in entry})
        lines += [
            "",
            f"## Default of `{env_name(name)}`",
            "",
            "| key | " + " | ".join(f"`{column}`" for column in columns) + " |",
            "| --- |" + " ---: |" * len(columns),
        ]
        for key, entry in entries.items():
            cells = [_cell(json.dumps(entry.get(column))) for column in columns]
            lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return lines


def settings_markdown(mentions: dict[str, list[str]] | None = None) -> str:
    """The generated part of the configuration page."""
    lines = [
        "| variable | type | default | description | explained in |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in settings_rows(mentions):
        description = _cell(row["description"]) or "*(no description)*"
        lines.append(
            f"| `{row['variable']}` | {_cell(row['type'])} | {_cell(row['default'])} "
            f"| {description} | {row['explained_in']} |"
        )
    return "\n".join([*lines, *_table_defaults()]) + "\n"


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the settings markers of the page that holds them."""
    if not MARKERS.search(markdown):
        return markdown
    table = settings_markdown(explaining_pages(page, files))
    return MARKERS.sub(lambda _: table, markdown)
