"""Real photographs through HTTP: one photo per request, latency and CorLoc, against a running service.

    ./scripts/run &                      # wait for http://127.0.0.1:8000/readyz
    .venv/bin/python benchmarks/real_photo_http.py --bundle photo-general --out runs/real_photo_http.json
    .venv/bin/python benchmarks/real_photo_http.py --bundle auto       # sets that name no bundle

For each class of the real-photo benchmark (``models.data.realphotos``; ``qloc fetch-real-photos``) one
exemplar set is made of the exemplar photos' boxes cut from their photos (sent as PNG crops), then each val
and test photo is sent alone (its own file: WebP, JPEG or PNG) and timed from request to parsed answer
(upload, decode, resize, localize, JSON). Two warm-up requests are not timed; each set's creation is
(``set_creation_s``: it fits the set's "not found" calibration). Prints the latency percentiles over all
photos and over the photos up to 1024 px and above, and the CorLoc of the answers per split (it must match
``benchmarks/real_photos.py``'s ``nearest``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _client import client, emit, percentiles, pil_png  # noqa: E402

from models.core.boxes import paired_iou  # noqa: E402
from models.data import realphotos  # noqa: E402


def upload(photo: realphotos.RealPhoto) -> tuple[str, bytes, str]:
    """The photo's own file (WebP, JPEG or PNG), as a user would send it."""
    path = realphotos.real_photo_dir() / "images" / photo.file_name
    suffix = path.suffix.lower()
    return f"photo{suffix}", path.read_bytes(), {".png": "image/png", ".webp": "image/webp"}.get(suffix, "image/jpeg")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--bundle", default="photo-general", help="`auto`: name none (the server picks by the crops)")
    p.add_argument("--out")
    a = p.parse_args()
    with client(a.url, a.api_key) as c:
        c.get("/readyz").raise_for_status()
        times: dict[str, list[float]] = {"all": [], "<=1024px": [], ">1024px": []}
        hits: dict[str, list[bool]] = {"val": [], "test": []}
        warm, create, got = 2, [], {}
        for cls in realphotos.classes():
            crops = [pil_png(ex.image.crop(tuple(round(v) for v in ex.box))) for ex in realphotos.load("exemplar", cls)]
            t0 = time.perf_counter()
            fields = {"name": cls} if a.bundle == "auto" else {"name": cls, "bundle": a.bundle}
            r = c.post("/v1/exemplar-sets", data=fields,
                       files=[("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(crops)])
            create.append(time.perf_counter() - t0)
            r.raise_for_status()
            got[cls] = r.json()["bundle"]
            url = f"/v1/exemplar-sets/{r.json()['id']}/localize"
            for split in ("val", "test"):
                for photo in realphotos.load(split, cls):
                    f = upload(photo)
                    t0 = time.perf_counter()
                    r = c.post(url, files=[("files", f)])
                    box = r.json()["results"][0]["box"] if r.status_code == 200 else None
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    if warm:
                        warm -= 1
                    else:
                        times["all"].append(dt)
                        times["<=1024px" if max(photo.image.size) <= 1024 else ">1024px"].append(dt)
                    iou = paired_iou(torch.tensor(box), torch.tensor(photo.box, dtype=torch.float32))
                    hits[split].append(bool(iou >= 0.5))
    emit({"url": a.url, "bundle": a.bundle, "sets_got": got,
          "latency": {k: percentiles(v) for k, v in times.items() if v},
          "set_creation_s": [round(t, 1) for t in create],
          "corloc": {s: {"n": len(h), "corloc": round(100 * sum(h) / len(h), 2)} for s, h in hits.items()}}, a.out)


if __name__ == "__main__":
    main()
