"""What every benchmark prints about a run, and the parts its JSON shares.

:class:`Report` keeps what a run reports besides its figures (when and where, the
load, the engines, which were skipped or failed, how many repeats were done) and
turns a benchmark's table and targets into the plain-text report and the markdown
one. ``common.Harness`` adds the run and its teardown. Child processes import
``benchmarks.common`` and so this module: its top level imports only the standard
library.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
from collections.abc import Callable
from typing import Any


def format_duration(seconds: float) -> str:
    """``0.001`` -> ``"1 ms"``, ``1.0`` -> ``"1 s"``."""
    if seconds >= 1:
        return f"{seconds:g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} us"


def format_cell(
    value: float, fmt: str, ratio_to: float | None = None, x: str = "x"
) -> str:
    """``value`` in ``fmt`` (``-`` if nan), plus `` (N x)`` = value / ``ratio_to``."""
    if math.isnan(value):
        return "-"
    s = fmt.format(value)
    if ratio_to is not None:
        s += f" ({value / ratio_to:.2f}{x})"
    return s


def engine_line(eng: Any) -> str:
    """``name version: note``."""
    s = f"{eng.name} {eng.version}"
    if eng.note:
        s += f": {eng.note}"
    return s


class Report:
    """The reports of a run: its title, notes, table and targets, in text and markdown.

    A subclass provides ``measured()`` (the names of the engines with results),
    ``table()``, ``target_rows()``, ``meta_lines()``, ``json_report()`` and the
    reports' titles; it may add to each engine's line (:meth:`engine_note`) and to
    each engine's JSON (:meth:`engine_json`). Engines have ``name``, ``version`` and
    ``note``.
    """

    #: The reports' titles and notes.
    text_title = markdown_title = ratio_note = cells_note = targets_title = ""

    def __init__(self) -> None:
        self.engines: list[Any] = []  # all requested, in --engines order
        self.skipped: dict[str, str] = {}  # name -> why
        self.failed: dict[str, str] = {}  # name -> error
        self.repeats_done = 0
        self.interrupted = False
        self.load_before = os.getloadavg()
        self.load_after: tuple[float, ...] | None = None
        self.started = datetime.datetime.now().astimezone()

    def measured(self) -> list[str]:
        raise NotImplementedError

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        """Header and rows of the results; ``x`` is the multiplication sign."""
        raise NotImplementedError

    def target_rows(self, x: str = "x") -> list[list[str]]:
        """``[what, measured, target, "ok" or "MISSED"]`` rows."""
        return []

    def meta_lines(self) -> list[str]:
        raise NotImplementedError

    def json_report(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- the lines above the table

    def machine_line(self) -> str:
        """When, where, on how many CPUs, which Python, the load before and after."""
        la = " ".join(f"{v:.2f}" for v in self.load_before)
        lb = " ".join(f"{v:.2f}" for v in self.load_after) if self.load_after else "?"
        return (
            f"{self.started:%Y-%m-%d %H:%M %Z}, {platform.node()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"load average {la} before, {lb} after"
        )

    def repeats_note(self, word: str = "of") -> str:
        """``median of N interleaved repeat(s)``, marked if the run was cut short."""
        return f"median {word} {self.repeats_done} interleaved repeat(s)" + (
            " (INTERRUPTED)" if self.interrupted else ""
        )

    def engine_note(self, eng: Any) -> str:
        """What a benchmark adds to ``eng``'s line, before its failure if any."""
        return ""

    def engine_lines(self) -> list[str]:
        """One line per engine: skipped and why, or its version, note and failure."""
        lines = []
        for eng in self.engines:
            if eng.name in self.skipped:
                lines.append(f"{eng.name}: skipped ({self.skipped[eng.name]})")
                continue
            s = engine_line(eng) + self.engine_note(eng)
            if eng.name in self.failed:
                s += f"; FAILED in {self.failed[eng.name]}"
            lines.append(s)
        return lines

    # -- the reports

    def text_report(self) -> str:
        """The plain-text report: the table, then the targets, if any."""
        header, rows = self.table("x")
        out = ["", self.text_title]
        out += [f"  {line}" for line in self.meta_lines()]
        out.append(f"  {self.ratio_note}")
        out.append("")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            out.append(
                "  ".join(
                    c.ljust(w) if i == 0 else c.rjust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                ).rstrip()
            )
        targets = self.target_rows()
        if targets:
            out += ["", f"{self.targets_title}:"]
            w = [max(len(r[i]) for r in targets) for i in range(4)]
            for r in targets:
                line = "  ".join(c.ljust(x) for c, x in zip(r, w, strict=True))
                out.append(f"  {line}".rstrip())
        return "\n".join(out) + "\n"

    def markdown_report(self) -> str:
        """The markdown report: the table, then the targets, if any."""
        header, rows = self.table("×")
        out = [f"## {self.markdown_title}", ""]
        out += [f"- {line}" for line in self.meta_lines()]
        out += [
            f"- {self.cells_note}",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        ]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        targets = self.target_rows("×")
        if targets:
            out += [
                "",
                f"### {self.targets_title}",
                "",
                "| | measured | target | |",
                "|---|---:|---:|---|",
            ]
            out += ["| " + " | ".join(r) + " |" for r in targets]
        return "\n".join(out) + "\n"

    # -- JSON

    def machine_json(self) -> dict[str, Any]:
        return {
            "started": self.started.isoformat(),
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": self.load_before,
            "load_average_after": self.load_after,
        }

    def engine_json(self, eng: Any) -> dict[str, Any]:
        """What the JSON says of every engine, before the benchmark's own figures."""
        return {
            "version": eng.version,
            "note": eng.note,
            "failed": self.failed.get(eng.name),
        }

    def engines_json(
        self, figures: Callable[[Any], dict[str, Any]] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Engine name -> :meth:`engine_json` and then ``figures(engine)``."""
        return {
            e.name: {**self.engine_json(e), **(figures(e) if figures else {})}
            for e in self.engines
        }
