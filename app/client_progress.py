"""The progress bar of ``app.client.QlocClient.wait``: tqdm's where it is installed, else a plain line; where the
output is not a terminal (a log, a CI job), a line per tenth of the job instead of a bar redrawn in place."""

from __future__ import annotations

import sys
from typing import TextIO


class SimpleBar:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self._last = total, desc, 0, ""

    def update_to(self, n: int, total: int, postfix: str) -> None:
        self.n, self.total = n, total or self.total
        width = 30
        filled = int(width * self.n / self.total) if self.total else 0
        line = f"{self.desc} [{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} {postfix}"
        if line != self._last:  # padded over a longer line before it
            print("\r" + line.ljust(len(self._last)), end="", flush=True)
            self._last = line

    def close(self) -> None:
        print(flush=True)


class LineBar:
    """Progress as whole lines, for output that is not a terminal: one when the job reaches each tenth of its
    iterations or changes state (queued, running, succeeded, ...), not one per poll."""

    def __init__(self, total: int, desc: str, file: TextIO | None = None):
        self.total, self.desc, self.n, self.file = total, desc, 0, file
        self._step, self._state = -1, ""

    def update_to(self, n: int, total: int, postfix: str) -> None:
        self.n, self.total = n, total or self.total
        step = 10 * self.n // self.total if self.total else 0
        state = postfix.split(" ", 1)[0]
        if step > self._step or state != self._state:
            self._step, self._state = max(step, self._step), state
            print(f"{self.desc}: {self.n}/{self.total} {postfix}".rstrip(), file=self.file or sys.stderr, flush=True)

    def close(self) -> None:
        pass


class _TqdmBar:
    def __init__(self, total: int, desc: str):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="it")

    def update_to(self, n: int, total: int, postfix: str) -> None:
        if total and self.bar.total != total:
            self.bar.total = total
        self.bar.update(max(0, n - self.bar.n))
        self.bar.set_postfix_str(postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, desc: str) -> SimpleBar | LineBar | _TqdmBar:
    if not sys.stderr.isatty():
        return LineBar(total, desc)
    try:
        return _TqdmBar(total, desc)
    except ImportError:
        return SimpleBar(total, desc)
