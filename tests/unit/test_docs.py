"""The documentation site builds, its generated references cover the code, and no link is broken."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from api.app import create_app
from core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MARKDOWN_FILES = [README, *sorted(DOCS.rglob("*.md"))]
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.MULTILINE)
_REPO_PATH = re.compile(
    r"`((?:api|bench|core|deploy|docs|inferq|migrations|scheduler|scripts|tests|workers)/"
    r"[\w./-]*(?:/|\.py|\.md|\.sh|\.yml|\.json))(?:::\w+)?`"
)


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it: `mkdocs build --strict` into a fresh directory."""
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return site


def _prose(markdown: str) -> str:
    """`markdown` without fenced code blocks and code spans, where links are not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", markdown))


def _relative_links(path: Path) -> list[str]:
    """The link targets in a Markdown file that point into the repository."""
    targets = _LINK.findall(_prose(path.read_text()))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and t[0] != "#"]


def _anchors(path: Path) -> set[str]:
    """The anchors MkDocs gives the headings of a Markdown file."""
    headings = _HEADING.findall(_prose(path.read_text().replace("`", "")))
    return {slugify(heading, "-") for heading in headings}


def test_the_documentation_site_builds_strictly(built_site: Path) -> None:
    assert (built_site / "index.html").is_file()
    assert (built_site / "openapi.json").is_file()


def test_every_setting_has_a_description() -> None:
    undescribed = [
        name
        for name, field in Settings.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert undescribed == []


def test_the_configuration_page_lists_every_setting(built_site: Path) -> None:
    page = (built_site / "configuration" / "index.html").read_text()
    missing = [
        f"INFERQ_{name.upper()}"
        for name in Settings.model_fields
        if f"<code>INFERQ_{name.upper()}</code>" not in page
    ]
    assert missing == []


def test_the_api_reference_lists_every_operation(built_site: Path) -> None:
    page = (built_site / "api-reference" / "index.html").read_text()
    paths = create_app(Settings(otlp_endpoint=None)).openapi()["paths"]
    missing = [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        for method in operations
        if f"<code>{method.upper()} {path}</code>" not in page
    ]
    assert missing == []


def test_the_readme_is_a_short_front_door() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(path: Path) -> None:
    broken = [
        target
        for target in _relative_links(path)
        if not (path.parent / target.split("#", 1)[0]).exists()
    ]
    assert broken == []


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_the_docs_name_exists(path: Path) -> None:
    named = set(_REPO_PATH.findall(path.read_text()))
    missing = sorted(
        p for p in named if not p.startswith("bench/results/") and not (ROOT / p).exists()
    )
    assert missing == []


def test_every_readme_link_into_the_docs_names_a_heading_that_exists() -> None:
    broken = []
    for target in _relative_links(README):
        file, _, anchor = target.partition("#")
        if anchor and file.endswith(".md") and anchor not in _anchors(README.parent / file):
            broken.append(target)
    assert broken == []
