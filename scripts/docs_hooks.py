"""mkdocs hooks: the committed benchmark report becomes the site's "Benchmark results" page.

Measured figures live in one place, ``benchmarks/results/REPORT.md`` (generated from the JSON beside it). Docs pages
link to it as ``../benchmarks/results/REPORT.md#NAME``, a link that also works when the Markdown is read on its own;
in the site, that file is the generated page ``results.md`` (with the report's plots), and the links are rewritten
to point at it. Nothing is copied into ``docs/``.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

REPORT_PAGE = "results.md"
_REPORT_LINK = re.compile(r"\]\((?P<up>(?:\.\./)+)benchmarks/results/REPORT\.md(?P<anchor>#[^)\s]*)?\)")


def _results_dir(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent / "benchmarks" / "results"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    results = _results_dir(config)
    report = results / "REPORT.md"
    if not report.is_file():
        raise FileNotFoundError(f"{report} is missing: the docs link to it; regenerate it with "
                                "`python -m benchmarks.report`")
    files.append(File.generated(config, REPORT_PAGE, content=report.read_text()))
    for plot in sorted(results.glob("*.png")):
        files.append(File.generated(config, plot.name, abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    here = posixpath.dirname(page.file.src_uri)
    target = posixpath.relpath(REPORT_PAGE, here or ".")

    def rewrite(m: re.Match[str]) -> str:
        return f"]({target}{m.group('anchor') or ''})"

    return _REPORT_LINK.sub(rewrite, markdown)
