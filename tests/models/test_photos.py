"""Offline photo data: fetcher and manifest on a tiny fake package set, the paste generator, splits."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models.data import debian, photo_cache_dir, photo_fetch, photos
from models.data.photo_fetch import fetch, fetch_main
from models.data.photos import PasteParams, crops, generate, load_manifest, mask_box

REAL_CACHE = photo_cache_dir()
STAMPS = "usr/share/tuxpaint/stamps"
SCRATCH_BG = "usr/share/scratch/Media/Backgrounds"
MATE_BG = "usr/share/backgrounds/mate/nature"
SCRATCH_COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: scratch

Files: *
Copyright: Copyright (c) 2011 Massachusetts Institute of Technology
License: GPL-2

Files: Help/* Media/* Projects
Copyright: Copyright (c) 2011 Massachusetts Institute of Technology
License: CC-BY-SA-3.0

Files: debian/*
Copyright: 2011 Someone
License: MIT
"""
MATE_COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/

Files: nature/Photo0.jpg
       nature/Photo1.jpg
Copyright: 2008, Jane Doe <jane@example.org>
License: GPL-2+
"""
TUX_COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/

Files: *
Copyright: 2002-2022 by Bill Kendrick
License: GPL-2
"""


def _disc(rng, side=60, color=(255, 0, 0), noise=12, radius=0.4) -> Image.Image:
    """An RGBA photo-like cut-out: a noisy coloured disc with a soft alpha edge."""
    yy, xx = np.mgrid[:side, :side] / side - 0.5
    alpha = np.clip((radius - np.hypot(xx, yy)) * side / 2, 0, 1)  # 2-px soft edge
    rgb = np.clip(np.array(color, float) + rng.normal(0, noise, (side, side, 3)), 0, 255)
    return Image.fromarray(np.dstack([rgb, alpha * 255]).round().astype(np.uint8), "RGBA")


def _noise_jpg(path: Path, rng, base=(40, 180, 60), size=(120, 90)):
    arr = np.clip(np.array(base) + rng.normal(0, 30, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
    Image.fromarray(arr).save(path, quality=95)


def _drawn_jpg(path: Path, size=(120, 90)):
    arr = np.zeros((size[1], size[0], 3), np.uint8)
    arr[:] = (250, 200, 200)
    arr[size[1] // 2:] = (90, 90, 200)
    Image.fromarray(arr).save(path, quality=95)


def _write_packages(root: Path, rng) -> dict[str, Path]:
    """Unpacked trees of the three packages, each with photos, drawings and copyright -> {pkg: tree}."""
    trees = {pkg: root / pkg for pkg in photo_fetch.PACKAGES}
    tux = trees["tuxpaint-stamps-default"]
    birds = tux / STAMPS / "animals/birds"
    (birds / "cartoon").mkdir(parents=True)
    for i in range(5):
        _disc(rng, side=50 + 10 * i).save(birds / f"bird{i}.png")
        (birds / f"bird{i}.txt").write_text(f"Bird number {i}.\nfr.utf8=Oiseau.\n")
        (birds / f"bird{i}.ogg").write_bytes(b"OggS")  # sounds are pruned
    _disc(rng, noise=0).save(birds / "flat.png")  # a drawing: flat fill
    _disc(rng).save(birds / "cartoon" / "toon.png")
    _disc(rng, side=20).save(birds / "tiny.png")  # too few opaque pixels
    _disc(rng, side=55).save(birds / "silhouette.png")
    (birds / "silhouette.dat").write_text("colorable\n")
    shutil.copyfile(birds / "bird0.png", birds / "bird0_copy.png")  # byte-identical
    fish = tux / STAMPS / "animals/fish"
    fish.mkdir(parents=True)
    for i in range(3):
        _disc(rng, color=(250, 120, 0)).save(fish / f"fish{i}.png")
    scratch = trees["scratch"] / SCRATCH_BG
    for sub in ("Nature", "Outdoors"):
        (scratch / sub).mkdir(parents=True)
    for i in range(4):
        _noise_jpg(scratch / ("Nature" if i % 2 else "Outdoors") / f"scene{i}.jpg", rng)
    _drawn_jpg(scratch / "Nature" / "cartoon-room.jpg")
    Image.new("RGB", (40, 30), (10, 20, 30)).save(scratch / "Nature" / "drawing.gif")
    mate = trees["mate-backgrounds"] / MATE_BG
    mate.mkdir(parents=True)
    for i in range(2):
        _noise_jpg(mate / f"Photo{i}.jpg", rng)
    for pkg, text in (("tuxpaint-stamps-default", TUX_COPYRIGHT), ("scratch", SCRATCH_COPYRIGHT),
                      ("mate-backgrounds", MATE_COPYRIGHT)):
        doc = trees[pkg] / "usr/share/doc" / pkg
        doc.mkdir(parents=True)
        (doc / "copyright").write_text(text)
    return trees


def _build_deb(tree: Path, pkg: str, out_dir: Path) -> Path:
    control = tree / "DEBIAN" / "control"
    control.parent.mkdir()
    control.write_text(f"Package: {pkg}\nVersion: 1.0-test\nArchitecture: all\nMaintainer: qloc <q@example.org>\n"
                       "Description: test fixture\n")
    deb = out_dir / f"{pkg}_1.0-test_all.deb"
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(tree), str(deb)], check=True, capture_output=True)
    return deb


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A cache fetched from fake .deb files (or, without dpkg-deb, from already unpacked trees)."""
    rng = np.random.default_rng(0)
    src = tmp_path_factory.mktemp("src")
    cache = tmp_path_factory.mktemp("cache")
    trees = _write_packages(src, rng)
    if shutil.which("dpkg-deb"):
        (cache / "debs").mkdir()
        for pkg, tree in trees.items():
            _build_deb(tree, pkg, cache / "debs")
    else:
        for pkg, tree in trees.items():
            shutil.copytree(tree, cache / pkg)
            (cache / pkg / photo_fetch.VERSION_FILE).write_text("1.0-test\n")
    fetch(cache, log=lambda *_: None)
    return cache


def test_fetch_unpacks_prunes_and_writes_the_manifest(cache):
    m = load_manifest(cache)
    birds = {it["name"]: it for it in m["objects"]["birds"]}
    assert set(birds) == {f"bird{i}" for i in range(5)}
    assert birds["bird2"]["description"] == "Bird number 2."
    assert birds["bird2"]["license"] == "GPL-2" and "Bill Kendrick" in birds["bird2"]["copyright"]
    assert len(m["objects"]["fish"]) == 3
    reasons = {Path(r["path"]).name: r["reason"] for r in m["rejected"]}
    assert reasons["flat.png"].startswith("drawn")
    assert "cartoon" in reasons["toon.png"]
    assert "opaque pixels" in reasons["tiny.png"]
    assert "colorable" in reasons["silhouette.png"]
    assert reasons["bird0_copy.png"] == "duplicate file" or reasons.get("bird0.png") == "duplicate file"
    assert reasons["cartoon-room.jpg"].startswith("drawn")
    bgs = {Path(it["path"]).name: it for it in m["backgrounds"]}
    assert set(bgs) == {"scene0.jpg", "scene1.jpg", "scene2.jpg", "scene3.jpg", "Photo0.jpg", "Photo1.jpg"}
    assert bgs["scene0.jpg"]["license"] == "CC-BY-SA-3.0"
    assert bgs["Photo1.jpg"]["license"] == "GPL-2+" and "Jane Doe" in bgs["Photo1.jpg"]["copyright"]
    assert set(m["sources"]) == set(photo_fetch.PACKAGES)
    for pkg in photo_fetch.PACKAGES:
        assert (cache / m["sources"][pkg]["copyright_file"]).is_file()
        if shutil.which("dpkg-deb"):
            assert m["sources"][pkg]["version"] == "1.0-test"
    assert not list(cache.rglob("*.ogg")), "sounds should be pruned"
    assert not list((cache / "debs").glob("*.deb")) if (cache / "debs").exists() else True


def test_fetch_is_idempotent(cache):
    manifest = cache / photos.MANIFEST
    before = manifest.stat().st_mtime_ns
    said = []
    assert fetch(cache, log=said.append) == manifest
    assert manifest.stat().st_mtime_ns == before and "nothing to do" in said[0]
    assert fetch_main(["--cache", str(cache)]) == 0


def test_splits_are_disjoint_by_source_file(cache):
    m = load_manifest(cache)
    groups = [*m["objects"].values(), m["backgrounds"]]
    for items in groups:
        by_split = {s: {it["path"] for it in items if it["split"] == s} for s in photos.SPLITS}
        assert all(by_split.values()), f"every split needs a file: { {s: len(v) for s, v in by_split.items()} }"
        assert not (by_split["train"] & by_split["val"] or by_split["train"] & by_split["test"]
                    or by_split["val"] & by_split["test"])
        sha = {s: {it["sha256"] for it in items if it["split"] == s} for s in photos.SPLITS}
        assert not (sha["train"] & sha["test"] or sha["train"] & sha["val"] or sha["val"] & sha["test"])
    for split in photos.SPLITS:
        batch = generate(m, "birds", split, n=6, seed=1, size=64)
        allowed_o = {it["path"] for it in m["objects"]["birds"] if it["split"] == split}
        allowed_b = {it["path"] for it in m["backgrounds"] if it["split"] == split}
        assert set(batch.objects) <= allowed_o and set(batch.backgrounds) <= allowed_b


def test_generator_is_deterministic(cache):
    a = generate(load_manifest(cache), "birds", "train", n=5, seed=7, size=96)
    b = generate(load_manifest(cache), "birds", "train", n=5, seed=7, size=96)
    c = generate(load_manifest(cache), "birds", "train", n=5, seed=8, size=96)
    assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes) and a.objects == b.objects
    assert not torch.equal(a.images, c.images)
    assert a.images.shape == (5, 3, 96, 96) and a.images.dtype == torch.float32
    assert a.boxes.shape == (5, 4) and a.masks.shape == (5, 96, 96)
    assert float(a.images.min()) >= 0 and float(a.images.max()) <= 1


def _reference_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    """Slow, obviously correct tight box of a bool mask, in pixel edges."""
    xs = [x for y in range(mask.shape[0]) for x in range(mask.shape[1]) if mask[y, x]]
    ys = [y for y in range(mask.shape[0]) for x in range(mask.shape[1]) if mask[y, x]]
    return min(xs), min(ys), max(xs) + 1, max(ys) + 1


def test_boxes_are_the_tight_box_of_the_pasted_alpha(cache):
    batch = generate(load_manifest(cache), "birds", "val", n=8, seed=3, size=80)
    for box, mask in zip(batch.boxes, batch.masks, strict=True):
        assert tuple(int(v) for v in box) == _reference_box(mask.numpy())
        x1, y1, x2, y2 = box.tolist()
        assert 0 <= x1 < x2 <= 80 and 0 <= y1 < y2 <= 80


def test_boxes_match_alpha_recovered_from_the_pixels(tmp_path):
    """Pure red objects on pure green backgrounds without jitter: the red channel *is* the alpha."""
    rng = np.random.default_rng(1)
    objs, bgs = [], []
    for i in range(3):
        p = tmp_path / f"obj{i}.png"
        _disc(rng, side=40 + 8 * i, noise=0).save(p)
        objs.append({"path": p.name, "split": "train"})
        q = tmp_path / f"bg{i}.png"
        Image.new("RGB", (100, 70), (0, 255, 0)).save(q)
        bgs.append({"path": q.name, "split": "train"})
    manifest = {"root": str(tmp_path), "objects": {"red": objs}, "backgrounds": bgs}
    params = PasteParams(brightness=0.0, contrast=0.0, saturation=0.0)
    batch = generate(manifest, "red", "train", n=6, seed=0, size=72, params=params)
    for img, box, mask in zip(batch.images, batch.boxes, batch.masks, strict=True):
        alpha = img[0].numpy()
        assert np.allclose(img[1].numpy(), 1 - alpha, atol=1e-5) and np.allclose(img[2].numpy(), 0, atol=1e-6)
        sure = np.abs(alpha - photos.ALPHA_THRESHOLD) > 1e-4
        assert np.array_equal(mask.numpy()[sure], (alpha >= photos.ALPHA_THRESHOLD)[sure])
        assert tuple(int(v) for v in box) == _reference_box(alpha >= photos.ALPHA_THRESHOLD)
        assert tuple(int(v) for v in box) == mask_box(mask.numpy())


def test_crops_are_the_box_regions(cache):
    batch = generate(load_manifest(cache), "fish", "train", n=4, seed=0, size=64)
    for crop, img, box in zip(crops(batch), batch.images, batch.boxes.long(), strict=True):
        assert crop.shape == (3, int(box[3] - box[1]), int(box[2] - box[0]))
        assert torch.equal(crop, img[:, box[1]:box[3], box[0]:box[2]])


def test_unknown_class_and_split_are_refused(cache):
    m = load_manifest(cache)
    with pytest.raises(ValueError, match="unknown class"):
        generate(m, "dragons", "train", n=1)
    with pytest.raises(ValueError, match="split"):
        generate(m, "birds", "holdout", n=1)


def test_a_missing_manifest_names_the_fetch_that_makes_it(tmp_path):
    # the hint must name the folder that would hold the manifest, whether a folder or the file was asked for
    for asked in (tmp_path / "photos", tmp_path / "photos" / "manifest.json"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"--cache {tmp_path / 'photos'}` first")):
            load_manifest(asked)


def test_copyright_parser_takes_the_last_matching_stanza():
    stanzas = photo_fetch.parse_copyright(SCRATCH_COPYRIGHT)
    assert [s["license"] for s in stanzas] == ["GPL-2", "CC-BY-SA-3.0", "MIT"]
    lic = photo_fetch._license(stanzas, Path("usr/share/scratch/Media/Backgrounds/Nature/lake.jpg"))
    assert lic["license"] == "CC-BY-SA-3.0"
    assert photo_fetch._license(stanzas, Path("usr/share/scratch/Scratch.image"))["license"] == "GPL-2"


@pytest.mark.skipif(not (REAL_CACHE / photos.MANIFEST).is_file(), reason="run `qloc fetch-photos` for the real data")
def test_real_photo_data():
    m = load_manifest(REAL_CACHE)
    assert len(m["objects"]["mammals"]) >= 50 and len(m["objects"]["birds"]) >= 30
    assert len(m["backgrounds"]) >= 50
    batch = generate(m, "birds", "test", n=4, seed=0)
    assert batch.images.shape == (4, 3, 224, 224)
    for box, mask in zip(batch.boxes, batch.masks, strict=True):
        assert tuple(int(v) for v in box) == mask_box(mask.numpy())


def test_download_runs_apt_get_update_when_the_package_is_unknown(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, cwd=None):
        calls.append(cmd)
        if cmd == ["apt-get", "update"]:
            return subprocess.CompletedProcess(cmd, 0, "", "")
        if ["apt-get", "update"] in calls:  # the package list now knows the package
            (Path(cwd) / "scratch_9.9_all.deb").write_bytes(b"!<arch>\n")
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package scratch")

    monkeypatch.setattr(debian, "run", fake_run)
    deb = debian.download("scratch", tmp_path / "debs", log=lambda *_: None)
    assert deb.name == "scratch_9.9_all.deb"
    assert calls == [["apt-get", "download", "scratch"], ["apt-get", "update"], ["apt-get", "download", "scratch"]]
    calls.clear()
    assert debian.download("scratch", tmp_path / "debs", log=lambda *_: None) == deb and not calls


# ---------------------------------------------------------------- what the generator draws, pinned

def photo_manifest(root: Path) -> dict:
    """Two classes of noisy discs and an ellipse (PNG: lossless, so only numpy and Pillow decide the pixels) on two
    noisy PNG backgrounds of other sizes, every file in the train split."""
    rng = np.random.default_rng(7)
    objects: dict[str, list[dict]] = {}
    for name, color in (("red", (230, 30, 30)), ("blue", (30, 30, 230))):
        objects[name] = []
        for i, side in enumerate((48, 64)):
            img = _disc(rng, side=side, color=color)
            if i:  # an ellipse twice as wide as tall: a long side along x
                img = img.resize((side, side // 2))
            img.save(root / f"{name}{i}.png")
            objects[name].append({"path": f"{name}{i}.png", "split": "train"})
    backgrounds = []
    for i, wh in enumerate(((160, 120), (120, 200))):
        arr = np.clip(np.array((60, 160, 90)) + rng.normal(0, 40, (wh[1], wh[0], 3)), 0, 255).astype(np.uint8)
        Image.fromarray(arr).save(root / f"bg{i}.png")
        backgrounds.append({"path": f"bg{i}.png", "split": "train"})
    return {"format": photos.MANIFEST_FORMAT, "version": photos.MANIFEST_VERSION, "root": str(root),
            "objects": objects, "backgrounds": backgrounds}


def photo_digest(b) -> str:  # type: ignore[no-untyped-def]
    """What the generator drew that no CPU changes: the files, boxes and masks (integers and booleans)."""
    import hashlib

    h = hashlib.sha256()
    for t in (b.boxes, b.masks):
        h.update(np.ascontiguousarray(t.numpy()).tobytes())
    h.update(repr((b.objects, b.backgrounds)).encode())
    return h.hexdigest()[:16]


def photo_fingerprint(b) -> list:  # type: ignore[no-untyped-def]
    """The images' pixels as 4 x 4 average-pooled channels: their float values differ in the last bits from one CPU
    to another (numpy's and BLAS's SIMD paths), so they are compared with a tolerance, not hashed."""
    return torch.nn.functional.avg_pool2d(b.images, b.images.shape[-1] // 4).round(decimals=4).tolist()


FINGERPRINTS = Path(__file__).with_name("photo_paste_fingerprints.json")


def test_the_paste_generator_draws_what_the_photo_numbers_were_measured_with(tmp_path):
    """The photo figures of BENCHMARKS.md were measured on this generator's images (unchanged since 2026-11-28): a
    change to what it draws (the crops, scales, flips, colour jitter, positions, the blend, the streams' keys)
    shows here, on lossless files. A deliberate change re-runs the photo benchmarks and updates these (the pixels'
    fingerprints: ``photo_paste_fingerprints.json``); so does a numpy or Pillow whose resampling draws other pixels
    (then the real photo data changes too). The pixels are compared within 1e-3 (a 4 x 4 pool of values in [0, 1]):
    the first digests hashed them bit for bit and failed on the next session's VM (another CPU, numpy 2.4.6), the
    generator unchanged."""
    manifest = photo_manifest(tmp_path)
    jittered = generate(manifest, "red", "train", 8, seed=0, size=96)
    strong = PasteParams(object_side=(0.3, 0.5), background_crop=(0.3, 0.6), brightness=0.5, contrast=0.5,
                         saturation=0.5, flip=1.0)
    strong = generate(manifest, "blue", "train", 6, seed=3, size=80, params=strong)
    assert {"jittered": photo_digest(jittered), "strong": photo_digest(strong)} == {
        "jittered": "8134b93333b02f96", "strong": "2c49aca0f3f05af3"}
    expected = json.loads(FINGERPRINTS.read_text())
    for name, batch in (("jittered", jittered), ("strong", strong)):
        torch.testing.assert_close(torch.tensor(photo_fingerprint(batch)), torch.tensor(expected[name]), rtol=0,
                                   atol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_the_paste_generators_defaults(tmp_path):
    manifest = photo_manifest(tmp_path)
    b = generate(manifest, "red")
    assert len(b) == 50 and b.images.shape == (50, 3, 224, 224) and b.images.dtype == torch.float32
    assert b.boxes.dtype == torch.float32 and b.masks.dtype == torch.bool
    assert photo_digest(b) == photo_digest(generate(manifest, "red", "train", 50, seed=0, size=224,
                                                    params=PasteParams()))
    side = (b.boxes[:, 2:] - b.boxes[:, :2]).amax(dim=1)
    assert float(side.min()) >= 0.25 * 224 - 2 and float(side.max()) <= 0.6 * 224 + 2  # object_side, 56..134 px
    assert float(b.images.min()) >= 0.0 and float(b.images.max()) <= 1.0


def test_flips_colour_jitter_and_scales_follow_their_parameters(tmp_path):
    """Without jitter and flips an object's pixels are its file's; a flip of 1.0 mirrors every cut-out; brightness
    alone scales the object's colour within its range; each long side is the drawn fraction of the image."""
    manifest = photo_manifest(tmp_path)
    plain = PasteParams(object_side=(0.5, 0.5), background_crop=(1.0, 1.0), brightness=0.0, contrast=0.0,
                        saturation=0.0, flip=0.0)
    a = generate(manifest, "red", "train", 6, seed=1, size=96, params=plain)
    sides = (a.boxes[:, 2:] - a.boxes[:, :2]).amax(dim=1)
    assert bool(((sides - 48).abs() <= 2).all())  # half of 96
    mirrored = generate(manifest, "red", "train", 6, seed=1, size=96,
                        params=PasteParams(object_side=(0.5, 0.5), background_crop=(1.0, 1.0), brightness=0.0,
                                           contrast=0.0, saturation=0.0, flip=1.0))
    for m0, m1, b0, b1 in zip(a.masks, mirrored.masks, a.boxes.long(), mirrored.boxes.long(), strict=True):
        c0 = m0[b0[1]:b0[3], b0[0]:b0[2]]
        c1 = m1[b1[1]:b1[3], b1[0]:b1[2]]
        assert torch.equal(c0.flip(1), c1)  # the object's own mask, mirrored
    bright = generate(manifest, "red", "train", 6, seed=1, size=96,
                      params=PasteParams(object_side=(0.5, 0.5), background_crop=(1.0, 1.0), brightness=0.5,
                                         contrast=0.0, saturation=0.0, flip=0.0))
    ratios = []
    for img0, img1, m in zip(a.images, bright.images, a.masks, strict=True):
        inner = m & torch.roll(m, 2, 0) & torch.roll(m, -2, 0) & torch.roll(m, 2, 1) & torch.roll(m, -2, 1)
        r0, r1 = img0[1][inner], img1[1][inner]  # the red objects' green: far from 0 and 1 either way
        keep = r1 < 0.99  # not clipped at 1
        if int(keep.sum()) >= 20:
            ratios.append(float((r1[keep] / r0[keep]).median()))
    assert len(ratios) >= 3
    assert all(0.5 - 0.02 <= r <= 1.5 + 0.02 for r in ratios) and max(ratios) - min(ratios) > 0.1, ratios


def test_refusals_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="^empty object mask: the cut-out has no pixel with alpha >= ALPHA_THRESHOLD$"):
        mask_box(np.zeros((4, 4), dtype=bool))
    assert mask_box(np.eye(4, dtype=bool)[:, ::-1]) == (0, 0, 4, 4)
    manifest = photo_manifest(tmp_path)
    manifest["backgrounds"] = []
    with pytest.raises(ValueError, match="^class 'red' split 'train' has 2 object photos and 0 backgrounds; both "
                                         "must be non-empty$"):
        generate(manifest, "red", n=1)
    manifest = photo_manifest(tmp_path)
    manifest["objects"]["red"] = [dict(it, split="val") for it in manifest["objects"]["red"]]
    with pytest.raises(ValueError, match="^class 'red' split 'train' has 0 object photos and 2 backgrounds"):
        generate(manifest, "red", n=1)


@pytest.mark.parametrize(("change", "why"), [({"format": "other"}, "format"), ({"version": 2}, "newer"),
                                             ({"format": None}, "no format")])
def test_a_manifest_of_another_format_or_a_newer_version_is_refused(tmp_path, change, why):
    import json

    data = {k: v for k, v in photo_manifest(tmp_path).items() if k != "root"}
    (tmp_path / photos.MANIFEST).write_text(json.dumps({k: v for k, v in (data | change).items() if v is not None}))
    with pytest.raises(ValueError, match="is not a qloc photo manifest this version reads$"):
        load_manifest(tmp_path)
    data.pop("version")  # a manifest without a version is version 0: read
    (tmp_path / photos.MANIFEST).write_text(json.dumps(data))
    assert load_manifest(tmp_path / photos.MANIFEST)["root"] == str(tmp_path)


def test_a_cut_out_scaled_to_nothing_keeps_its_strongest_pixel(tmp_path):
    """Four opaque dots at a 40-px cut-out's corners, pasted at 1 % of a 96-px image: scaling leaves no pixel at the
    alpha threshold, so the strongest one is kept opaque: a 1-px object in its own colour, and its box."""
    alpha = np.zeros((40, 40))
    alpha[0, 0] = alpha[0, -1] = alpha[-1, 0] = alpha[-1, -1] = 1.0
    rgb = np.broadcast_to(np.array((200.0, 40, 90)), (40, 40, 3))
    Image.fromarray(np.dstack([rgb, alpha * 255]).round().astype(np.uint8), "RGBA").save(tmp_path / "dots.png")
    Image.new("RGB", (100, 100), (0, 255, 0)).save(tmp_path / "bg.png")
    manifest = {"root": str(tmp_path), "objects": {"dots": [{"path": "dots.png", "split": "train"}]},
                "backgrounds": [{"path": "bg.png", "split": "train"}]}
    tiny = PasteParams(object_side=(0.01, 0.01), brightness=0.0, contrast=0.0, saturation=0.0, flip=0.0)
    b = generate(manifest, "dots", "train", 3, seed=0, size=96, params=tiny)
    for img, box, mask in zip(b.images, b.boxes.long(), b.masks, strict=True):
        assert int(mask.sum()) == 1 and (box[2:] - box[:2]).tolist() == [1, 1]
        x, y = int(box[0]), int(box[1])
        assert img[:, y, x].tolist() == pytest.approx([200 / 255, 40 / 255, 90 / 255], abs=1e-6)


def test_the_generator_reads_its_manifest_from_a_folder_and_by_default_from_the_data_directory(tmp_path, monkeypatch):
    import json

    from models.data import DATA_DIR_ENV

    folder = tmp_path / "photos"
    folder.mkdir()
    manifest = photo_manifest(folder)
    (folder / photos.MANIFEST).write_text(json.dumps({k: v for k, v in manifest.items() if k != "root"}))
    given = generate(manifest, "blue", "train", 2, seed=0, size=64)
    assert photo_digest(generate(folder, "blue", "train", 2, seed=0, size=64)) == photo_digest(given)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert load_manifest()["root"] == str(folder)  # <QLOC_DATA_DIR>/photos
