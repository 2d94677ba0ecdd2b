"""The bundle a set that names none gets, and what each bundle would answer: the API in process (the service's
defaults, the shipped bundles, SQLite in a temporary directory), no server needed.

``--what cmnist``: cMNIST test images of ``--digits`` (84 x 84, patch background) with the object's box tinted red
(green and blue scaled by 0.35: colorfulness ~45, far above ``app.bundle_choice.COLOR_MIN``), and 5 exemplar crops of
the train split (28 px), tinted or left gray. For each, a set with no ``bundle`` field (what the server picks is
reported), one with ``bundle=mnist-general`` and one with ``bundle=photo-general``; CorLoc of the answers (IoU >= 0.5).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bundle_of_new_sets.py        # ~3 min on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bundle_of_new_sets.py --scales 3   # 252 x 252 images, 84 px crops

``--what photos``: the real-photo benchmark (``qloc fetch-real-photos``) as users with other photos would send it:
``gray`` (every photo and exemplar crop in gray levels), ``small`` (every photo scaled to a longer side of
``--small-side`` pixels before its exemplar crops are cut: thumbnails, objects of 30-90 px), ``color`` (as it is).
Per class one set of the exemplar photos' boxes (PNG crops) with no ``bundle`` field and one per bundle; CorLoc
over the ``--splits`` photos (one per request, PNG).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bundle_of_new_sets.py --what photos --variants gray small

The color photographs' side through a running server is ``benchmarks/real_photo_http.py --bundle auto``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _client import emit, multipart, pil_png  # noqa: E402
from PIL import Image  # noqa: E402

from app.config import Settings  # noqa: E402
from models.core.metrics import corloc  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"


def png(image: torch.Tensor, tinted: tuple[float, float, float, float] | None, scale: int = 1) -> bytes:
    """A ``[1, H, W]`` gray image in [0, 1] -> RGB PNG bytes, the region ``tinted`` (x1, y1, x2, y2) red, the image
    enlarged ``scale`` times (bicubic)."""
    gray = image[0].numpy()
    rgb = np.stack([gray, gray, gray], -1)
    if tinted is not None:
        x1, y1, x2, y2 = (round(float(v)) for v in tinted)
        rgb[y1:y2, x1:x2, 1:] *= 0.35
    out = Image.fromarray((rgb * 255).round().astype(np.uint8))
    if scale != 1:
        out = out.resize((out.width * scale, out.height * scale), Image.BICUBIC)
    return pil_png(out)


def photo_variant(image: Image.Image, variant: str, small_side: int) -> tuple[Image.Image, float]:
    """A photo as the ``variant`` sends it, and the factor its boxes scale by."""
    if variant == "gray":
        return image.convert("L"), 1.0
    if variant == "small":
        f = small_side / max(image.size)
        return image.resize((max(1, round(image.width * f)), max(1, round(image.height * f))), Image.LANCZOS), f
    return image, 1.0


def localized(c, set_id: str, images: list[bytes]) -> list[list[float]]:
    boxes = []
    for i in range(0, len(images), 8):
        r = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=multipart(images[i:i + 8]))
        r.raise_for_status()
        boxes += [res["box"] for res in r.json()["results"]]
    return boxes


def made_set(c, crops: list[bytes], named: str | None, name: str = "set") -> dict:
    r = c.post("/v1/exemplar-sets", data={"name": name} if named is None else {"name": name, "bundle": named},
               files=multipart(crops))
    r.raise_for_status()
    return r.json()


def cmnist_rows(c, a) -> list[dict]:
    rows = []
    for digit, scale in itertools.product(a.digits, a.scales):
        train, test = cmnist(digit, "train", 5, seed=1), cmnist(digit, "test", a.n, seed=0)
        images = [png(im, box, scale) for im, box in zip(test.images, test.boxes, strict=True)]
        for exemplars in ("tinted", "gray"):
            crops = [png(cr, (0, 0, cr.shape[2], cr.shape[1]) if exemplars == "tinted" else None, scale)
                     for cr in exemplar_crops(train)]
            for named in (None, "mnist-general", "photo-general"):
                made = made_set(c, crops, named)
                boxes = localized(c, made["id"], images)
                row = {"digit": digit, "scale": scale, "exemplars": exemplars, "bundle_field": named or "(none)",
                       "bundle": made["bundle"], "corloc": round(corloc(torch.tensor(boxes), test.boxes * scale), 1)}
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def photo_rows(c, a) -> list[dict]:
    from models.data import realphotos

    rows = []
    for variant in a.variants:
        for cls in realphotos.classes():
            crops = []
            for ex in realphotos.load("exemplar", cls):
                im, f = photo_variant(ex.image, variant, a.small_side)
                crops.append(pil_png(im.crop(tuple(round(v * f) for v in ex.box))))
            photos = [p for split in a.splits for p in realphotos.load(split, cls)]
            images, truth = [], []
            for p in photos:
                im, f = photo_variant(p.image, variant, a.small_side)
                images.append(pil_png(im))
                truth.append([v * f for v in p.box])
            for named in (None, "mnist-general", "photo-general"):
                made = made_set(c, crops, named, cls)
                boxes = localized(c, made["id"], images)
                row = {"variant": variant, "class": cls, "bundle_field": named or "(none)", "bundle": made["bundle"],
                       "n": len(images), "corloc": round(corloc(torch.tensor(boxes), torch.tensor(truth)), 1)}
                print(row, file=sys.stderr, flush=True)
                rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=("cmnist", "photos"), default="cmnist")
    p.add_argument("--digits", type=int, nargs="+", default=[4, 7])
    p.add_argument("--n", type=int, default=100, help="test images per digit")
    p.add_argument("--scales", type=int, nargs="+", default=[1], help="cMNIST images and crops enlarged (bicubic)")
    p.add_argument("--variants", nargs="+", choices=("color", "gray", "small"), default=["gray", "small"])
    p.add_argument("--small-side", type=int, default=96, help="`small`: the photos' longer side (pixels)")
    p.add_argument("--splits", nargs="+", choices=("val", "test"), default=["val"])
    p.add_argument("--out")
    a = p.parse_args()
    from alembic import command
    from alembic.config import Config
    from fastapi.testclient import TestClient

    from app.main import create_app

    root = Path(tempfile.mkdtemp(prefix="qloc-bundle-choice-"))
    settings = Settings(database_url=f"sqlite:///{root}/qloc.db", broker_url=f"sqla+sqlite:///{root}/broker.db",
                        storage_dir=root / "blobs", bundle_dir=BUNDLES, device="cpu")
    cfg = Config(str(Path(__file__).resolve().parents[1] / "alembic.ini"))
    cfg.attributes["database_url"], cfg.attributes["configure_logger"] = settings.database_url, False
    command.upgrade(cfg, "head")
    with TestClient(create_app(settings)) as c:
        rows = cmnist_rows(c, a) if a.what == "cmnist" else photo_rows(c, a)
    emit({"what": a.what, "images_per_digit": a.n, "scales": a.scales, "rows": rows} if a.what == "cmnist"
         else {"what": a.what, "variants": a.variants, "small_side": a.small_side, "splits": a.splits, "rows": rows},
         a.out)


if __name__ == "__main__":
    main()
