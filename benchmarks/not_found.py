"""Benchmark of issue 13 (part 1): "not found" with a calibrated confidence, on cMNIST.

Half the test images hold the query object (digit 4, MNIST's test file, the shipped ``mnist-digit4`` bundle),
half hold another digit only (0-3, 5-9, equal shares). An answer is right when its box has IoU >= 0.5 with the
4; any answer on an image without a 4 is wrong. ``found`` = calibrated confidence >= 0.5. The calibration is
made as the service makes it (``models.calibration.calibrate_policy``), from what a set has, never from the
test images:

- ``creation``: 5 exemplar crops only (synthesized backgrounds, scrambled exemplars) -- a new set;
- ``refreshed``: + 64 unlabeled train images of the set, their answers erased, as backgrounds -- what an
  adaptation job's refresh (or a set with an image pool) has;
- ``refreshed+negatives``: + 5 negative exemplar crops of each look-alike digit (7, 9; train file).

Each variant twice: its confidence from the embedding distance alone (``log d_p``; with negatives, also their
log ratio) -- the calibration as it was before -- and ``+ncc``: the same calibration's NCC fit, which adds the
mean normalized cross-correlation of the answer's box with the exemplar crops (with negatives: and with the
negative crops; ``models.core.templates.Templates``), fit leave-one-out on the same samples.

Where the bundle has a known-kinds verifier (``<bundle>.verifier``, ``models.verifier``: `mnist-general`) and the
query is a kind it knows, each variant also has ``+kind``: the verifier's check, what the service serves for such a
set. The NCC and kind rows also give the literal reading of "images without the query object": the precision of
`found` against the same 198 images with the digit removed (``precision_vs_empty``, ``found_on_empty``).

Prints one JSON line per variant and saves the reliability curves to benchmarks/figures/not_found.png (query 4,
`mnist-digit4`) or not_found_kinds.png (query 4, a bundle with a verifier).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/not_found.py [QUERY]   # default 4 (the bundle's); 2, 7, 9: new
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/not_found.py 4 --bundle bundles/mnist-general.pt   # another bundle
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/not_found.py 4 --samples 16  # QLOC_CALIBRATION_SAMPLES=16; no figures
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from found_absent_val import removed  # noqa: E402

from models.bundle import load_bundle  # noqa: E402
from models.calibration import (  # noqa: E402
    answers,
    box_distances,
    calibrate_policy,
)
from models.core.boxes import paired_iou  # noqa: E402
from models.core.platt import expected_calibration_error, reliability_bins  # noqa: E402
from models.data.probes import erase_boxes  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402
from models.inference import Localizer  # noqa: E402
from models.verifier import load_verifier, verifier_path  # noqa: E402

N_POS, PER_OTHER = 198, 22
LOOKALIKES = (7, 9)


LOOKALIKES_OF = {4: (7, 9), 7: (1, 9), 2: (3, 7), 9: (4, 7)}
"""The negative exemplars' digits per query (the digits most often mistaken for it)."""


def main(query: int = 4, bundle_path: Path = ROOT / "bundles" / "mnist-digit4.pt", samples: int = 128) -> None:
    torch.set_num_threads(1)
    bundle = load_bundle(bundle_path)
    loc = Localizer(bundle, "cpu")
    nearest = loc.default_nearest
    ex = cmnist(query, "train", 5, "patch", 1000)
    crops = exemplar_crops(ex)
    proto = loc.prototype(crops)
    unl = cmnist(query, "train", 64, "patch", 1000, offset=5)
    neg_crops = [c for d in LOOKALIKES_OF.get(query, LOOKALIKES)
                 for c in exemplar_crops(cmnist(d, "train", 5, "patch", 2000))]
    neg_emb = loc.embed_crops(neg_crops).cpu()
    agent = loc.agent()
    ub, _ = answers(loc, agent, proto, unl.images, nearest=nearest)
    backgrounds = erase_boxes(unl.images, ub, torch.Generator().manual_seed(0))

    pos = cmnist(query, "test", N_POS, "patch", 0)
    others = torch.cat([cmnist(d, "test", PER_OTHER, "patch", 0).images for d in range(10) if d != query])
    empty = removed(pos.images, pos.boxes, "patch")  # the literal reading: the same images, the digit removed
    every = torch.cat([pos.images, others, empty])
    every_boxes, every_scores = answers(loc, agent, proto, every, nearest=nearest)
    n_img = N_POS + len(others)
    images, boxes, scores = every[:n_img], every_boxes[:n_img], every_scores[:n_img]
    right = torch.zeros(len(images), dtype=torch.bool)
    right[:N_POS] = paired_iou(boxes[:N_POS], pos.boxes) >= 0.5
    path = verifier_path(bundle_path)
    verifier = load_verifier(path) if path.is_file() else None
    d_neg = box_distances(loc, images, boxes[:, None], neg_emb)[:, 0].min(-1).values

    variants = {
        "creation": dict(),
        "refreshed": dict(backgrounds01=backgrounds),
        "refreshed+negatives": dict(backgrounds01=backgrounds, negative_crops=neg_crops, negative_embeddings=neg_emb),
    }
    curves = {}
    has4 = torch.zeros(len(images), dtype=torch.bool)
    has4[:N_POS] = True
    for name, kw in variants.items():
        t0 = time.perf_counter()
        cal = calibrate_policy(loc, proto, crops, nearest=nearest, n=samples, seed=0, verifier=verifier, **kw)
        secs = time.perf_counter() - t0
        assert cal.templates is not None
        t0 = time.perf_counter()
        ncc, ncc_neg = cal.templates.ncc(images, boxes[:, None])
        ncc_ms = (time.perf_counter() - t0) / len(images) * 1000
        confs = {name: (cal.confidence(scores, d_neg if "negative_embeddings" in kw else None).float(),
                        cal.negatives if "negative_embeddings" in kw else cal.score),
                 f"{name}+ncc": (cal.confidence(scores, ncc=ncc[:, 0], ncc_negatives=None if ncc_neg is None
                                                else ncc_neg[:, 0]).float(),
                                 cal.ncc_negatives if ncc_neg is not None else cal.ncc)}
        if cal.kind is not None:  # the bundle's verifier knows the query's kind (models.verifier): what is served
            confs[f"{name}+kind"] = (cal.kind_confidence(verifier, images, boxes[:, None])[:, 0].float(), None)
        on_empty = {f"{name}+ncc": cal.box_confidence(empty, every_boxes[n_img:, None], every_scores[n_img:, None])}
        if cal.kind is not None:
            on_empty[f"{name}+kind"] = cal.kind_confidence(verifier, empty, every_boxes[n_img:, None])
        for label, (conf, fit) in confs.items():
            found = conf >= cal.threshold
            tp = int((found & right).sum())
            extra = {}
            if label in on_empty:  # precision against the same images with the digit removed instead
                fe = int((on_empty[label][:, 0] >= cal.threshold).sum())
                extra = {"precision_vs_empty": round(tp / max(1, int(found[:N_POS].sum()) + fe), 3),
                         "found_on_empty": round(fe / len(empty), 3)}
            row = {"variant": label, "samples": samples, "images": len(images), "with_query": N_POS, **extra,
                   "corloc_on_query": round(float(right[:N_POS].float().mean()) * 100, 1),
                   "precision": round(tp / max(1, int(found.sum())), 3),
                   "recall": round(tp / max(1, int(right.sum())), 3),
                   "found_with_query": round(float(found[has4].float().mean()), 3),
                   "found_without_query": round(float(found[~has4].float().mean()), 3),
                   "ece": round(expected_calibration_error(conf, right), 3),
                   "calibration_seconds": round(secs, 2),
                   "features": fit.features if fit else None,
                   "weights": [round(w, 2) for w in fit.weights] if fit else None}
            if cal.kind is not None:
                row["kind"] = cal.kind.kind
            if label.endswith("+ncc"):
                row.update(fit_ece=cal.stats["ece"], ncc_ms_per_image=round(ncc_ms, 3))
            curves[label] = reliability_bins(conf, right)
            print(json.dumps(row), flush=True)
    if samples != 128:  # the figures are the default's
        return
    if query == 4 and bundle_path.name == "mnist-digit4.pt":  # the figure of the report
        plot(curves, ROOT / "benchmarks" / "figures" / "not_found.png")
    if query == 4 and any(k.endswith("+kind") for k in curves):  # the served default's, with its verifier
        plot({k: v for k, v in curves.items() if k.endswith(("+ncc", "+kind"))},
             ROOT / "benchmarks" / "figures" / "not_found_kinds.png")


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 4.6), dpi=80)
    ax.plot([0, 1], [0, 1], color="gray", linestyle=":", label="perfect")
    for i, (name, bins) in enumerate(curves.items()):
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label=name,
                color=f"C{i // 2}", linestyle={"+ncc": "-", "+kind": "-."}.get(name[name.rfind("+"):], "--"))
    ax.set_xlabel("calibrated confidence (bin mean)")
    ax.set_ylabel("share of right answers")
    ax.set_title("cMNIST 4 vs other digits: reliability")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"figure: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("query", type=int, nargs="?", default=4)
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "mnist-digit4.pt")
    p.add_argument("--samples", type=int, default=128, help="pasted crops and backgrounds, each (128: the default)")
    a = p.parse_args()
    main(a.query, a.bundle, a.samples)
