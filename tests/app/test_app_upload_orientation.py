"""Uploads are seen as a viewer shows them (EXIF orientation applied) and decoded downscaled; every size and box
in the API is in the full upright image's pixels: localize's answers, exemplar boxes, and the worker's probes."""

import io
import json
import uuid

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageOps
from service_fixtures import make_test_settings, migrate, png_bytes
from test_app_images import bright_box, rotated_jpeg, scene

from app.db import make_engine, make_sessionmaker
from app.images import cut_box
from app.inference import BundleRegistry
from app.main import create_app
from app.storage import BlobStore
from worker.probes import set_examples

URL = "/v1/exemplar-sets"


def make_client(tmp_path, bundle_dir, **overrides):
    s = make_test_settings(tmp_path, bundle_dir, **overrides)
    migrate(s.database_url)
    return s, TestClient(create_app(s))


@pytest.fixture
def small(tmp_path, bundle_dir):
    """Images decoded to a longer side of at most 64 pixels."""
    s, c = make_client(tmp_path, bundle_dir, decode_max_side=64, max_file_bytes=2_000_000)
    with c:
        yield s, c


def as_png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def upright(jpeg: bytes) -> Image.Image:
    """The JPEG's pixels as a viewer shows them (PIL's own EXIF transpose)."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(jpeg)))


def flat(boxes):
    return [v for b in boxes for v in b]


def localize(client, set_id, data, name="img.jpg", ctype="image/jpeg", **params):
    r = client.post(f"{URL}/{set_id}/localize", files=[("files", (name, data, ctype))],
                    params={"trajectory": "true", **params})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def new_set(client, **form):
    r = client.post(URL, files=[("files", ("crop.png", png_bytes(28, 28, seed=9), "image/png"))], data=form)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_localize_answers_in_the_upright_frame_of_a_rotated_jpeg(client):
    set_id = new_set(client)
    jpeg = rotated_jpeg(scene(120, 80, (60, 10, 110, 40)), 6)
    assert Image.open(io.BytesIO(jpeg)).size == (80, 120)  # stored sideways
    rotated = localize(client, set_id, jpeg)
    reference = localize(client, set_id, as_png(upright(jpeg)), "up.png", "image/png")
    assert (rotated["width"], rotated["height"]) == (120, 80) == (reference["width"], reference["height"])
    assert rotated["box"] == pytest.approx(reference["box"], abs=1e-4)
    assert flat(rotated["trajectory"]) == pytest.approx(flat(reference["trajectory"]), abs=1e-4)
    assert rotated["score"] == pytest.approx(reference["score"], abs=1e-5)


def test_a_lossless_webp_answers_as_its_png_does_and_is_stored_as_webp(client, settings):
    set_id = new_set(client)
    img = scene(120, 80, (60, 10, 110, 40))
    buf = io.BytesIO()
    img.save(buf, "WEBP", lossless=True)
    webp = localize(client, set_id, buf.getvalue(), "img.webp", "image/webp")
    png = localize(client, set_id, as_png(img), "img.png", "image/png")
    assert (webp["width"], webp["height"]) == (120, 80)
    assert webp["box"] == pytest.approx(png["box"], abs=1e-4) and webp["score"] == pytest.approx(png["score"], abs=1e-5)
    r = client.post(URL, files=[("files", ("crop.webp", buf.getvalue(), "image/webp"))])  # exemplars too
    assert r.status_code == 201, r.text
    assert list((settings.storage_dir).rglob("*.webp"))  # stored as uploaded, with its own extension


def test_localize_maps_boxes_from_the_downscaled_decode_to_full_pixels(small):
    _, client = small
    set_id = new_set(client)
    big = scene(256, 192, (100, 60, 180, 120), seed=4)
    decoded = big.resize((64, 48), Image.Resampling.BICUBIC, reducing_gap=2.0)  # what the decoder makes of it
    full = localize(client, set_id, as_png(big), "big.png", "image/png")
    ref = localize(client, set_id, as_png(decoded), "small.png", "image/png")
    assert (full["width"], full["height"], ref["width"], ref["height"]) == (256, 192, 64, 48)
    assert full["box"] == pytest.approx([4 * v for v in ref["box"]], abs=1e-3)
    assert flat(full["trajectory"]) == pytest.approx([4 * v for v in flat(ref["trajectory"])], abs=1e-3)
    x1, y1, x2, y2 = full["box"]
    assert 0 <= x1 < x2 <= 256 and 0 <= y1 < y2 <= 192


@pytest.mark.parametrize("size", [(3, 500), (500, 3), (7, 7)])
def test_boxes_never_leave_the_image_by_a_rounding_error(client, size):
    """On images far from the bundle's square input the model's float32 mapping lands an edge a hair outside the
    image (3.0000002 on a width of 3): every box, trajectory and instance comes back within it."""
    set_id = new_set(client)
    img = Image.fromarray((np.random.default_rng(3).random(size[::-1]) * 255).astype(np.uint8))
    r = localize(client, set_id, as_png(img), "thin.png", "image/png", max_instances=4)
    w, h = r["width"], r["height"]
    assert (w, h) == size
    for x1, y1, x2, y2 in [r["box"], *r["trajectory"], *(i["box"] for i in r["instances"])]:
        assert 0 <= x1 <= x2 <= w and 0 <= y1 <= y2 <= h, (x1, y1, x2, y2)


def test_boxes_are_in_the_upright_frame_of_a_rotated_jpeg(client):
    box = [60, 10, 110, 40]  # inside the upright 120x80 frame, outside the stored 80x120 one (x2 > 80)
    jpeg = rotated_jpeg(scene(120, 80, tuple(box), seed=5), 6)
    r = client.post(URL, files=[("files", ("phone.jpg", jpeg, "image/jpeg"))], data={"boxes": json.dumps([box])})
    assert r.status_code == 201, r.text
    boxed = r.json()["id"]
    # The stored frame's box is refused, naming the upright size.
    r = client.post(URL, files=[("files", ("phone.jpg", jpeg, "image/jpeg"))],
                    data={"boxes": json.dumps([[10, 60, 40, 110]])})
    assert r.status_code == 422 and "120x80" in r.json()["detail"], r.text
    # The crop cut from the box is the upright crop: a set made from it directly answers the same.
    crop = cut_box(upright(jpeg), box)
    r = client.post(URL, files=[("files", ("crop.png", as_png(crop), "image/png"))])
    assert r.status_code == 201, r.text
    direct = r.json()["id"]
    probe = as_png(scene(100, 100, (30, 30, 70, 50), seed=6))
    a = localize(client, boxed, probe, "p.png", "image/png")
    b = localize(client, direct, probe, "p.png", "image/png")
    assert a["score"] == pytest.approx(b["score"], abs=1e-5) and a["box"] == pytest.approx(b["box"], abs=1e-4)


def test_a_large_boxed_image_keeps_its_crop_at_full_resolution(small):
    """With a 64-pixel decode, a 40-pixel box of a 400-pixel image is still cut from the full image."""
    _, client = small
    box = [200, 100, 240, 130]
    img = scene(400, 300, tuple(box), seed=7)
    r = client.post(URL, files=[("files", ("big.png", as_png(img), "image/png"))], data={"boxes": json.dumps([box])})
    assert r.status_code == 201, r.text
    r2 = client.post(URL, files=[("files", ("crop.png", as_png(cut_box(img, box)), "image/png"))])
    probe = as_png(scene(60, 60, (10, 10, 40, 30), seed=8))
    a = localize(client, r.json()["id"], probe, "p.png", "image/png")
    b = localize(client, r2.json()["id"], probe, "p.png", "image/png")
    assert a["score"] == pytest.approx(b["score"], abs=1e-5)


def test_the_worker_probes_see_the_upright_frame(tmp_path, bundle_dir):
    s, client = make_client(tmp_path, bundle_dir, decode_max_side=64)
    box = [60, 10, 110, 40]
    jpeg = rotated_jpeg(scene(120, 80, tuple(box), seed=5), 6)
    with client:
        r = client.post(URL, files=[("files", ("phone.jpg", jpeg, "image/jpeg"))], data={"boxes": json.dumps([box])})
        assert r.status_code == 201, r.text
        set_id = uuid.UUID(r.json()["id"])
    bundle = BundleRegistry(s.bundle_dir, "cpu").get(s.default_bundle).bundle
    size = bundle.config.input.size
    engine = make_engine(s.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            crops, probes = set_examples(session, BlobStore(s.storage_dir), set_id=set_id,
                                         spec=bundle.config.input, max_side=64)
    finally:
        engine.dispose()
    assert len(crops) == 1 and probes is not None and len(probes) == 1
    expected = [box[0] * size / 120, box[1] * size / 80, box[2] * size / 120, box[3] * size / 80]
    assert probes.boxes[0].tolist() == pytest.approx(expected, abs=1e-3)
    image = Image.fromarray((probes.images[0, 0].numpy() * 255).astype(np.uint8))
    found = bright_box(image)  # the rectangle where the box says, in the bundle's input frame
    assert all(abs(f - e) <= 2 for f, e in zip(found, expected, strict=True)), (found, expected)
