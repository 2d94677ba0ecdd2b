"""Which score picks the object's box among many windows on real photographs (issue 15), on the real-photo
benchmark's **val** half only (``models.data.realphotos``; the test half is not read).

With a photo bundle (default: the served ``bundles/photo-mammals.pt``), each class's exemplar crops (its ``exemplar``
photos' boxes), and 1,000+ candidate windows per image (8 sides from 40 px to the whole 224 input, stride 16,
aspect up to 2), CorLoc of the window each score likes best:

- ``agent``: the served answer (the agent's episode, the bundle's answer rule) -- for reference;
- ``instances``: the several-instances search's best candidate (``models.instances``, its defaults);
- ``rank_embedding``: the reward: embedding distance to the prototype;
- ``rank_roi_cosine``: cosine of the frozen backbone's 7 x 7 RoI features with the exemplars' (mean over them);
- ``rank_pooled_cosine``: the same, average-pooled;
- ``rank_ncc``: normalized cross-correlation with the exemplar crops (16 x 16, ``models.calibration``);
- ``whole``: the whole image.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_photo_rankers_val.py [--bundle B]  # qloc fetch-real-photos
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.bundle import load_bundle  # noqa: E402
from models.core.boxes import candidate_boxes, paired_iou  # noqa: E402
from models.core.templates import box_ncc, make_templates, mean_ncc  # noqa: E402
from models.data import realphotos  # noqa: E402
from models.inference import Localizer, exemplar_canvas, normalize, preprocess  # noqa: E402
from models.instances import find_instances  # noqa: E402


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)


@torch.inference_mode()
def main(bundle_path: str) -> None:
    torch.set_num_threads(1)
    bundle = load_bundle(bundle_path, "cpu")
    loc = Localizer(bundle, "cpu")
    agent, size, emb = loc.agent(), loc.spec.size, bundle.embedder
    cands = candidate_boxes(size, 40, size, sides=8, stride=16, max_aspect=2.0, min_fraction=1.0)
    hits: dict[str, list[torch.Tensor]] = {}
    for c in realphotos.classes():
        crops = [torch.from_numpy(np.asarray(p.image.crop(tuple(round(v) for v in p.box)))).permute(2, 0, 1)
                 .float() / 255 for p in realphotos.load("exemplar", c)]
        proto = loc.prototype(crops)
        canvases, crop_boxes = exemplar_canvas(crops, loc.spec)
        ex_roi = emb.roi(emb.features(normalize(canvases, loc.spec)), crop_boxes[:, None])[:, 0]  # [E, C, 7, 7]
        photos = realphotos.load("val", c)
        batch, scales = preprocess([p.image for p in photos], loc.spec)
        gt = torch.tensor([p.box for p in photos]) / torch.cat([scales, scales], 1)
        n = len(photos)
        feats = emb.features(normalize(batch, loc.spec))
        ro = loc.run_features(feats, proto, agent)
        found = find_instances(emb, agent, feats, proto, bundle.config.env, size, 2, ro.boxes[-1], ro.distances[-1])
        roi = emb.roi(feats, cands.expand(n, -1, -1))  # [n, K, C, 7, 7]
        scores = {
            "rank_embedding": -(emb.embed_roi(roi) - proto).norm(dim=-1),
            "rank_roi_cosine": (unit(roi.flatten(2)) @ unit(ex_roi.flatten(1)).T).mean(-1),
            "rank_pooled_cosine": (unit(roi.mean((-1, -2))) @ unit(ex_roi.mean((-1, -2))).T).mean(-1),
            "rank_ncc": mean_ncc(box_ncc(batch, cands.expand(n, -1, -1), make_templates(crops), jitter=0.0)
                                 .flatten(0, 1)).view(n, -1),
        }
        boxes = {"agent": ro.boxes[-1], "instances": found.boxes[:, 0]}
        boxes.update({k: cands[v.argmax(1)] for k, v in scores.items()})
        boxes["whole"] = torch.tensor([[0.0, 0.0, size, size]]).expand(n, 4)
        row = {"class": c, "images": n}
        for k, v in boxes.items():
            hit = (paired_iou(v.float(), gt) >= 0.5).float()
            hits.setdefault(k, []).append(hit)
            row[k] = round(float(hit.mean()) * 100, 1)
        print(json.dumps(row), flush=True)
    print(json.dumps({"class": "all (per image)", "candidates": len(cands),
                      **{k: round(float(torch.cat(v).mean()) * 100, 1) for k, v in hits.items()}}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=str(ROOT / "bundles" / "photo-mammals.pt"))
    main(ap.parse_args().bundle)
