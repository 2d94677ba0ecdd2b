"""The one summary of an experiment's rows: per group (a target digit, background or photo class) the mean
and std over seeds, and the mean over groups (each seed's mean over the groups, then mean and std)."""

from __future__ import annotations

import statistics
from collections.abc import Hashable

METRIC_PREFIXES = ("corloc", "ordacc", "spearman", "adapt_seconds")
"""The row keys that are metrics (the others name the row: seed, class, digit, counts)."""


def mean_std(xs: list[float], digits: int = 3) -> dict[str, float]:
    """``{"mean", "std" (sample; 0 for one value), "n"}``, rounded to ``digits``."""
    return {"mean": round(statistics.fmean(xs), digits),
            "std": round(statistics.stdev(xs), digits) if len(xs) > 1 else 0.0, "n": len(xs)}


def summarize(rows: list[dict], group: str, *, leave_out: Hashable | None = None, mean_key: str = "mean",
              digits: int = 3) -> dict:
    """Rows (one per seed and group, each with a ``seed``) -> ``{group value: {metric: mean_std}}`` in the
    rows' order, plus ``mean_key``: the mean over the groups but ``leave_out`` (e.g. the training class)."""
    keys = [k for k in rows[0] if k.startswith(METRIC_PREFIXES)]
    out: dict = {}
    for g in dict.fromkeys(r[group] for r in rows):
        out[str(g)] = {k: mean_std([r[k] for r in rows if r[group] == g], digits) for k in keys}
    kept = [r for r in rows if leave_out is None or r[group] != leave_out]
    if kept:
        seeds = sorted({r["seed"] for r in kept})
        out[mean_key] = {k: mean_std([statistics.fmean([r[k] for r in kept if r["seed"] == s]) for s in seeds], digits)
                         for k in keys}
    return out
