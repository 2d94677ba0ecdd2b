"""Merge ``qloc photo-reproduce`` runs made per seed (in parallel processes) into one metrics file.

    python benchmarks/merge_photo.py OUT.json runs/photo-s0/metrics.json runs/photo-s1/metrics.json ...

Rows are keyed by (seed, class), so a row seen twice counts once; the summary is recomputed over all
seeds with ``models.experiments.photos.summarize``. Per-seed training info is kept; speed numbers are
kept per input (each process measured its own).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from models.experiments.report import summarize


def main(out: str, inputs: list[str]) -> dict:
    rows: dict[tuple, dict] = {}
    train: dict[str, dict] = {}
    speeds, commands, classes = [], [], set()
    for path in inputs:
        m = json.loads(Path(path).read_text())
        classes.add(m["train_class"])
        for r in m["rows"]:
            rows[(r["seed"], r["class"])] = r
        train.update(m["train"])
        speeds.append({"input": path, **m["speed"]})
        commands.append(m["command"])
    if len(classes) != 1:
        raise SystemExit(f"the inputs train on different classes: {sorted(classes)}")
    order = {c: i for i, c in enumerate(dict.fromkeys(c for _, c in rows))}  # classes in the inputs' order
    all_rows = sorted(rows.values(), key=lambda r: (r["seed"], order[r["class"]]))
    train_class = classes.pop()
    result = {"train_class": train_class, "seeds": sorted({r["seed"] for r in all_rows}),
              "commands": commands, "train": dict(sorted(train.items(), key=lambda kv: int(kv[0]))),
              "rows": all_rows, "speed": speeds,
              "summary": summarize(all_rows, "class", leave_out=train_class, mean_key="mean_new_classes"),
              "speed_median": {k: statistics.median(s[k] for s in speeds)
                               for k in speeds[0] if k != "input" and all(k in s for s in speeds)},
              "inputs": inputs}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    res = main(sys.argv[1], sys.argv[2:])
    print(json.dumps({k: v["mean"] for k, v in res["summary"]["mean_new_classes"].items()}, indent=1))
