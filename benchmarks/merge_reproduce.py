"""Merge ``qloc reproduce`` runs made per seed (in parallel processes) into one metrics file.

    python benchmarks/merge_reproduce.py OUT.json runs/a/metrics.json runs/seed0.log ...

Inputs are ``metrics.json`` files or the stderr logs of ``qloc reproduce`` (which print one JSON
row per transfer); rows are keyed by (seed, digit, background), so a row seen twice counts once.
Ablation means of single-seed runs become that seed's value.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from models.experiments.report import mean_std, summarize


def main(out: str, inputs: list[str]) -> None:
    rows: dict[tuple, dict] = {}
    ablation: dict[str, dict[int, float]] = {}
    experiment = None
    for path in inputs:
        text = Path(path).read_text()
        if path.endswith(".json"):
            m = json.loads(text)
            experiment = m["experiment"]
            found = m["rows"]
            if len(m["seeds"]) == 1:
                for r, cell in (m.get("ablation_iou_reward") or {}).items():
                    ablation.setdefault(r, {})[m["seeds"][0]] = cell["mean"]
        else:
            found = [json.loads(x) for x in re.findall(r'\{"digit".*?\}(?=\s|$)', text.replace("\r", "\n"))]
        for r in found:
            rows[(r["seed"], r["digit"], r["background"])] = r
    all_rows = sorted(rows.values(), key=lambda r: (r["seed"], r["digit"], r["background"]))
    experiment = experiment or ("backgrounds" if len({r["background"] for r in all_rows}) > 1 else "new-digits")
    group = "digit" if experiment == "new-digits" else "background"
    result = {"experiment": experiment, "seeds": sorted({r["seed"] for r in all_rows}), "rows": all_rows,
              "summary": summarize(all_rows, group), "inputs": inputs}
    if ablation:
        result["ablation_iou_reward"] = {r: mean_std([v for _, v in sorted(per_seed.items())]) | {
            "seeds": sorted(per_seed)} for r, per_seed in ablation.items()}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]["mean"], indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
