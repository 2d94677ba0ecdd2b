"""Markdown tables from ``qloc reproduce`` metrics: ``python benchmarks/tables.py runs/new-digits/metrics.json``."""

from __future__ import annotations

import json
import sys

COLUMNS = [("ordacc_proto", "OrdAcc (proto)"), ("ordacc_inst", "OrdAcc (inst)"), ("corloc_before", "before"),
           ("corloc_finetune", "fine-tune"), ("corloc_ranking", "ranking"), ("corloc_after", "after"),
           ("corloc_before_sampled", "before, sampled"), ("corloc_after_sampled", "after, sampled"),
           ("adapt_seconds", "adapt s")]
SEARCH = ("corloc_before_best", "corloc_after_best")  # + N: the best-of-N search columns


def columns(keys) -> list[tuple[str, str]]:
    cols = [(k, name) for k, name in COLUMNS if k in keys]
    for prefix, tag in zip(SEARCH, ("before", "after"), strict=True):
        cols += [(k, f"{tag}, best of {k[len(prefix):]}") for k in sorted(keys) if k.startswith(prefix)]
    return cols


def fmt(cell: dict | None) -> str:
    return "–" if cell is None else f"{cell['mean']:.1f} ± {cell['std']:.1f}"


def table(metrics: dict) -> str:
    summary = metrics["summary"]
    cols = columns(summary["mean"])
    group = "digit" if metrics["experiment"] == "new-digits" else "background"
    lines = [f"| {group} | " + " | ".join(n for _, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for g, row in summary.items():
        label = f"**mean of {len(summary) - 1}**" if g == "mean" else g
        lines.append(f"| {label} | " + " | ".join(fmt(row.get(k)) for k, _ in cols) + " |")
    if metrics.get("ablation_iou_reward"):
        lines.append("")
        lines.append("| agent reward (stage 2) | mean CorLoc before adaptation |")
        lines.append("|---|---|")
        lines.append(f"| ordinal embedding (ours) | {fmt(summary['mean']['corloc_before'])} |")
        for r, cell in metrics["ablation_iou_reward"].items():
            lines.append(f"| {r} | {fmt(cell)} |")
    return "\n".join(lines)


PHOTO_COLUMNS = [("ordacc", "OrdAcc"), ("spearman", "Spearman ρ"), ("corloc_before", "before"),
                 ("corloc_finetune", "fine-tune"), ("corloc_ranking", "ranking"), ("corloc_after", "after")]


def photo_table(metrics: dict) -> str:
    """The cross-class photo table of ``qloc photo-reproduce``'s metrics.json."""
    summary = metrics["summary"]
    keys = summary["mean_new_classes"]
    cols = [(k, n) for k, n in PHOTO_COLUMNS if k in keys]
    cols += [c for c in columns(keys) if "best" in c[0] and not c[0].endswith("ranking_subset")]
    cols.append(("adapt_seconds", "adapt s"))

    def cell(row: dict, k: str) -> str:
        c = row.get(k)
        if c is None:
            return "–"
        return f"{c['mean']:.3f} ± {c['std']:.3f}" if k == "spearman" else fmt(c)

    lines = ["| class | " + " | ".join(n for _, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for g, row in summary.items():
        label = ("**mean of new classes**" if g == "mean_new_classes"
                 else f"{g} (training class)" if g == metrics["train_class"] else g)
        lines.append(f"| {label} | " + " | ".join(cell(row, k) for k, _ in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            m = json.load(f)
        print(photo_table(m) if "train_class" in m else table(m))
        print()
