"""The progress bar of ``app.client.QlocClient.wait``: tqdm's where it is installed, else a plain line."""

from __future__ import annotations


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


def progress_bar(total: int, desc: str) -> SimpleBar | _TqdmBar:
    try:
        return _TqdmBar(total, desc)
    except ImportError:
        return SimpleBar(total, desc)
