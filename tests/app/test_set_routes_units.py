"""``app.routes.exemplar_sets``' route bodies by value, on SQLite and PostgreSQL with a real ``BlobStore``: a set's
creation (``add_exemplar_set``: what the prototype is made from -- crops, crops cut from boxes, labeled examples,
negatives --, what is stored, all or none), its change (``change_set``) and its deletion (``delete_set``: the 409 that
names unfinished jobs and what to do). The prototype comes from a workers-mode stand-in (``prototype``), which records
what it is given; the local model's side is ``app.calibration``'s and the HTTP tests' (``test_app_exemplar_sets.py``,
``test_app_exemplar_boxes.py``)."""

from __future__ import annotations

import io
import json
import math
import uuid

import numpy as np
import pytest
from fastapi import Response
from PIL import Image
from service_fixtures import make_test_settings, new_job, new_set, png_bytes, refusal, upload_file
from skimage import data
from sqlalchemy import select, update

from app.deps import Caller
from app.inference import BundleRegistry
from app.remote import MadePrototype
from app.routes.exemplar_sets import SetForm, add_exemplar_set, change_set, delete_set, parse_boxes
from app.routes.uploads import read_images
from app.schemas import ExemplarSetChange
from app.serving import InferenceRefused
from app.storage import BlobStore, exemplar_set_prefix
from app.tables import AdaptationJob, Exemplar, ExemplarSet

OWNER = Caller("k")


def upload(w: int, h: int, value: int = 90, name: str | None = "a.png"):  # type: ignore[no-untyped-def]
    return upload_file(png_bytes(w, h, seed=value, square=False), name)


class Remote:
    """Workers mode's prototype (``WorkerInference.prototype``): records what it is given, answers ``made``."""

    def __init__(self, made: MadePrototype | None = None, refused: InferenceRefused | None = None):
        self.made = made or MadePrototype("mnist-general", "f" * 64, b"\0" * 8, 2, {"platt": [1.0, 0.0]}, b"\1" * 8, 1)
        self.refused = refused
        self.calls: list[dict] = []

    def prototype(self, bundle, crops, *, explicit, examples=None, threshold=None, negatives=None):  # type: ignore[no-untyped-def]
        self.calls.append({"bundle": bundle, "crops": [c.size for c in crops], "explicit": explicit,
                           "examples": [(im.size, box) for im, box in examples or []], "threshold": threshold,
                           "negatives": [c.size for c in negatives or []]})
        if self.refused is not None:
            raise self.refused
        return self.made


@pytest.fixture
def settings(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    return make_test_settings(tmp_path, bundle_dir)


def add(db, settings, store, form, remote, caller=OWNER):  # type: ignore[no-untyped-def]
    response = Response()
    with db() as s:
        public = add_exemplar_set(form, response, s, settings, store, BundleRegistry(settings.bundle_dir, "cpu"),
                                  caller, remote)
    return public, response.headers


def files_of(store: BlobStore, set_id: uuid.UUID) -> list[str]:
    root = store.path(exemplar_set_prefix(set_id))
    return sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_set_of_crops_is_made_from_them_and_stored_with_the_prototype_it_was_given(db, settings, store):
    remote = Remote()
    form = SetForm([upload(20, 16, name="one.png"), upload(30, 30, name="two.png")], "cats", None, None,
                   [upload(8, 9, name="neg.png")], -0.0)
    public, headers = add(db, settings, store, form, remote)
    assert headers["Location"] == f"/v1/exemplar-sets/{public.id}"
    assert remote.calls == [{"bundle": settings.default_bundle, "crops": [(20, 16), (30, 30)], "explicit": False,
                             "examples": [], "threshold": 0.0, "negatives": [(8, 9)]}]
    assert (public.name, public.bundle, public.num_exemplars, public.num_labeled, public.num_negatives) == (
        "cats", "mnist-general", 2, 0, 1)
    assert public.threshold == 0.0 and math.copysign(1.0, public.threshold) == 1.0  # -0 is stored as 0
    with db() as s:
        es = s.get_one(ExemplarSet, public.id)
        assert (es.owner, es.bundle_sha256, es.prototype, es.prototype_dim, es.calibration, es.negatives) == (
            "k", "f" * 64, b"\0" * 8, 2, {"platt": [1.0, 0.0]}, b"\1" * 8)
        rows = s.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == public.id)
                         .order_by(Exemplar.position)).all()
        assert [(r.filename, r.width, r.height, r.box) for r in rows] == [("one.png", 20, 16, None),
                                                                          ("two.png", 30, 30, None)]
    assert files_of(store, public.id) == ["000.png", "001.png"]  # the crops, not the negatives


def color_upload(w: int, h: int, name: str = "c.png"):  # type: ignore[no-untyped-def]
    """A crop in color: red, green and blue bands (colorfulness far above ``COLOR_MIN``)."""
    rgb = np.zeros((h, w, 3), np.uint8)
    for c in range(3):
        rgb[:, c * w // 3:(c + 1) * w // 3, c] = 200
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return upload_file(buf.getvalue(), name)


def tinted_upload(w: int, h: int):  # type: ignore[no-untyped-def]
    """A small crop like a cMNIST digit in color: a red square on a dark ground (two tones, strongly colored)."""
    rgb = np.zeros((h, w, 3), np.uint8)
    rgb[h // 4:3 * h // 4, w // 4:3 * w // 4, 0] = 230
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return upload_file(buf.getvalue(), "t.png")


def photo_upload(pixels: np.ndarray, side: int):  # type: ignore[no-untyped-def]
    """A photograph (``skimage.data``) at a longer side of ``side`` pixels."""
    image = Image.fromarray(pixels)
    image.thumbnail((side, side))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return upload_file(buf.getvalue(), "p.png")


@pytest.mark.parametrize(("crops", "boxes", "named", "photo_default", "expected", "explicit"), [
    ("photo", None, None, "test-other", "test-other", False),  # like a color photo, the photo default installed
    ("photo gray photo", None, None, "test-other", "test-other", False),  # the median crop is a photo's
    ("gray photo gray", None, None, "test-other", "test-digits", False),  # the median crop is gray
    ("photo small small", None, None, "test-other", "test-digits", False),  # in color, cMNIST-sized: the default
    ("gray", None, None, "test-other", "test-digits", False),
    ("grayphoto", None, None, "test-other", "test-other", False),  # in gray levels, continuous tones: a photo's
    ("smallphoto smallphoto gray", None, None, "test-other", "test-other", False),  # a photo's, 48 px
    ("noise", None, None, "test-other", "test-other", False),  # tones throughout its range (as a photo's)
    ("photo photo", "[[0, 0, 120, 90], [10, 5, 110, 85]]", None, "test-other", "test-other", False),  # cut: 120, 100
    ("photo photo", "[[0, 0, 120, 90], [10, 5, 40, 35]]", None, "test-other", "test-digits", False),  # median 75 px
    ("photo", None, "test-digits", "test-other", "test-digits", True),  # a named bundle is never replaced
    ("photo", None, None, "photo-general", "test-digits", False),  # the photo default is not installed
    ("photo", None, None, "", "test-digits", False),  # no photo default
])
def test_a_set_naming_no_bundle_gets_the_photo_default_for_crops_like_photos(  # noqa: PLR0913
        db, tmp_path, bundle_dir, store, crops, boxes, named, photo_default, expected, explicit):
    settings = make_test_settings(tmp_path, bundle_dir, default_photo_bundle=photo_default)
    assert settings.default_bundle == "test-digits"
    remote = Remote(MadePrototype(expected, "f" * 64, b"\0" * 8, 2))
    made = {"photo": lambda: color_upload(120, 90), "small": lambda: tinted_upload(30, 24),
            "gray": lambda: upload_file(png_bytes(120, 90, seed=90), "a.png"),  # a bright square on a dark ground
            "grayphoto": lambda: photo_upload(data.camera(), 120),
            "smallphoto": lambda: photo_upload(data.chelsea(), 48),
            "noise": lambda: upload(120, 90)}
    files = [made[kind]() for kind in crops.split()]
    public, _ = add(db, settings, store, SetForm(files, None, named, boxes, [], 0.5), remote)
    (call,) = remote.calls
    assert (call["bundle"], call["explicit"], public.bundle) == (expected, explicit, expected)


def test_a_set_of_boxes_cuts_its_crops_and_keeps_its_images_as_labeled_examples(db, settings, store):
    remote = Remote(MadePrototype("mnist-general", "f" * 64, b"\0" * 8, 2))  # no calibration asked back
    form = SetForm([upload(40, 30), upload(24, 24)], None, "mnist-general", "[[2, 3, 12, 13.4], [0, 0, 24, 24]]",
                   [], 0.5)
    public, _ = add(db, settings, store, form, remote)
    (call,) = remote.calls
    assert call["explicit"] is True and call["bundle"] == "mnist-general"
    assert call["crops"] == [(10, 10), (24, 24)]  # edges rounded to the nearest pixel
    assert call["examples"] == [((40, 30), (2.0, 3.0, 12.0, 13.4)), ((24, 24), (0.0, 0.0, 24.0, 24.0))]
    assert (public.num_exemplars, public.num_labeled, public.num_negatives, public.calibrated) == (2, 2, 0, False)
    with db() as s:
        rows = s.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == public.id)
                         .order_by(Exemplar.position)).all()
        assert [list(r.box) for r in rows] == [[2.0, 3.0, 12.0, 13.4], [0.0, 0.0, 24.0, 24.0]]
        assert s.get_one(ExemplarSet, public.id).calibration is None


def test_what_is_refused_is_refused_before_anything_is_made_or_stored(db, settings, store):
    remote, caller = Remote(), Caller(uuid.uuid4().hex)  # the database is the module's: an owner of its own
    cases = [
        (SetForm([upload(20, 16)], "ca\x00t", None, None, [], 0.5),
         (422, "name contains a NUL byte (\\x00); remove it")),
        (SetForm([upload(1, 16, name="thin.png")], None, None, None, [], 0.5), (422, (
            "files: file 1 of 1 ('thin.png') is 1x16 pixels; a crop needs at least 2 pixels on each side (or send the "
            "whole image with its box in `boxes`)"))),
        (SetForm([upload(20, 16)], None, None, None, [upload(20, 1, name="flat.png")], 0.5), (422, (
            "negative_files: file 1 of 1 ('flat.png') is 20x1 pixels; a crop needs at least 2 pixels on each side "
            "(or send the whole image with its box in `boxes`)"))),
        (SetForm([upload(20, 16, name="one.png")], None, None, "[[0, 0, 21, 10]]", [], 0.5), (422, (
            "boxes[0], for file 1 of 1 ('one.png', 20x16 pixels): [0, 0, 21, 10] is not inside the image: "
            "0 <= x1 < x2 <= 20 and 0 <= y1 < y2 <= 16 are needed"))),
    ]
    for form, want in cases:
        assert refusal(add, db, settings, store, form, remote, caller) == want
    assert remote.calls == []
    refused = Remote(refused=InferenceRefused(503, "no localize worker answered", {"Retry-After": "5"}))
    assert refusal(add, db, settings, store, SetForm([upload(20, 16)], None, None, None, [], 0.5), refused,
                   caller) == (503, "no localize worker answered")
    with db() as s:
        assert s.scalar(select(ExemplarSet.id).where(ExemplarSet.owner == caller.owner)) is None
    assert not store.root.exists() or not any(p.is_file() for p in store.root.rglob("*"))


def test_a_write_that_fails_leaves_no_row_and_no_file(db, settings, store, monkeypatch):
    puts = []
    real = BlobStore.put

    def second_fails(self, key, data):  # noqa: ANN001, ANN202
        puts.append(key)
        if len(puts) == 2:
            raise OSError("disk full")
        return real(self, key, data)

    monkeypatch.setattr(BlobStore, "put", second_fails)
    form = SetForm([upload(20, 16), upload(20, 16, 40), upload(20, 16, 60)], None, None, None, [], 0.5)
    caller = Caller(uuid.uuid4().hex)
    with pytest.raises(OSError, match="disk full"):
        add(db, settings, store, form, Remote(), caller)
    with db() as s:
        assert s.scalar(select(ExemplarSet.id).where(ExemplarSet.owner == caller.owner)) is None
    assert puts[0].startswith("exemplar-sets/") and files_of(store, uuid.UUID(puts[0].split("/")[1])) == []


def test_a_change_names_or_thresholds_only_what_it_gives(db):
    set_id = new_set(db, threshold=0.5)
    with db() as s:
        assert refusal(change_set, set_id, ExemplarSetChange(), s, OWNER) == (
            422, "nothing to change: send a JSON object with `name` and/or `threshold`")
        assert refusal(change_set, set_id, ExemplarSetChange(name="a\x00b"), s, OWNER) == (
            422, "name contains a NUL byte (\\x00); remove it")
        assert refusal(change_set, set_id, ExemplarSetChange(threshold=0.2), s, Caller("other")) == (
            404, "exemplar set not found")
    with db() as s:
        shown = change_set(set_id, ExemplarSetChange(threshold=0.2), s, OWNER)
        assert (shown.name, shown.threshold) == ("s", 0.2)
    with db() as s:
        shown = change_set(set_id, ExemplarSetChange(name="dogs"), s, OWNER)
        assert (shown.name, shown.threshold) == ("dogs", 0.2)
    with db() as s:
        shown = change_set(set_id, ExemplarSetChange(name=None), s, OWNER)  # null clears it
        assert shown.name is None
    with db() as s:
        assert (s.get_one(ExemplarSet, set_id).name, s.get_one(ExemplarSet, set_id).threshold) == (None, 0.2)


def test_a_set_with_unfinished_jobs_is_not_deleted_and_the_409_says_what_to_do(db, store):
    set_id = new_set(db)
    store.put(f"{exemplar_set_prefix(set_id)}/exemplars/000.png", b"png")
    one = new_job(db, set_id)
    with db() as s:
        assert refusal(delete_set, set_id, s, store, OWNER) == (409, (
            f"the set has 1 queued or running adaptation job ({one}): cancel it "
            "(POST /v1/adaptations/{job_id}/cancel) and wait until it has ended, then delete again"))
    with db.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == one).values(cancel_requested=True))
    with db() as s:
        assert refusal(delete_set, set_id, s, store, OWNER) == (409, (
            f"the set has 1 queued or running adaptation job ({one} (cancel requested: ending)): wait until it has "
            "ended (GET /v1/adaptations/{job_id}), then delete again"))
    two = new_job(db, set_id, cancel_requested=True)  # two jobs, both ending: plural, and nothing to cancel
    with db() as s:
        assert refusal(delete_set, set_id, s, store, OWNER) == (409, (
            f"the set has 2 queued or running adaptation jobs ({one} (cancel requested: ending), {two} (cancel "
            "requested: ending)): wait until they have ended (GET /v1/adaptations/{job_id}), then delete again"))
    three_more = [new_job(db, set_id) for _ in range(3)]
    with db() as s:  # five: each named, none left out
        status, detail = refusal(delete_set, set_id, s, store, OWNER)
    assert status == 409 and detail.startswith("the set has 5 queued or running adaptation jobs (")
    assert "more" not in detail and all(str(j) in detail for j in [one, two, *three_more])
    more = [two, *three_more, new_job(db, set_id)]
    with db() as s:
        status, detail = refusal(delete_set, set_id, s, store, OWNER)
    assert status == 409 and detail.startswith("the set has 6 queued or running adaptation jobs (")
    assert detail.endswith(", and 1 more): cancel them (POST /v1/adaptations/{job_id}/cancel) and wait until they "
                           "have ended, then delete again")
    assert sum(str(j) in detail for j in [one, *more]) == 5
    with db() as s:
        assert refusal(delete_set, set_id, s, store, Caller("other")) == (404, "exemplar set not found")
        assert s.get(ExemplarSet, set_id) is not None
    assert files_of(store, set_id) == ["000.png"]
    with db.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id).values(status="canceled"))
    with db() as s:
        delete_set(set_id, s, store, OWNER)
    with db() as s:
        assert s.get(ExemplarSet, set_id) is None
        assert s.scalar(select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)) is None
    assert files_of(store, set_id) == []


def test_a_flat_list_of_numbers_for_boxes_is_shown_cut_after_eight(settings):
    im = read_images([upload(20, 16)], settings)[0]
    for numbers, shown in (([1, 2, 3, 4, 5, 6, 7, 8], "[1, 2, 3, 4, 5, 6, 7, 8]"),
                           ([1, 2, 3, 4, 5, 6, 7, 8, 9], "[1, 2, 3, 4, 5, 6, 7, 8, ...]")):
        assert refusal(parse_boxes, str(numbers), [im]) == (422, (
            f"boxes is a list of numbers, {shown}: it must be a JSON list of [x1, y1, x2, y2] (4 numbers, in the "
            "pixels of the uploaded image), one per file, a list of boxes even for one file (for one file: "
            f"[{shown}])"))


def test_what_boxes_that_do_not_fit_their_files_are_told(settings):
    im = read_images([upload(20, 16)], settings)[0]
    nameless = read_images([upload(20, 16, name=None)], settings)[0]  # type: ignore[arg-type]
    assert refusal(parse_boxes, "[[0, 0, 5, 5], [0, 0, 5, 5]]", [im]) == (
        422, "boxes has 2 boxes for 1 file: it must have one box per file, in upload order")
    assert refusal(parse_boxes, "[[0, 0, 5, 5]]", [im, im]) == (
        422, "boxes has 1 box for 2 files: it must have one box per file, in upload order")
    short = refusal(parse_boxes, '[[0, 0, "5", 5]]', [nameless])
    assert short == (422, "boxes[0], for file 1 of 1 ('upload', 20x16 pixels): must be [x1, y1, x2, y2], 4 finite "
                          'numbers; got [0, 0, "5", 5]')
    long = [1000000 + i for i in range(12)]
    shown = json.dumps(long)[:77] + "..."  # an item shown longer than 80 characters is cut
    assert refusal(parse_boxes, json.dumps([long]), [im]) == (
        422, f"boxes[0], for file 1 of 1 ('a.png', 20x16 pixels): must be [x1, y1, x2, y2], 4 finite numbers; got "
             f"{shown}")


def test_an_item_is_shown_whole_up_to_80_characters_and_a_box_is_told_its_size(settings):
    im = read_images([upload(20, 16)], settings)[0]
    where = "boxes[0], for file 1 of 1 ('a.png', 20x16 pixels)"
    for n, cut in ((80, False), (81, True)):
        item = ["x" * (n - 4)]  # json.dumps: ["xx...x"], n characters
        assert len(json.dumps(item)) == n
        shown = json.dumps(item)[:77] + "..." if cut else json.dumps(item)
        assert refusal(parse_boxes, json.dumps([item]), [im]) == (
            422, f"{where}: must be [x1, y1, x2, y2], 4 finite numbers; got {shown}")
    assert refusal(parse_boxes, "[[2, 5, 12, 5]]", [im]) == (  # no height: not a box (before its size is told)
        422, f"{where}: [2, 5, 12, 5] is not a box: x1 < x2 and y1 < y2 are needed")
    assert refusal(parse_boxes, "[[3, 2, 4.5, 12]]", [im]) == (
        422, f"{where}: [3, 2, 4.5, 12] is 1.5x10 pixels; a box needs at least 2 pixels on each side")


def test_a_crop_too_small_is_told_by_its_position_and_name(db, settings, store):
    cases = [(upload(1, 5, name=None), "files: file 2 of 2 ('upload') is 1x5 pixels"),  # type: ignore[arg-type]
             (upload(5, 1, name="thin.png"), "files: file 2 of 2 ('thin.png') is 5x1 pixels")]
    for small, told in cases:
        form = SetForm([upload(20, 16), small], None, None, None, [], 0.5)
        assert refusal(add, db, settings, store, form, Remote()) == (
            422, f"{told}; a crop needs at least 2 pixels on each side (or send the whole image with its box in "
                 "`boxes`)")


def test_a_local_set_is_calibrated_on_its_crops_examples_and_negatives_with_the_bundles_verifier(
        db, settings, store, monkeypatch):
    """``QLOC_INFERENCE=local``: the prototype from the loaded bundle, the calibration (``calibrate_new_set``,
    recorded here; ``test_app_calibration.py`` pins what it fits) given everything the set has."""
    import app.routes.exemplar_sets as routes
    from app.calibration import NewSetCalibration

    calls, checker = [], object()

    def calibrate(loaded, prototype, crops, labeled, negative_crops, *, threshold, verifier, samples):  # noqa: ANN001, ANN202
        calls.append((loaded.name, tuple(prototype.shape), [c.size for c in crops],
                      [(im.size, box) for im, box in labeled], [c.size for c in negative_crops], threshold,
                      verifier, samples))
        return NewSetCalibration({"platt": [2.0, -1.0]}, b"\2" * 8, 3)

    monkeypatch.setattr(routes, "calibrate_new_set", calibrate)
    monkeypatch.setattr(BundleRegistry, "verifier", lambda self, name: checker if name == "test-digits" else None)
    form = SetForm([upload(40, 30), upload(24, 24)], None, None, "[[2, 3, 12, 13], [0, 0, 24, 24]]",
                   [upload(9, 8, name="neg.png")], 0.25)
    with db() as s:
        public = add_exemplar_set(form, Response(), s, settings, store, BundleRegistry(settings.bundle_dir, "cpu"),
                                  OWNER, None)
    (call,) = calls
    assert call[0] == "test-digits" and len(call[1]) == 1
    assert call[2:] == ([(10, 10), (24, 24)], [((40, 30), (2.0, 3.0, 12.0, 13.0)), ((24, 24), (0.0, 0.0, 24.0, 24.0))],
                        [(9, 8)], 0.25, checker, settings.calibration_samples)
    assert (public.bundle, public.calibrated, public.num_negatives) == ("test-digits", True, 3)
    with db() as s:
        es = s.get_one(ExemplarSet, public.id)
        assert (es.calibration, es.negatives, es.prototype_dim) == ({"platt": [2.0, -1.0]}, b"\2" * 8, call[1][0])


def test_a_bundle_is_refused_with_the_status_its_cause_calls_for(bundle_dir, tmp_path):
    """``get_bundle``: the set's bundle file replaced (409, the registry's words), an unknown name the client gave
    (422) or the server's (503, the set's or the default one named), a file that does not load (503), and the file
    itself for its own set."""
    from app.inference import BundleRegistry
    from app.routes.exemplar_sets import get_bundle, set_bundle

    reg = BundleRegistry(bundle_dir, "cpu")
    loaded = reg.get("test-digits")
    es = ExemplarSet(bundle="test-digits", bundle_sha256=loaded.sha256, prototype_dim=loaded.bundle.prototype_dim)
    assert set_bundle(reg, es) is loaded and get_bundle(reg, "test-digits", explicit=True) is loaded
    replaced = ExemplarSet(bundle="test-digits", bundle_sha256="0" * 64, prototype_dim=loaded.bundle.prototype_dim)
    status, detail = refusal(set_bundle, reg, replaced)
    assert status == 409 and "test-digits" in detail and "Re-create" in detail, detail
    gone = ExemplarSet(bundle="no-such", bundle_sha256="0" * 64, prototype_dim=8)
    unknown = "unknown bundle 'no-such'; available: ['test-digits', 'test-other']"
    assert refusal(set_bundle, reg, gone) == (503, f"the set's bundle unavailable: {unknown}")
    assert refusal(get_bundle, reg, "no-such", explicit=True) == (422, unknown)
    assert refusal(get_bundle, reg, "no-such", explicit=False) == (503, f"default bundle unavailable: {unknown}")
    (tmp_path / "broken.pt").write_bytes(b"not a bundle")  # a file of that name that does not load
    assert refusal(get_bundle, BundleRegistry(tmp_path, "cpu"), "broken", explicit=True) == (
        503, "bundle 'broken' cannot be loaded")
