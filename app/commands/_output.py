"""Shared output helpers for the CLI subcommands."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any


def json_safe(data: Any) -> Any:
    """``data`` with every non-finite float (NaN, infinity) made None: JSON has no such
    numbers (Python's ``json`` writes ``NaN`` / ``Infinity``, which JSON parsers refuse)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, Mapping):
        return {key: json_safe(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_safe(value) for value in data]
    return data


def json_text(data: Any, indent: int | None = None) -> str:
    """``data`` as JSON text, always valid JSON (``json_safe``; other objects as ``str``):
    compact, or indented by ``indent``."""
    separators = (",", ":") if indent is None else None
    return json.dumps(json_safe(data), indent=indent, separators=separators, default=str,
                      allow_nan=False)


def raise_for_errors(outputs: Iterable[Any]) -> None:
    """``ValueError`` with the first error when any of the engine's ``outputs``
    (``RequestOutput``) ended in one (``FinishReason.ERROR``: the model's logits were not
    finite): a command must not report tokens or timings as if the run had worked."""
    failed = [o for o in outputs if getattr(o, "error", None)]
    if failed:
        others = f" ({len(failed) - 1} more request(s) failed too)" if len(failed) > 1 else ""
        raise ValueError(f"{failed[0].error}{others}")


def print_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout (``json_text``)."""
    sys.stdout.write(json_text(data, indent=2) + "\n")


def print_text(text: str = "") -> None:
    """Print ``text`` and a newline on stdout (the human-readable form of a command)."""
    sys.stdout.write(text + "\n")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with left-aligned columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_mapping(data: dict[str, Any]) -> str:
    """``key: value`` lines, keys aligned."""
    width = max((len(k) for k in data), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in data.items())


class ProgressBar:
    """A plain-text progress indicator on a stream. On a terminal: a bar redrawn in place (at
    most 10 times a second). Elsewhere (a log file, a pipe, CI) no bar: one line when work
    has gone on for ``heartbeat`` seconds since the last line (so a log is never silent for
    long), and one closing line with the total time; a job that finishes quickly writes one
    line."""

    def __init__(self, total: int, label: str, stream: IO[str] | None = None,
                 width: int = 30, enabled: bool = True, heartbeat: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.enabled = enabled
        self.heartbeat = heartbeat
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._clock = clock
        self._start = clock()
        # a terminal draws the first update at once; a log's first line waits a heartbeat
        self._last_draw = -math.inf if self.tty else self._start
        self._done = 0
        self._info = ""
        self._closed = False

    def update(self, done: int, info: str = "") -> None:
        """Show ``done`` of ``total`` with a short ``info`` text."""
        if not self.enabled or self._closed:
            return
        self._done, self._info = done, info
        now = self._clock()
        if self.tty:
            if done < self.total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            self._write("\r" + self._bar(done, now, info) + "\x1b[K")
        elif now - self._last_draw >= self.heartbeat:
            self._last_draw = now
            self._write(self._plain(done, now, info) + "\n")

    def note(self, text: str) -> None:
        """Write ``text`` as a line of its own (on a terminal, above the bar, redrawn after)."""
        if not self.enabled:
            return
        if self.tty and not self._closed:
            now = self._clock()
            self._write("\r\x1b[K" + text + "\n" + self._bar(self._done, now, self._info))
        else:
            self._write(text + "\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _bar(self, done: int, now: float, info: str) -> str:
        frac = min(max(done / self.total, 0.0), 1.0)
        filled = int(frac * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"{self.label} [{bar}] {done}/{self.total} {now - self._start:5.1f}s"
        return f"{text}  {info}" if info else text

    def _plain(self, done: int, now: float, info: str) -> str:
        pct = min(max(done / self.total, 0.0), 1.0)
        text = f"{self.label}: {pct:.0%} ({done}/{self.total}) after {now - self._start:.1f} s"
        return f"{text}, {info}" if info else text

    def close(self) -> None:
        """End the bar's line on a terminal; elsewhere, one line with the total time."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.tty:
            self._write("\n")
        else:
            now = self._clock()
            info = f", {self._info}" if self._info else ""
            self._write(f"{self.label}: done, {self._done}/{self.total} in "
                        f"{now - self._start:.1f} s{info}\n")
