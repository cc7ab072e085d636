"""mkdocs hooks: the site's pages take their text from where it is kept.

* ``<!-- readme: TITLE -->`` is replaced by the README section of that title
  (down to the next heading of the same level), its links to repository files
  rewritten to the repository's web address, so the README stays the one copy
  of the user journeys;
* ``<!-- include: FILE -->`` by a repository file (CHANGELOG.md);
* ``<!-- config-reference -->`` by :func:`fiber_dask.configdoc.reference_page`,
  generated from ``fiber-schema.yaml``.

A marker that names no section or file fails the build.
"""

from __future__ import annotations

import os
import re
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"<!-- (readme|include): (.+?) -->")
LINK = re.compile(r"\]\(((?!https?:|#|mailto:)[^)\s]+)\)")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _slug(title: str) -> str:
    """The anchor Python-Markdown's toc gives a heading."""
    text = re.sub(r"[^\w\s-]", "", title.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _pages_of_sections() -> dict[str, str]:
    """README section anchor -> the site page that shows that section."""
    found = {}
    docs = os.path.join(ROOT, "docs")
    for dirpath, _, names in os.walk(docs):
        for name in names:
            if not name.endswith(".md"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                for title in re.findall(r"<!-- readme: (.+?) -->", f.read()):
                    found["#" + _slug(title)] = os.path.relpath(path, docs)
    return found


def _rewrite_links(text: str, repo_url: str, page: str = "") -> str:
    sections = _pages_of_sections()

    def fix(m: re.Match[str]) -> str:
        target = m.group(1)
        path, _, anchor = target.partition("#")
        if path.startswith("docs/"):  # a page of this site
            return f"]({path[len('docs/') :]}{'#' + anchor if anchor else ''})"
        kind = "tree" if os.path.isdir(os.path.join(ROOT, path)) else "blob"
        return f"]({repo_url}/{kind}/main/{target})"

    def fix_anchor(m: re.Match[str]) -> str:
        anchor = m.group(1)
        other = sections.get(anchor)
        if other is None or other == page:
            return m.group(0)
        up = "../" * page.count("/")
        return f"]({up}{other})"

    text = LINK.sub(fix, text)
    return re.sub(r"\]\((#[^)\s]+)\)", fix_anchor, text)


def readme_section(title: str) -> str:
    """The README section headed ``title``, without its heading."""
    lines = _read("README.md").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(#+) (.*)$", line)
        if m and m.group(2).strip() == title:
            level = len(m.group(1))
            body = []
            fenced = False
            for other in lines[i + 1 :]:
                if other.startswith("```"):
                    fenced = not fenced  # "# comment" in a code block: no heading
                h = None if fenced else re.match(r"(#+) ", other)
                if h and len(h.group(1)) <= level:
                    break
                body.append(other)
            return "\n".join(body).strip() + "\n"
    raise ValueError(f"README.md has no section titled {title!r}")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repo_url = str(config.get("repo_url") or "").rstrip("/")

    def expand(m: re.Match[str]) -> str:
        kind, name = m.group(1), m.group(2).strip()
        text = readme_section(name) if kind == "readme" else _read(name)
        return _rewrite_links(text, repo_url, page.file.src_uri)

    markdown = MARKER.sub(expand, markdown)
    if "<!-- config-reference -->" in markdown:
        from fiber_dask import configdoc

        markdown = markdown.replace(
            "<!-- config-reference -->", configdoc.reference_page()
        )
    return markdown
