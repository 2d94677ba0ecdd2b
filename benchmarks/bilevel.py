"""Bilevel (1-bit, dithered) uploads: the answer on a dithered image against the same image in gray, through the API.

The embedded default in this process (``TestClient``; SQLite, the shipped bundles, its default bundle), a set of
5 digit-4 crops (MNIST's training file), then cMNIST images of a 4 (``--digit``, patch background) and of a 7 (the
object absent) posted three ways: 8-bit gray, 1-bit by Floyd-Steinberg dithering (PIL's ``convert("1")``) read as it
is, and the same 1-bit file read descreened (``app.images.BILEVEL_SIGMA``, each of ``--sigmas``). Per way: CorLoc of
the answer on the 4s (IoU >= 0.5) and how many answers are ``found`` on the 4s and on the 7s. ``--split val`` (MNIST's
training file) chooses the sigma; ``--split test`` reports it once::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bilevel.py --split val --sigmas 0 0.5 0.7 1.0 1.4
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bilevel.py --split test --sigmas 0 0.7
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _client import emit, multipart  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402
from service_fixtures import migrate  # noqa: E402

import app.images  # noqa: E402
from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402
from models.core.boxes import paired_iou  # noqa: E402
from models.data.cmnist import CMnistSpec, generate  # noqa: E402


def png(gray01: np.ndarray, *, bilevel: bool) -> bytes:
    im = Image.fromarray((np.clip(gray01, 0, 1) * 255).round().astype(np.uint8), "L")
    if bilevel:
        im = im.convert("1")  # Floyd-Steinberg dithering
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=["val", "test"], default="val")
    p.add_argument("--digit", type=int, default=4)
    p.add_argument("--absent", type=int, default=7)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigmas", type=float, nargs="+", default=[0.0, app.images.BILEVEL_SIGMA])
    p.add_argument("--out")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="qloc-bilevel-"))
    s = Settings(database_url=f"sqlite:///{root}/q.db", broker_url=f"sqla+sqlite:///{root}/b.db",
                 storage_dir=root / "blobs", bundle_dir=Path("bundles"), compile_episode=False)
    migrate(s.database_url)
    ex = generate(CMnistSpec(digit=a.digit, split="train", n=5, seed=1000 + a.seed))
    crops = [png(ex.images[i, 0, int(b[1]):int(b[3]), int(b[0]):int(b[2])].numpy(), bilevel=False)
             for i, b in enumerate(ex.boxes)]
    present = generate(CMnistSpec(digit=a.digit, split=a.split, n=a.n, seed=a.seed))
    absent = generate(CMnistSpec(digit=a.absent, split=a.split, n=a.n, seed=a.seed))
    rows = []
    with TestClient(create_app(s)) as c:
        r = c.post("/v1/exemplar-sets", files=multipart(crops))
        r.raise_for_status()
        sid = r.json()["id"]

        def answer(batch, *, bilevel: bool) -> tuple[list[dict], float]:
            t0 = time.perf_counter()
            got = []
            for i in range(0, len(batch.images), 32):
                files = multipart([png(im[0].numpy(), bilevel=bilevel) for im in batch.images[i:i + 32]])
                r = c.post(f"/v1/exemplar-sets/{sid}/localize", files=files)
                r.raise_for_status()
                got += r.json()["results"]
            return got, time.perf_counter() - t0

        ways = [("gray", False, None)] + [(f"1-bit, sigma {sg}", True, sg) for sg in a.sigmas]
        for name, bilevel, sigma in ways:
            if sigma is not None:
                app.images.BILEVEL_SIGMA = sigma
            res, secs = answer(present, bilevel=bilevel)
            iou = paired_iou(torch.tensor([x["box"] for x in res]), present.boxes)
            off, _ = answer(absent, bilevel=bilevel)
            rows.append({"way": name, "corloc": round(100 * (iou >= 0.5).float().mean().item(), 1),
                         "found_present": sum(x["found"] for x in res), "found_absent": sum(x["found"] for x in off),
                         "n": a.n, "ms_per_image": round(1000 * secs / a.n, 1)})
            print(rows[-1], flush=True)
    emit({"split": a.split, "digit": a.digit, "absent": a.absent, "seed": a.seed, "bundle": s.default_bundle,
          "rows": rows}, a.out)


if __name__ == "__main__":
    main()
