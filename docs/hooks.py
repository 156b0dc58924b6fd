"""MkDocs hooks (mkdocs.yml `hooks:`): links from the docs to files outside docs/.

The pages link to repository files with relative paths (`../bench/results/trace.png`,
`../helm/trtllm-worker/README.md`) so that GitHub renders them. For the site, a linked
image or other file is copied in under `repo/`, and a linked README in `REPO_PAGES`
becomes a page of its own; a link to a file that does not exist stops the build, as
`mkdocs build --strict` does for links between pages.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent

REPO_PAGES = {"helm/trtllm-worker/README.md": "helm-chart.md"}
"""Markdown files outside docs/ that the site shows as pages: repository path → page."""

LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")


def _repo_path(source: str, target: str) -> str | None:
    """The repository path a relative link of the file at `source` points to, or None
    when it stays inside docs/ (mkdocs checks those itself) or is not relative."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = posixpath.normpath(posixpath.join(posixpath.dirname(source), target))
    if path.startswith("../"):
        raise PluginError(f"{source}: link {target!r} leaves the repository")
    return None if path.startswith("docs/") and source.startswith("docs/") else path


def _site_target(path: str, source: str) -> str:
    """What a link to repository file `path` becomes on the site."""
    if path in REPO_PAGES:
        return REPO_PAGES[path]
    if path.startswith("docs/"):
        return path.removeprefix("docs/")
    if path == "README.md":
        return "index.md"
    if not (ROOT / path).is_file():
        raise PluginError(f"{source}: link to {path!r}, which does not exist")
    return "repo/" + path


def _rewrite(markdown: str, source: str) -> str:
    def fix(match: re.Match[str]) -> str:
        path = _repo_path(source, match.group(2))
        if path is None:
            return match.group(0)
        return match.group(1) + _site_target(path, source) + match.group(3)

    return LINK.sub(fix, markdown)


def _linked_files(markdown: str, source: str) -> set[str]:
    found = set()
    for match in LINK.finditer(markdown):
        path = _repo_path(source, match.group(2))
        if path and path not in REPO_PAGES and not path.endswith(".md"):
            found.add(path)
    return found


def on_files(files: Files, config: MkDocsConfig) -> Files:
    sources = {
        "docs/" + f.src_uri: Path(f.abs_src_path).read_text(encoding="utf-8")
        for f in files.documentation_pages()
        if f.abs_src_path
    }
    sources.update({path: (ROOT / path).read_text(encoding="utf-8") for path in REPO_PAGES})
    copied: set[str] = set()
    for source, text in sources.items():
        copied |= _linked_files(text, source)
    for path in sorted(copied):
        if (ROOT / path).is_file():
            files.append(File.generated(config, "repo/" + path, abs_src_path=str(ROOT / path)))
    for path, page in REPO_PAGES.items():
        content = _rewrite((ROOT / path).read_text(encoding="utf-8"), path)
        files.append(File.generated(config, page, content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri in REPO_PAGES.values():
        return markdown  # written with its links fixed in on_files
    return _rewrite(markdown, "docs/" + page.file.src_uri)
