"""Exploration (chosen on validation images; ``--split test`` previews a rule chosen there): would template
matching's best box help as one more candidate of the second look (``rerank=auto``)? Not a served option: a lead,
measured in the library the way the service answers.

Per target (``glyph:CHAR:BACKGROUND`` or ``digit:D:BACKGROUND``; ``:absent`` adds 198 images of the other digits),
on the default bundle's starting policy: a set of 5 crops calibrated as the service calibrates a new set
(``app.calibration.calibrate_new_set``), 200 validation images, the agent's answer and its 4 several-instances
candidates (``max_instances=4``) and the template-matching baseline's best box (``models.experiments.baselines``:
the 5 crops at 5 scales around their own size, as the benchmarks' baseline), each scored and given its confidence
as the service does. Then, replayed: the agent's answer; the second look as served (an answer below half the
threshold, the likeliest of the 4 candidates if it reaches the threshold); the same with the template box among
the candidates; the template box alone. Per rule: CorLoc, false alarms (``found`` on images without the object),
precision / recall of ``found``:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/second_look_templates_val.py \\
        glyph:A:patch glyph:K:patch glyph:R:patch glyph:e:patch 'glyph:#:patch' 'glyph:&:patch' 'glyph:@:patch' \\
        'glyph:?:patch' digit:2:clutter digit:2:impulse digit:2:gaussian digit:4:patch:absent digit:7:patch:absent
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torchvision.transforms.functional import to_pil_image

from app.calibration import RERANK_CANDIDATES, SECOND_LOOK_BELOW, calibrate_new_set
from app.config import Settings
from app.inference import BundleRegistry
from models.calibration import Calibration
from models.core.boxes import paired_iou
from models.data.types import exemplar_crops
from models.experiments.baselines import template_matching
from models.experiments.datasets import CMnistKind, GlyphKind
from models.inference import normalize

ROOT = Path(__file__).resolve().parent.parent
THRESHOLD = 0.5
"""A new set's threshold (the service's default)."""
SAMPLES = Settings.model_fields["calibration_samples"].default
"""A new set's calibration samples (the service's default)."""
BARS = (0.7, 0.8, 0.9)
"""Stricter bars for the template box than the threshold (the other candidates keep the threshold)."""


def target_rows(loaded, target: str, seed: int, split: str = "val") -> dict:
    """One target's replayed rules."""
    loc, bundle, agent = loaded.localizer, loaded.bundle, loaded.localizer.agent()
    what, name, background, *extra = target.split(":")
    kind = GlyphKind(name, background) if what == "glyph" else CMnistKind(int(name), background)
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, seed))
    proto = loc.prototype(crops)
    cal = Calibration.from_dict(calibrate_new_set(loaded, proto, [to_pil_image(c) for c in crops], [], [],
                                                  threshold=THRESHOLD, samples=SAMPLES).calibration)
    val = kind.draw(bundle, split, 200, seed)
    images, present = val.images, len(val.images)
    if "absent" in extra:
        images = torch.cat([images] + [CMnistKind(d, background).draw(bundle, split, 22, seed).images
                                       for d in range(10) if d != int(name)])
    n, k = len(images), RERANK_CANDIDATES
    with torch.inference_mode():
        answers = loc.localize_batch(images, torch.ones(n, 2), proto, agent, max_instances=k)
        feats = loc.embedder.features(normalize(images, loc.spec))
        tm = template_matching(images, crops)  # [n, 4]
        tm_distance = (loc.embedder.embed(feats, tm[:, None]) - proto).norm(dim=-1)[:, 0]
    # every image's row: the answer, its k candidates (padded with the answer), the template box
    boxes, scores = [], []
    for r, box, d in zip(answers, tm, tm_distance, strict=True):
        inst = (r.instances or [])[:k]
        boxes.append([r.box] + [i.box for i in inst] + [r.box] * (k - len(inst)) + [tuple(box.tolist())])
        scores.append([r.score] + [i.score for i in inst] + [r.score] * (k - len(inst)) + [float(d)])
    b, s = torch.tensor(boxes), torch.tensor(scores, dtype=torch.float64)
    conf = cal.box_confidence(images, b, s)  # [n, 2 + k]
    iou = torch.zeros(n, 2 + k)
    for c in range(2 + k):
        iou[:present, c] = paired_iou(b[:present, c], val.boxes)

    def second_look(candidates: list[int], template_bar: float = THRESHOLD) -> torch.Tensor:
        """The served rule over ``candidates``; the template box (column ``k + 1``) must reach ``template_bar``."""
        chosen = torch.zeros(n, dtype=torch.long)
        c = conf[:, candidates].clone()
        if k + 1 in candidates:
            c[:, candidates.index(k + 1)] = torch.where(conf[:, k + 1] >= template_bar, c[:, candidates.index(k + 1)],
                                                        -1.0)
        best = c.max(1)
        take = (conf[:, 0] < SECOND_LOOK_BELOW * THRESHOLD) & (best.values >= THRESHOLD)
        chosen[take] = torch.tensor(candidates)[best.indices[take]]
        return chosen

    def take_window(bar: float) -> torch.Tensor:
        """The served second look, then the template box over whatever it chose, wherever the box reaches ``bar``
        and is likelier than the choice (doubtful or not)."""
        chosen = second_look(list(range(1, k + 2)), bar)
        window = (conf[:, k + 1] >= bar) & (conf[:, k + 1] > conf[torch.arange(n), chosen])
        return torch.where(window, torch.full_like(chosen, k + 1), chosen)

    rules = {"agent": torch.zeros(n, dtype=torch.long), "second look (served)": second_look(list(range(1, k + 1))),
             "second look + template box": second_look(list(range(1, k + 2))),
             **{f"second look + template box reaching {bar}": second_look(list(range(1, k + 2)), bar)
                for bar in BARS},
             **{f"template box over any answer, likelier and reaching {bar}": take_window(bar) for bar in BARS},
             "template box": torch.full((n,), k + 1, dtype=torch.long)}
    out: dict = {"target": target, "images": present, "absent": n - present}
    rows = torch.arange(n)
    for label, chosen in rules.items():
        right, found = iou[rows, chosen] >= 0.5, conf[rows, chosen] >= THRESHOLD
        hits = int((found[:present] & right[:present]).sum())
        out[label] = {"corloc": round(100 * float(right[:present].float().mean()), 1),
                      "false_alarms": int(found[present:].sum()),
                      "precision": round(hits / max(int(found.sum()), 1), 3), "recall": round(hits / present, 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+")
    p.add_argument("--bundle", default="mnist-general")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("val", "test"), default="val",
                   help="test: only once a rule was chosen on val (its preview, not a choice)")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    loaded = BundleRegistry(ROOT / "bundles", "cpu").get(a.bundle)
    results = []
    for target in a.targets:
        results.append(target_rows(loaded, target, a.seed, a.split))
        print(json.dumps(results[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
