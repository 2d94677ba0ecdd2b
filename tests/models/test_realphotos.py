"""The real-photo benchmark: the committed COCO annotations, the Qt resource reader, and (when fetched) the photos."""

from __future__ import annotations

import struct
import zlib
from collections import Counter, defaultdict

import pytest
from pycocotools.coco import COCO

from models.data import realphotos
from models.data.realphotos import ANNOTATIONS, SPLITS, assign_splits, load_annotations, read_rcc, real_photo_dir

DATA = load_annotations()
REAL_CACHE = real_photo_dir()
FETCHED = all((REAL_CACHE / "images" / im["file_name"]).is_file() for im in DATA["images"])


def test_annotations_are_valid_coco():
    coco = COCO(str(ANNOTATIONS))
    assert len(coco.getImgIds()) == len(DATA["images"]) >= 150
    assert len(coco.getCatIds()) >= 8
    for img_id in coco.getImgIds():
        assert len(coco.getAnnIds(imgIds=[img_id])) == 1  # one box per image
    ids = [a["id"] for a in DATA["annotations"]]
    assert len(ids) == len(set(ids))


def test_every_class_has_ten_images_and_three_exemplars():
    cats = {c["id"]: c["name"] for c in DATA["categories"]}
    per = Counter(im["class"] for im in DATA["images"])
    assert set(per) == set(cats.values())
    for cls, n in per.items():
        assert n >= 10, cls
        splits = Counter(im["split"] for im in DATA["images"] if im["class"] == cls)
        assert splits["exemplar"] >= 3 and splits["val"] >= 1 and splits["test"] >= 1, (cls, splits)
    by_image = {a["image_id"]: cats[a["category_id"]] for a in DATA["annotations"]}
    assert all(by_image[im["id"]] == im["class"] for im in DATA["images"])


def test_every_box_is_inside_its_image_and_not_empty():
    size = {im["id"]: (im["width"], im["height"]) for im in DATA["images"]}
    for a in DATA["annotations"]:
        x, y, w, h = a["bbox"]
        iw, ih = size[a["image_id"]]
        assert w >= 4 and h >= 4, a
        assert x >= 0 and y >= 0 and x + w <= iw and y + h <= ih, a
        assert a["area"] == pytest.approx(w * h)


def test_splits_are_disjoint_deterministic_and_by_class():
    files: dict[str, list[str]] = defaultdict(list)
    for im in DATA["images"]:
        assert im["split"] in SPLITS
        files[im["class"]].append(im["file_name"])
    names = [im["file_name"] for im in DATA["images"]]
    assert len(names) == len(set(names))  # a photo is in one class and one split only
    shas = [im["sha256"] for im in DATA["images"]]
    assert len(shas) == len(set(shas))  # and no photo twice under two names
    stored = {im["file_name"]: im["split"] for im in DATA["images"]}
    for cls_files in files.values():
        assert assign_splits(cls_files) == {f: stored[f] for f in cls_files}


def test_each_image_records_its_source_and_license():
    for im in DATA["images"]:
        src = im["source"]
        assert src["package"] in DATA["sources"] and src["version"] == DATA["sources"][src["package"]]["version"]
        assert src["path"] and im["license_name"] not in ("", "unknown") and im["copyright"]
        assert len(im["sha256"]) == 64
    instances = Counter(a["instance"] for a in DATA["annotations"] if a.get("instance"))
    assert instances and all(n >= 2 for n in instances.values())  # instance queries: the same object twice or more


def test_read_rcc_reads_plain_and_compressed_files():
    def name(s: str) -> bytes:
        u = s.encode("utf-16-be")
        return struct.pack(">HI", len(s), 0) + u

    names = name("dir") + name("a.txt") + name("b.bin")
    off_dir, off_a, off_b = 0, len(name("dir")), len(name("dir")) + len(name("a.txt"))
    payload_b = b"x" * 100
    comp = struct.pack(">I", len(payload_b)) + zlib.compress(payload_b)
    blobs = struct.pack(">I", 5) + b"hello" + struct.pack(">I", len(comp)) + comp
    node = ">IHII"  # version 1 nodes: 14 bytes
    tree = (struct.pack(node, 0, 2, 1, 1)  # root: one child at index 1
            + struct.pack(node, off_dir, 2, 2, 2)  # dir: two children from index 2
            + struct.pack(">IHHHI", off_a, 0, 0, 0, 0)
            + struct.pack(">IHHHI", off_b, 1, 0, 0, 9))
    head = 20
    data = (b"qres" + struct.pack(">IIII", 1, head, head + len(tree), head + len(tree) + len(blobs))
            + tree + blobs + names)
    assert read_rcc(data) == {"dir/a.txt": b"hello", "dir/b.bin": payload_b}
    with pytest.raises(ValueError):
        read_rcc(b"not a bundle")


@pytest.mark.skipif(not FETCHED, reason="run `qloc fetch-real-photos` for the real photos")
def test_fetched_photos_match_the_annotated_sha256s():
    assert realphotos.verify(REAL_CACHE, DATA) == []
    test = realphotos.load("test", DATA["categories"][0]["name"], REAL_CACHE)
    assert test and all(p.split == "test" for p in test)
    p = test[0]
    x1, y1, x2, y2 = p.box
    assert 0 <= x1 < x2 <= p.image.width and 0 <= y1 < y2 <= p.image.height
