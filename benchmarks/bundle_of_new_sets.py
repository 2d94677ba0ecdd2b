"""The bundle a set that names none gets, on color cMNIST-style images: the API in process (the service's defaults,
the shipped bundles, SQLite in a temporary directory), no server needed.

cMNIST test images of ``--digits`` (84 x 84, patch background) with the object's box tinted red (green and blue
scaled by 0.35: colorfulness ~45, far above ``app.bundle_choice.COLOR_MIN``), and 5 exemplar crops of the train
split (28 px), tinted or left gray. For each, a set with no ``bundle`` field (what the server picks is reported), one
with ``bundle=mnist-general`` and one with ``bundle=photo-general``; CorLoc of the answers (IoU >= 0.5).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bundle_of_new_sets.py        # ~3 min on 2 cores

The real photographs' side of the choice is ``benchmarks/real_photo_http.py --bundle auto``.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _client import emit  # noqa: E402
from PIL import Image  # noqa: E402

from app.config import Settings  # noqa: E402
from models.core.metrics import corloc  # noqa: E402
from models.data.types import exemplar_crops  # noqa: E402
from models.experiments.cmnist import cmnist  # noqa: E402

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"


def png(image: torch.Tensor, tinted: tuple[float, float, float, float] | None) -> bytes:
    """A ``[1, H, W]`` gray image in [0, 1] -> RGB PNG bytes, the region ``tinted`` (x1, y1, x2, y2) red."""
    gray = image[0].numpy()
    rgb = np.stack([gray, gray, gray], -1)
    if tinted is not None:
        x1, y1, x2, y2 = (round(float(v)) for v in tinted)
        rgb[y1:y2, x1:x2, 1:] *= 0.35
    buf = io.BytesIO()
    Image.fromarray((rgb * 255).round().astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--digits", type=int, nargs="+", default=[4, 7])
    p.add_argument("--n", type=int, default=100, help="test images per digit")
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
    rows = []
    with TestClient(create_app(settings)) as c:
        for digit in a.digits:
            train, test = cmnist(digit, "train", 5, seed=1), cmnist(digit, "test", a.n, seed=0)
            images = [png(im, box) for im, box in zip(test.images, test.boxes, strict=True)]
            for exemplars in ("tinted", "gray"):
                crops = [png(cr, (0, 0, cr.shape[2], cr.shape[1]) if exemplars == "tinted" else None)
                         for cr in exemplar_crops(train)]
                for named in (None, "mnist-general", "photo-general"):
                    r = c.post("/v1/exemplar-sets", data={} if named is None else {"bundle": named},
                               files=[("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(crops)])
                    r.raise_for_status()
                    made = r.json()
                    boxes = []
                    for i in range(0, len(images), 8):
                        r = c.post(f"/v1/exemplar-sets/{made['id']}/localize",
                                   files=[("files", (f"{k}.png", b, "image/png"))
                                          for k, b in enumerate(images[i:i + 8])])
                        r.raise_for_status()
                        boxes += [res["box"] for res in r.json()["results"]]
                    row = {"digit": digit, "exemplars": exemplars, "bundle_field": named or "(none)",
                           "bundle": made["bundle"], "corloc": round(corloc(torch.tensor(boxes), test.boxes), 1)}
                    print(row, file=sys.stderr, flush=True)
                    rows.append(row)
    emit({"images_per_digit": a.n, "rows": rows}, a.out)


if __name__ == "__main__":
    main()
