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
                 ("corloc_finetune", "fine-tune"), ("corloc_ranking", "ranking"), ("corloc_after", "after"),
                 ("corloc_before_nearest", "before, nearest"), ("corloc_after_nearest", "after, nearest")]


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


def photo_seed_table(metrics: dict) -> str:
    """Per seed: the mean of the new classes before / after adaptation, ranking, and the differences
    the floor asks about (after - before, after - ranking), plus the best-of-16 search after adaptation."""
    import statistics

    new = [r for r in metrics["rows"] if r["class"] != metrics["train_class"]]
    best = next((k for k in new[0] if k.startswith("corloc_after_best") and not k.endswith("subset")), None)
    head = ["seed", "stage-2 val CorLoc", "before", "after", "ranking", "after − before", "after − ranking"]
    nearest = "corloc_after_nearest" in new[0]
    if nearest:
        head += ["after, nearest", "nearest − ranking"]
    if best:
        head += [f"after, best of {best.removeprefix('corloc_after_best')}", "best − ranking"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    cols: dict[str, list[float]] = {h: [] for h in head[2:]}
    for seed in sorted({r["seed"] for r in new}):
        rows = [r for r in new if r["seed"] == seed]

        def m(k: str, rows: list = rows) -> float:
            return statistics.fmean(r[k] for r in rows)
        vals = [m("corloc_before"), m("corloc_after"), m("corloc_ranking")]
        vals += [vals[1] - vals[0], vals[1] - vals[2]]
        if nearest:
            vals += [m("corloc_after_nearest"), m("corloc_after_nearest") - vals[2]]
        if best:
            vals += [m(best), m(best) - vals[2]]
        for h, v in zip(head[2:], vals, strict=True):
            cols[h].append(v)
        val = metrics.get("train", {}).get(str(seed), {}).get("val/corloc")
        lines.append(f"| {seed} | {'–' if val is None else f'{val:.1f}'} | "
                     + " | ".join(f"{v:+.1f}" if "−" in h else f"{v:.1f}" for h, v in zip(head[2:], vals, strict=True))
                     + " |")
    sd = {h: statistics.stdev(v) if len(v) > 1 else 0.0 for h, v in cols.items()}
    lines.append("| mean ± std | | " + " | ".join(
        f"{statistics.fmean(v):{'+' if '−' in h else ''}.1f} ± {sd[h]:.1f}" for h, v in cols.items()) + " |")
    wins = {h: sum(round(x, 1) > 0 for x in v) for h, v in cols.items() if "−" in h}  # +0.0 is a tie
    lines.append("| seeds > 0 | | | | | " + " | ".join(
        f"{wins[h]} of {len(cols[h])}" if h in wins else "" for h in head[5:]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            m = json.load(f)
        print(photo_table(m) + "\n\n" + photo_seed_table(m) if "train_class" in m else table(m))
        print()
