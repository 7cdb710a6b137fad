"""MkDocs hook: the HTTP API reference, rendered from the app's own OpenAPI document.

Each build asks `api.app.create_app()` for its document (nothing is served, nothing connects),
replaces the markers `<!-- inferq:openapi -->` … `<!-- /inferq:openapi -->` (and what stands
between them for readers of the source) with one section per operation and one per
schema, and publishes the document itself as `openapi.json` beside the page. No network is
needed, and the reference cannot drift from the routes.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKERS = re.compile(r"<!-- inferq:openapi -->.*?<!-- /inferq:openapi -->", re.DOTALL)
DOCUMENT_NAME = "openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")

Schema = dict[str, Any]

_document: Schema | None = None


def openapi_document() -> Schema:
    """The OpenAPI document the API serves at `/openapi.json`."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from api.app import create_app
    from core.settings import Settings

    # Tracing off: building the docs must not export spans wherever the environment points.
    return create_app(Settings(otlp_endpoint=None)).openapi()


def _cell(text: str) -> str:
    """`text` on one line, its pipes escaped outside code spans (tables leave those alone)."""
    parts = " ".join(text.split()).split("`")
    for index in range(0, len(parts), 2):
        parts[index] = parts[index].replace("|", "\\|")
    return "`".join(parts)


def _anchor(name: str) -> str:
    """The anchor of a schema's heading on the reference page (MkDocs' default slugs)."""
    return name.lower().replace(" ", "-")


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _bounds(schema: Schema) -> list[str]:
    """The schema's constraints as short phrases (`≥ 0`, `at most 1000 items`)."""
    words = {
        "minimum": "≥ {}",
        "exclusiveMinimum": "> {}",
        "maximum": "≤ {}",
        "exclusiveMaximum": "< {}",
        "minLength": "at least {} chars",
        "maxLength": "at most {} chars",
        "minItems": "at least {} items",
        "maxItems": "at most {} items",
    }
    found = []
    for key, phrase in words.items():
        if key in schema:
            value = schema[key]
            number = int(value) if isinstance(value, float) and value.is_integer() else value
            found.append(phrase.format(number))
    return found


def type_text(schema: Schema) -> str:
    """A one-line Markdown description of a schema's type, linking named schemas."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in schema or "oneOf" in schema:
        choices: list[Schema] = schema.get("anyOf") or schema.get("oneOf") or []
        return " or ".join(type_text(choice) for choice in choices)
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type")
    if kind == "array":
        text = f"array of {type_text(schema.get('items', {}))}"
    elif kind == "null":
        return "null"
    elif kind == "string" and "contentMediaType" in schema:
        text = f"file ({schema['contentMediaType']})"
    elif kind == "object" or (kind is None and "properties" in schema):
        extra = schema.get("additionalProperties")
        text = f"object of {type_text(extra)}" if isinstance(extra, dict) and extra else "object"
    elif isinstance(kind, str):
        text = kind
    else:
        return "any JSON value"
    bounds = _bounds(schema)
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _default(schema: Schema) -> str:
    return f"`{json.dumps(schema['default'])}`" if "default" in schema else ""


def _body_text(content: Schema) -> str:
    """What a request or response body holds, per media type."""
    parts = []
    for media_type, body in content.items():
        schema = body.get("schema") or {}
        shown = type_text(schema) if schema else ""
        parts.append(f"`{media_type}`: {shown}" if shown else f"`{media_type}`")
    return "; ".join(parts)


def operation_markdown(path: str, method: str, operation: Schema) -> list[str]:
    """The section for one operation: summary, description, parameters, body, responses."""
    lines = [f"### `{method.upper()} {path}`", ""]
    if operation.get("summary"):
        lines += [f"**{operation['summary']}.** " + operation.get("description", "").strip(), ""]
    elif operation.get("description"):
        lines += [operation["description"].strip(), ""]
    parameters = operation.get("parameters", [])
    if parameters:
        lines += [
            "| parameter | in | type | required | default | description |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for parameter in parameters:
            schema = parameter.get("schema", {})
            description = parameter.get("description") or schema.get("description", "")
            lines.append(
                f"| `{parameter['name']}` | {parameter['in']} | {_cell(type_text(schema))} "
                f"| {'yes' if parameter.get('required') else 'no'} | {_cell(_default(schema))} "
                f"| {_cell(description)} |"
            )
        lines.append("")
    body = operation.get("requestBody")
    if body:
        required = "required" if body.get("required") else "optional"
        lines += [f"Request body ({required}): {_body_text(body.get('content', {}))}", ""]
    lines += ["| status | meaning | body |", "| --- | --- | --- |"]
    for status, response in sorted(operation.get("responses", {}).items()):
        lines.append(
            f"| {status} | {_cell(response.get('description', ''))} "
            f"| {_cell(_body_text(response.get('content', {})))} |"
        )
    return [*lines, ""]


def schema_markdown(name: str, schema: Schema) -> list[str]:
    """The section for one named schema: its description and its fields."""
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [schema["description"].strip(), ""]
    properties: dict[str, Schema] = schema.get("properties", {})
    if not properties:
        lines += [f"Type: {type_text({k: v for k, v in schema.items() if k != 'title'})}.", ""]
        return lines
    required = set(schema.get("required", []))
    lines += [
        "| field | type | required | default | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for field, field_schema in properties.items():
        lines.append(
            f"| `{field}` | {_cell(type_text(field_schema))} "
            f"| {'yes' if field in required else 'no'} | {_cell(_default(field_schema))} "
            f"| {_cell(field_schema.get('description', ''))} |"
        )
    if schema.get("additionalProperties") is False:
        lines += ["", "Other fields are refused."]
    return [*lines, ""]


def openapi_markdown(document: Schema, document_link: str) -> str:
    """The generated part of the reference page: operations by tag, then the schemas."""
    info = document.get("info", {})
    lines = [
        f"OpenAPI {document.get('openapi', '')} document of **{info.get('title', '')}** "
        f"{info.get('version', '')}: [{DOCUMENT_NAME}]({document_link}).",
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, Schema]]] = {}
    for path, operations in document.get("paths", {}).items():
        for method in METHODS:
            if method in operations:
                tag = (operations[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, operations[method]))
    for tag, operations in by_tag.items():
        lines += [f"## {tag}", ""]
        for path, method, operation in operations:
            lines += operation_markdown(path, method, operation)
    schemas: dict[str, Schema] = document.get("components", {}).get("schemas", {})
    if schemas:
        lines += ["## Schemas", ""]
        for name in sorted(schemas):
            lines += schema_markdown(name, schemas[name])
    return "\n".join(lines)


def on_pre_build(config: MkDocsConfig) -> None:
    """Ask the app for its document once per build."""
    global _document
    _document = openapi_document()


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publish the document itself beside the pages."""
    content = json.dumps(_document or openapi_document(), indent=2) + "\n"
    files.append(File.generated(config, DOCUMENT_NAME, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the OpenAPI markers of the page that holds them."""
    if not MARKERS.search(markdown):
        return markdown
    link = posixpath.relpath(DOCUMENT_NAME, posixpath.dirname(page.file.src_uri) or ".")
    reference = openapi_markdown(_document or openapi_document(), link)
    return MARKERS.sub(lambda _: reference, markdown)
