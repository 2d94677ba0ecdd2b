"""The shipped bundles through the API: a real RGB photo of any size, and cMNIST on the default bundle."""

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from service_fixtures import make_test_settings, migrate

from models.core.boxes import paired_iou

SHIPPED = Path(__file__).resolve().parents[2] / "bundles"


@pytest.fixture
def shipped_client(tmp_path):
    from fastapi.testclient import TestClient

    from app.config import Settings
    from app.main import create_app

    s = make_test_settings(tmp_path, SHIPPED, default_bundle=Settings().default_bundle, max_file_bytes=5_000_000,
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


@pytest.mark.parametrize("bundle", ["photo-mammals", "photo-general"])
def test_photo_bundle_on_real_photos_of_any_size(shipped_client, bundle):
    from skimage import data

    cat = data.chelsea()  # 300 x 451 RGB
    face = cat[40:250, 110:330]  # the cat's head and chest
    r = shipped_client.post("/v1/exemplar-sets", data={"bundle": bundle, "name": "cat"},
                            files=[("files", ("face.jpg", _jpeg(face), "image/jpeg"))])
    assert r.status_code == 201, r.text
    assert r.json()["bundle"] == bundle
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


def _iou(box, gt) -> float:
    import torch

    return float(paired_iou(torch.tensor(box, dtype=torch.float32), torch.tensor(gt, dtype=torch.float32)))


# Hand-labeled boxes (x1, y1, x2, y2) on skimage's photos, read off a drawn 50-px grid.
ASTRONAUT_HEAD = (150, 15, 300, 160)  # Eileen Collins' head and hair, 512 x 512
CAMERAMAN_PERSON = (0, 65, 340, 512)  # the man with his camera (not the tripod's legs), 512 x 512


def test_photo_bundle_on_real_photos_with_known_boxes(shipped_client):
    """The shipped photo bundle, queried with a cat's face from another photo (chelsea), on two real photos
    with hand-labeled boxes.

    Best-of-16 search finds the astronaut's head and the cameraman (IoU >= 0.5): a bundle that answers
    the whole image, or a constant box, fails. The greedy default does NOT succeed on either today (the
    whole astronaut image; a box around the cameraman's upper body): pinned here as what it does, the
    real-photo floor belongs to the photo issue, which must move these two assertions, not delete them.
    """
    from skimage import data

    cat = data.chelsea()
    r = shipped_client.post("/v1/exemplar-sets", data={"bundle": "photo-mammals", "name": "mammal"},
                            files=[("files", ("face.png", _png(cat[40:250, 110:330]), "image/png"))])
    assert r.status_code == 201, r.text
    url = f"/v1/exemplar-sets/{r.json()['id']}/localize"
    uploads = [("files", ("astronaut.png", _png(data.astronaut()), "image/png")),
               ("files", ("camera.png", _png(data.camera()), "image/png"))]
    # one image per request: the sampled episodes draw from one seeded stream per request
    best = [shipped_client.post(url, params={"samples": 15}, files=[u]) for u in uploads]
    assert all(b.status_code == 200 for b in best), [b.text for b in best]
    astronaut, camera = (b.json()["results"][0]["box"] for b in best)
    assert _iou(astronaut, ASTRONAUT_HEAD) >= 0.5
    assert _iou(camera, CAMERAMAN_PERSON) >= 0.5

    greedy = shipped_client.post(url, files=uploads).json()["results"]
    assert greedy[0]["box"] == [0.0, 0.0, 512.0, 512.0]  # today's failure: the whole image
    assert 0.3 <= _iou(greedy[1]["box"], CAMERAMAN_PERSON) < 0.5


def test_api_boxes_match_the_cli(shipped_client, tmp_path, capsys):
    """The same files through the API and through ``qloc localize`` give the same boxes, and they are right."""
    import json

    import torch

    from app.config import Settings
    from models.cli import main
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    def png(t):
        return _png((t[0].numpy() * 255).round().astype(np.uint8))

    crops = [png(c) for c in exemplar_crops(cmnist(4, "train", 5, seed=1000))]
    test = cmnist(4, "test", 16, seed=3)
    images = [png(im) for im in test.images]
    paths = []
    for name, blob in [*((f"crop{i}.png", c) for i, c in enumerate(crops)),
                       *((f"img{i}.png", b) for i, b in enumerate(images))]:
        (tmp_path / name).write_bytes(blob)
        paths.append(str(tmp_path / name))
    r = shipped_client.post("/v1/exemplar-sets", files=[("files", (f"c{i}.png", c, "image/png"))
                                                        for i, c in enumerate(crops)])
    sid = r.json()["id"]
    for samples in (0, 3):
        api = [shipped_client.post(f"/v1/exemplar-sets/{sid}/localize", params={"samples": samples},
                                   files=[("files", (f"{i}.png", b, "image/png")) for i, b in enumerate(half)])
               for half in (images[:8], images[8:])]  # at most 8 files per request
        assert all(a.status_code == 200 for a in api), [a.text for a in api]
        api_results = [x for a in api for x in a.json()["results"]]
        api_boxes = [x["box"] for x in api_results]
        cli_results = []
        for half in (paths[5:13], paths[13:]):  # the same batches as the API's (sampling is seeded per batch)
            assert main(["localize", "--bundle", str(SHIPPED / f"{Settings().default_bundle}.pt"), "--device", "cpu",
                         "--samples", str(samples), "--exemplars", *paths[:5], "--images", *half]) == 0
            cli = json.loads(capsys.readouterr().out)
            assert cli["samples"] == samples and cli["nearest"] is False
            cli_results += cli["results"]
        cli_boxes = [x["box"] for x in cli_results]
        assert torch.allclose(torch.tensor(api_boxes), torch.tensor(cli_boxes), atol=1e-3)
        assert [x["score"] for x in api_results] == pytest.approx([x["score"] for x in cli_results],
                                                                            rel=1e-5)
        hits = (paired_iou(torch.tensor(api_boxes), test.boxes) >= 0.5).float().mean().item()
        assert hits >= 0.8, hits  # ~0.97 on 500 such images (BENCHMARKS.md)
        assert len({tuple(b) for b in api_boxes}) > 8  # one answer per image, not a constant


def test_the_cli_decodes_files_as_the_api_does(shipped_client, tmp_path, capsys):
    """``qloc localize`` on a JPEG stored sideways (EXIF orientation 6): the upright frame's size and the API's box
    for the same file; a GIF and an animated PNG are refused, as the API refuses them."""
    import json

    from app.config import Settings
    from models.cli import main
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    crops = [_png((c[0].numpy() * 255).round().astype(np.uint8)) for c in exemplar_crops(cmnist(4, "train", 5))]
    scene = cmnist(4, "test", 1, seed=5).images[0][0].numpy()
    upright = Image.fromarray((np.pad(scene, ((0, 0), (0, 84))) * 255).round().astype(np.uint8))  # 168 x 84
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    upright.transpose(Image.Transpose.ROTATE_90).save(buf, "JPEG", exif=exif, quality=95)  # stored 84 x 168
    paths = []
    for i, c in enumerate(crops):
        (tmp_path / f"c{i}.png").write_bytes(c)
        paths.append(str(tmp_path / f"c{i}.png"))
    (tmp_path / "side.jpg").write_bytes(buf.getvalue())
    sid = shipped_client.post("/v1/exemplar-sets", files=[("files", (f"c{i}.png", c, "image/png"))
                                                          for i, c in enumerate(crops)]).json()["id"]
    api = shipped_client.post(f"/v1/exemplar-sets/{sid}/localize",
                              files=[("files", ("side.jpg", buf.getvalue(), "image/jpeg"))]).json()["results"][0]
    bundle = str(SHIPPED / f"{Settings().default_bundle}.pt")
    assert main(["localize", "--bundle", bundle, "--device", "cpu", "--exemplars", *paths,
                 "--images", str(tmp_path / "side.jpg")]) == 0
    cli = json.loads(capsys.readouterr().out)["results"][0]
    assert (cli["width"], cli["height"]) == (api["width"], api["height"]) == (168, 84)
    assert cli["box"] == pytest.approx(api["box"], abs=0.5)
    (tmp_path / "cut.jpg").write_bytes(buf.getvalue()[:400])  # truncated: named, as the API names it
    assert main(["localize", "--bundle", bundle, "--device", "cpu", "--exemplars", *paths,
                 "--images", str(tmp_path / "cut.jpg")]) == 2
    assert "cut.jpg: cannot decode image" in capsys.readouterr().err
    for bad in (["--samples", "-1"], ["--samples", "64"], ["--device", "gpu"]):  # refused by the parser, as by the API
        with pytest.raises(SystemExit) as e:
            main(["localize", "--bundle", bundle, *bad, "--exemplars", *paths, "--images", str(tmp_path / "side.jpg")])
        assert e.value.code == 2 and ("not in 0..63" in capsys.readouterr().err or bad[0] == "--device")
    from app.config import MAX_SAMPLES
    from models.cli import MAX_SEARCH_SAMPLES
    assert MAX_SEARCH_SAMPLES == MAX_SAMPLES
    frames = [Image.new("L", (20, 20), v) for v in (0, 255)]
    for name, fmt in (("still.gif", "GIF"), ("moving.png", "PNG")):
        frames[0].save(tmp_path / name, fmt, save_all=True, append_images=frames[1:])
        assert main(["localize", "--bundle", bundle, "--device", "cpu", "--exemplars", *paths,
                     "--images", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert ("PNG, JPEG or WebP" in err) if fmt == "GIF" else ("animated" in err), err


@pytest.mark.parametrize(("bundle", "digit"), [(None, 4), (None, 7), ("mnist-digit4", 4)])
def test_cmnist_bundles_localize_through_the_api(shipped_client, bundle, digit):
    """The served default (``mnist-general``, all ten digits) and the paper's one-digit bundle."""
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    ex = cmnist(digit, "train", 5, seed=1000)
    test = cmnist(digit, "test", 40, seed=0)

    def png(t):
        return _png((t[0].numpy() * 255).round().astype(np.uint8))

    files = [("files", (f"{i}.png", png(c), "image/png")) for i, c in enumerate(exemplar_crops(ex))]
    r = shipped_client.post("/v1/exemplar-sets", data={"bundle": bundle} if bundle else {}, files=files)
    assert r.status_code == 201 and r.json()["bundle"] == (bundle or "mnist-general")
    sid = r.json()["id"]
    import torch

    boxes = []
    for i in range(0, 40, 8):
        uploads = [("files", (f"{j}.png", png(test.images[j]), "image/png")) for j in range(i, i + 8)]
        r = shipped_client.post(f"/v1/exemplar-sets/{sid}/localize", files=uploads)
        boxes += [x["box"] for x in r.json()["results"]]
    corloc = float((paired_iou(torch.tensor(boxes), test.boxes) >= 0.5).float().mean() * 100)
    assert corloc >= 85.0  # the shipped bundles score 96-99.5 on such images (BENCHMARKS.md)


def test_a_digit_set_on_the_default_bundle_is_found_on_its_digit_and_not_on_others(shipped_client):
    """The default bundle's known-kinds verifier (``bundles/mnist-general.verifier``): a set of 4s is matched to the
    kind '4', and ``found`` then tells 4s from other digits (the calibrated NCC fit alone called about a third of
    other digits found); a set of glyphs, a kind it never saw, keeps the fit (``kind`` null)."""
    import torch

    from models.data.glyphs import glyphs
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    def png(t):
        return _png((t[0].numpy() * 255).round().astype(np.uint8))

    def new_set(ex):
        r = shipped_client.post("/v1/exemplar-sets", files=[("files", (f"{i}.png", png(c), "image/png"))
                                                             for i, c in enumerate(exemplar_crops(ex))])
        assert r.status_code == 201, r.text
        return r.json()

    es = new_set(cmnist(4, "train", 5, seed=1000))
    assert es["kind"] == "4" and es["calibrated"]
    assert shipped_client.get(f"/v1/exemplar-sets/{es['id']}").json()["kind"] == "4"
    fours = cmnist(4, "test", 16, seed=0)
    others = [cmnist(d, "test", 2, seed=0).images for d in (0, 1, 2, 3, 5, 6, 7, 9)]
    url = f"/v1/exemplar-sets/{es['id']}/localize"
    answers = []
    for batch in (fours.images[:8], fours.images[8:], torch.cat(others[:4]), torch.cat(others[4:])):
        uploads = [("files", (f"{i}.png", png(im), "image/png")) for i, im in enumerate(batch)]
        r = shipped_client.post(url, files=uploads)
        assert r.status_code == 200, r.text
        answers += r.json()["results"]
    right = paired_iou(torch.tensor([a["box"] for a in answers[:16]]), fours.boxes) >= 0.5
    found = torch.tensor([a["found"] for a in answers])
    assert all(0.0 <= a["confidence"] <= 1.0 and a["found"] == (a["confidence"] >= 0.5) for a in answers)
    assert int((found[:16] & right).sum()) >= 14
    assert int(found[16:].sum()) <= 1  # of 16 other digits
    assert new_set(glyphs("K", "train", 5, seed=1000))["kind"] is None


@pytest.mark.parametrize("ncc_bias", [-20.0, 20.0])
def test_a_digit_sets_answers_do_not_depend_on_which_path_takes_the_second_look(tmp_path, ncc_bias):
    """On a set with a known-kinds check, ``max_instances=1`` takes the second look in the engine's forward pass and
    ``max_instances=2`` in a second call of the route (as with workers or a GPU): both take it only where the check
    and the calibration's NCC fit both doubt the answer. The set's NCC fit is set to doubt every answer (then the
    check decides: some images are looked at again) or none (then none is, whatever the check says); either way
    every image gets the same answer by both paths: 4s, 4s on a wider canvas, other digits."""
    import json

    import torch
    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine, text

    from app.config import Settings
    from app.main import create_app
    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    def png(t):
        return _png((t[0].numpy() * 255).round().astype(np.uint8))

    settings = make_test_settings(tmp_path, SHIPPED, default_bundle=Settings().default_bundle)
    migrate(settings.database_url)
    crops = [("files", (f"{i}.png", png(c), "image/png")) for i, c in enumerate(exemplar_crops(
        cmnist(4, "train", 3, seed=1000)))]
    with TestClient(create_app(settings)) as client:
        es = client.post("/v1/exemplar-sets", files=crops).json()
    assert es["kind"] == "4"
    engine = create_engine(settings.database_url)
    with engine.begin() as c:  # before any localize reads it (parsed calibrations are cached per set)
        cal = json.loads(c.execute(text("SELECT calibration FROM exemplar_sets")).scalar_one())
        cal["ncc"]["bias"], cal["ncc"]["weights"] = ncc_bias, [0.0] * len(cal["ncc"]["weights"])
        c.execute(text("UPDATE exemplar_sets SET calibration = :c"), {"c": json.dumps(cal)})
    engine.dispose()
    fours = cmnist(4, "test", 3, seed=3).images
    wide = torch.cat([fours, torch.zeros_like(fours)], dim=-1)  # 168 x 84, the 4 on the left
    others = torch.cat([cmnist(d, "test", 1, seed=3).images for d in (1, 7)])  # 8 files: the tests' limit
    uploads = [("files", (f"{i}.png", png(im), "image/png")) for i, im in enumerate([*fours, *wide, *others])]
    with TestClient(create_app(settings)) as client:
        url = f"/v1/exemplar-sets/{es['id']}/localize"

        def looks() -> float:  # second looks so far (reranked or kept)
            return sum(float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
                       if line.startswith("qloc_localize_second_looks_total{"))

        r = client.post(url, files=uploads)
        assert r.status_code == 200, r.text
        one, by_engine = r.json()["results"], looks()
        two = client.post(f"{url}?max_instances=2", files=uploads).json()["results"]
        by_route = looks() - by_engine
    for a, b in zip(one, two, strict=True):
        assert a["box"] == pytest.approx(b["box"], abs=1e-2) and a["found"] == b["found"], (a, b)
        assert a.get("reranked") == b.get("reranked") and a["confidence"] == pytest.approx(b["confidence"], abs=1e-6)
    assert by_engine == by_route and (by_engine > 0) == (ncc_bias < 0)  # the NCC fit sure of every answer: no look


def test_a_dithered_upload_is_localized_as_its_gray_original(shipped_client):
    """1-bit uploads (dithered: a fax, a scan) are read descreened (``app.images.BILEVEL_SIGMA``): read as raw dots,
    about half the answers missed the digit (BENCHMARKS.md, "Bilevel images")."""
    import torch

    from models.data.types import exemplar_crops
    from models.experiments.cmnist import cmnist

    def png(t, bilevel=False):
        im = Image.fromarray((t[0].numpy() * 255).round().astype(np.uint8))
        buf = io.BytesIO()
        (im.convert("1") if bilevel else im).save(buf, "PNG")
        return buf.getvalue()

    crops = [png(c) for c in exemplar_crops(cmnist(4, "train", 5, seed=1000))]
    sid = shipped_client.post("/v1/exemplar-sets", files=[("files", (f"c{i}.png", c, "image/png"))
                                                          for i, c in enumerate(crops)]).json()["id"]
    test = cmnist(4, "val", 16, seed=11)
    results = []
    for half in (test.images[:8], test.images[8:]):
        r = shipped_client.post(f"/v1/exemplar-sets/{sid}/localize",
                                files=[("files", (f"{i}.png", png(t, bilevel=True), "image/png"))
                                       for i, t in enumerate(half)])
        assert r.status_code == 200, r.text
        results += r.json()["results"]
    hits = (paired_iou(torch.tensor([x["box"] for x in results]), test.boxes) >= 0.5).sum().item()
    assert hits >= 14, hits  # 100 % of 100 validation images descreened, 51 % read as raw dots
    assert sum(x["found"] for x in results) >= 13
