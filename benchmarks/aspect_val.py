"""Would shaping a cMNIST answer like the exemplars help? Validation images only; not served.

A cMNIST bundle's boxes are always squares (BENCHMARKS.md, "Kinds no choice ever looked at"). This replaces each
answer of the starting policy (``mnist-general``, greedy) by the box of the exemplars' median width / height
inscribed in it (same centre, the square's side as the longer side) and compares CorLoc on the ``val`` split of
each glyph class and two digits (seed 0, 5 exemplars, 200 images):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/aspect_val.py
"""

from __future__ import annotations

import torch

from models.bundle import load_bundle
from models.core.metrics import corloc
from models.evaluate import evaluate_corloc
from models.experiments.datasets import CMnistKind, GlyphKind
from models.features import prototype_of

GLYPHS = ("A", "K", "R", "e", "#", "&", "@", "?", "Ω", "λ", "§", "€", "ß", "π", "£", "ψ")


def inscribed(boxes: torch.Tensor, aspect: float) -> torch.Tensor:
    """Square boxes ``[N, 4]`` -> boxes of width / height ``aspect`` inscribed in them, same centre."""
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    side = boxes[:, 2] - boxes[:, 0]
    w, h = (side * aspect, side) if aspect < 1 else (side, side / aspect)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def median_aspect(boxes: torch.Tensor) -> float:
    """The median width / height of boxes ``[N, 4]``."""
    return float(((boxes[:, 2] - boxes[:, 0]) / (boxes[:, 3] - boxes[:, 1])).median())


def main() -> None:
    torch.set_num_threads(1)
    bundle = load_bundle("bundles/mnist-general.pt", "cpu")
    print("| kind | exemplars' w / h | val objects' w / h | CorLoc, square answer | CorLoc, shaped like the "
          "exemplars |")
    print("|---|---|---|---|---|")
    for kind in [GlyphKind(c, "patch") for c in GLYPHS] + [CMnistKind(d, "patch") for d in (1, 7)]:
        ex = kind.draw(bundle, "exemplars", 5, 0)
        val = kind.draw(bundle, "val", 200, 0)
        aspect, objects = median_aspect(ex.boxes), median_aspect(val.boxes)
        square, boxes = evaluate_corloc(bundle, bundle.new_agent(None), val, prototype_of(bundle, ex))
        shaped = corloc(inscribed(boxes, aspect), val.boxes)
        print(f"| {kind.describe()} | {aspect:.2f} | {objects:.2f} | {square:.1f} | {shaped:.1f} |", flush=True)


if __name__ == "__main__":
    main()
