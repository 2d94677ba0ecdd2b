"""The shipped bundles through the API: a real RGB photo of any size, and cMNIST on the default bundle."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from service_fixtures import make_test_settings, migrate

from models.boxes import paired_iou

SHIPPED = Path(__file__).resolve().parents[2] / "bundles"


@pytest.fixture
def shipped_client(tmp_path):
    from fastapi.testclient import TestClient

    from app.main import create_app

    s = make_test_settings(tmp_path, SHIPPED, default_bundle="mnist-digit4", max_file_bytes=5_000_000,
                           max_image_pixels=4_000_000)
    migrate(s.database_url)
    with TestClient(create_app(s)) as c:
        yield c


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _jpeg(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_photo_bundle_on_real_photos_of_any_size(shipped_client):
    from skimage import data

    cat = data.chelsea()  # 300 x 451 RGB
    face = cat[40:250, 110:330]  # the cat's head and chest
    r = shipped_client.post("/v1/exemplar-sets", data={"bundle": "photo-mammals", "name": "cat"},
                            files=[("files", ("face.jpg", _jpeg(face), "image/jpeg"))])
    assert r.status_code == 201, r.text
    assert r.json()["bundle"] == "photo-mammals"
    sid = r.json()["id"]
    astronaut = data.astronaut()  # 512 x 512
    gray = (np.asarray(Image.fromarray(cat).convert("L")))  # grayscale uploads are converted to RGB
    uploads = [("cat.png", _png(cat), "image/png"), ("astronaut.jpg", _jpeg(astronaut), "image/jpeg"),
               ("gray.png", _png(gray), "image/png")]
    r = shipped_client.post(f"/v1/exemplar-sets/{sid}/localize", params={"trajectory": "true"},
                            files=[("files", u) for u in uploads])
    assert r.status_code == 200, r.text
    assert r.json()["nearest"] is True  # the photo bundle's own default answer
    results = r.json()["results"]
    assert [x["filename"] for x in results] == ["cat.png", "astronaut.jpg", "gray.png"]
    for res, (w, h) in zip(results, [(451, 300), (512, 512), (451, 300)], strict=True):
        assert (res["width"], res["height"]) == (w, h)
        x1, y1, x2, y2 = res["box"]
        assert 0 <= x1 < x2 <= w + 1e-3 and 0 <= y1 < y2 <= h + 1e-3
        assert res["trajectory"][0] == [0.0, 0.0, float(w), float(h)]
        assert len(res["trajectory"]) == 11


def test_default_bundle_localizes_cmnist(shipped_client):
    from models.experiments import cmnist
    from models.train_agent import exemplar_crops

    ex = cmnist(4, "train", 5, seed=1000)
    test = cmnist(4, "test", 40, seed=0)

    def png(t):
        return _png((t[0].numpy() * 255).round().astype(np.uint8))

    r = shipped_client.post("/v1/exemplar-sets", files=[("files", (f"{i}.png", png(c), "image/png"))
                                                        for i, c in enumerate(exemplar_crops(ex))])
    assert r.status_code == 201 and r.json()["bundle"] == "mnist-digit4"
    sid = r.json()["id"]
    import torch

    boxes = []
    for i in range(0, 40, 8):
        uploads = [("files", (f"{j}.png", png(test.images[j]), "image/png")) for j in range(i, i + 8)]
        r = shipped_client.post(f"/v1/exemplar-sets/{sid}/localize", files=uploads)
        boxes += [x["box"] for x in r.json()["results"]]
    corloc = float((paired_iou(torch.tensor(boxes), test.boxes) >= 0.5).float().mean() * 100)
    assert corloc >= 85.0  # the shipped bundle scores ~97.6 on 500 such images (BENCHMARKS.md)
