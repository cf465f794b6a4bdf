"""A minimal progress line on stderr for long steps (writing weights, calibration)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts work done and redraws one stderr line at most every `interval` seconds.

    Disabled instances cost nothing; use `Progress.auto()` to enable only on a terminal.
    """

    def __init__(self, label: str, total: float, *, unit: str = "", enabled: bool = True,
                 stream: TextIO | None = None, interval: float = 0.5) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self.done = 0.0
        self._last = 0.0
        self._start = time.perf_counter()

    @classmethod
    def auto(cls, label: str, total: float, *, unit: str = "", enabled: bool | None = None) -> Progress:
        """Enabled when `enabled` is True, or when None and stderr is a terminal."""
        if enabled is None:
            enabled = sys.stderr.isatty()
        return cls(label, total, unit=unit, enabled=enabled)

    def advance(self, amount: float = 1.0) -> None:
        """Record `amount` more work done."""
        self.done += amount
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        share = 100.0 * self.done / self.total if self.total else 100.0
        elapsed = now - self._start
        self.stream.write(
            f"\r{self.label}: {share:5.1f}% ({_fmt(self.done)}/{_fmt(self.total)}{self.unit}) {elapsed:.0f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        """Finish the line."""
        if self.enabled and self.done:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


def _fmt(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"
