"""A dependency-free progress bar on stderr for the analyses' long loops."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Counts steps of known total and redraws one line on stderr.

    On a terminal the bar is redrawn in place; elsewhere (a log file, CI) each step prints its own
    line, because carriage returns would pile up into one unreadable line.

    Example:
        >>> bar = ProgressBar(total=2, label="mass", enabled=False)
        >>> bar.advance("identity"); bar.advance("last_block"); bar.close()
        >>> bar.done
        2
    """

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None, width: int = 24):
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self._start = time.perf_counter()
        self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0

    def advance(self, message: str = "") -> None:
        """Marks one step done; ``message`` names what was just finished."""
        self.done += 1
        if not self.enabled:
            return
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self._start
        line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {message}".rstrip()
        if self._interactive:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the redrawn line so that later output starts on a fresh one."""
        if self.enabled and self._interactive and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
            self._last_len = 0
