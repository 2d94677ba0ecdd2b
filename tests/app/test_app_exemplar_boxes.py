"""Exemplar sets from whole images with boxes (``boxes``): crops cut from the boxes make the prototype, the
images are kept with their boxes as the set's labeled examples (``crud.labeled_examples``), and a bad
``boxes`` is refused with 422 before anything is written."""

import contextlib
import io
import json
import uuid

import numpy as np
import pytest
from PIL import Image
from service_fixtures import api, db_settings, files, jpeg_bytes, png_bytes, snapshot, stored_files  # noqa: F401
from sqlalchemy import inspect, select
from sqlalchemy.exc import IntegrityError

from app import crud
from app.db import make_engine, make_sessionmaker
from app.images import cut_box
from app.inference import prototype_from_bytes
from app.storage import BlobStore
from app.tables import Base, Exemplar, ExemplarSet
from models.bundle import load_bundle
from models.inference import Localizer

URL = "/v1/exemplar-sets"


def post(client, blobs, boxes=None, **data):
    if boxes is not None:
        data["boxes"] = boxes if isinstance(boxes, str) else json.dumps(boxes)
    return client.post(URL, files=files(*blobs), data=data)


def create(client, blobs, boxes=None, **data):
    r = post(client, blobs, boxes, **data)
    assert r.status_code == 201, r.text
    return r.json()


@contextlib.contextmanager
def sessions(settings):
    engine = make_engine(settings.database_url)
    try:
        yield make_sessionmaker(engine)
    finally:
        engine.dispose()


def stored_prototype(settings, set_id):
    with sessions(settings) as make, make() as s:
        return prototype_from_bytes(s.get_one(ExemplarSet, uuid.UUID(set_id)).prototype).numpy()


def png_of(image):
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def decoded(blob):
    return Image.open(io.BytesIO(blob))


# Whole images of several kinds (grayscale and RGB PNG, RGB JPEG) and a box in each; the second box has
# fractional edges (rounded to the nearest pixel edge: 5, 11, 101, 80), the third is the whole image.
SCENES = [png_bytes(84, 84, seed=3), png_bytes(120, 90, "RGB", seed=4), jpeg_bytes(150, 100)]
BOXES = [[10, 20, 60, 70], [5.4, 10.6, 100.5, 80.2], [0, 0, 150, 100]]
ROUNDED = [(10, 20, 60, 70), (5, 11, 101, 80), (0, 0, 150, 100)]


def test_boxes_make_the_prototype_of_the_crops_cut_from_them(client, settings):
    boxed = create(client, SCENES, BOXES)
    assert (boxed["num_exemplars"], boxed["num_labeled"]) == (3, 3)
    # The same crops, cut by the client and uploaded as plain crops (PNG: the pixels exactly).
    crops = [png_of(decoded(b).crop(r)) for b, r in zip(SCENES, ROUNDED, strict=True)]
    assert [decoded(c).size for c in crops] == [(50, 50), (96, 69), (150, 100)]
    cut = create(client, crops)
    assert (cut["num_exemplars"], cut["num_labeled"]) == (3, 0)
    np.testing.assert_allclose(stored_prototype(settings, boxed["id"]), stored_prototype(settings, cut["id"]),
                               rtol=1e-5, atol=1e-6)
    # ... and the library's prototype of those crops; the whole images make another one (the boxes count).
    loc = Localizer(load_bundle(settings.bundle_dir / f"{boxed['bundle']}.pt", "cpu"), "cpu")
    np.testing.assert_allclose(stored_prototype(settings, boxed["id"]),
                               loc.prototype([decoded(c) for c in crops]).numpy(), rtol=1e-5, atol=1e-6)
    whole = create(client, SCENES)
    assert not np.allclose(stored_prototype(settings, boxed["id"]), stored_prototype(settings, whole["id"]),
                           atol=1e-4)
    # A set made from boxes localizes like any other.
    r = client.post(f"{URL}/{boxed['id']}/localize", files=files(png_bytes(90, 70, seed=5)))
    assert r.status_code == 200, r.text


def test_labeled_examples_are_stored_with_their_boxes(api, db_settings):  # noqa: F811
    body = create(api, SCENES, BOXES, name="boxed")
    assert api.get(f"{URL}/{body['id']}").json() == body
    assert [s["num_labeled"] for s in api.get(URL).json()["data"]] == [3]
    plain = create(api, [png_bytes(28, 28)])
    assert plain["num_labeled"] == 0

    store = BlobStore(db_settings.storage_dir)
    with sessions(db_settings) as make:
        check_rows(make, store, body, plain)
    # Deleting the set removes its labeled examples' rows and files.
    assert api.delete(f"{URL}/{body['id']}").status_code == 204
    assert not [f for f in stored_files(db_settings.storage_dir) if body["id"] in f]
    with sessions(db_settings) as make, make() as s:
        assert crud.labeled_examples(s, uuid.UUID(body["id"])) == []


def check_rows(make, store, body, plain):
    with make() as s:
        rows = crud.labeled_examples(s, uuid.UUID(body["id"]))
        assert [r.position for r in rows] == [0, 1, 2]
        assert [r.filename for r in rows] == ["img0.png", "img1.png", "img2.png"]
        assert [r.box for r in rows] == [tuple(float(v) for v in b) for b in BOXES]
        assert [(r.width, r.height) for r in rows] == [(84, 84), (120, 90), (150, 100)]
        assert [r.content_type for r in rows] == ["image/png", "image/png", "image/jpeg"]
        for r, blob, rounded in zip(rows, SCENES, ROUNDED, strict=True):
            data = store.read_verified(r.blob, r.sha256)
            assert data == blob  # the whole image as uploaded
            im = decoded(data)
            assert im.size == (r.width, r.height)  # the frame of the box
            assert cut_box(im, r.box).size == (rounded[2] - rounded[0], rounded[3] - rounded[1])
        # A set of plain crops has none; its rows carry no box. Keyword or positional set_id alike.
        plain_id = uuid.UUID(plain["id"])
        assert crud.labeled_examples(s, set_id=plain_id) == []
        assert [e.box for e in s.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == plain_id))] == [None]
        assert crud.labeled_examples(s, uuid.uuid4()) == []

    # The database keeps a box whole and non-empty (ck_exemplars_box), on both backends.
    for partial in ({"box_x1": 1.0}, {"box_x1": 5.0, "box_y1": 0.0, "box_x2": 5.0, "box_y2": 9.0}):
        with pytest.raises(IntegrityError), make.begin() as s:
            s.add(Exemplar(exemplar_set_id=uuid.UUID(plain["id"]), position=9, filename=None,
                           content_type="image/png", width=10, height=10, sha256="0" * 64, blob="x", **partial))


def test_the_migrations_and_the_tables_declare_the_same_box_check(db_settings, tmp_path):  # noqa: F811
    def checks(url):
        engine = make_engine(url)
        try:
            return {c["name"]: c["sqltext"] for c in inspect(engine).get_check_constraints("exemplars")}
        finally:
            engine.dispose()

    created_url = f"sqlite:///{tmp_path}/created.db"
    engine = make_engine(created_url)
    Base.metadata.create_all(engine)
    engine.dispose()
    migrated, created = checks(db_settings.database_url), checks(created_url)
    assert set(migrated) == set(created) == {"ck_exemplars_box"}
    if db_settings.database_url.startswith("sqlite"):  # PostgreSQL rewrites the expression it reports
        assert migrated == created


# Two files: img0.png (40x30) and img1.png (50x60). (boxes, fragments the 422's detail must hold)
FIRST = [0, 0, 10, 10]
FILE1 = ["img0.png", "file 1 of 2", "40x30 pixels"]
FILE2 = ["img1.png", "file 2 of 2", "50x60 pixels"]
BAD = {
    "not_json": ("[[0, 0, 10, 10], [0, 0", ["boxes is not JSON", "[x1, y1, x2, y2]"]),
    "not_json_word": ("boxes please", ["boxes is not JSON"]),
    "deeply_nested": ("[" * 5000, ["boxes is not JSON"]),
    "an_object": ('{"img0.png": [0, 0, 10, 10]}', ["boxes must be", "got a JSON dict"]),
    "null": ("null", ["boxes must be"]),
    "one_box_not_nested": ("[0, 0, 10, 10]", ["boxes is a list of numbers, [0, 0, 10, 10]", "[[0, 0, 10, 10]]"]),
    "too_few": ([FIRST], ["boxes has 1 box for 2 files"]),
    "too_many": ([FIRST, FIRST, FIRST], ["3 boxes for 2 files"]),
    "none": ([], ["0 boxes for 2 files"]),
    "three_numbers": ([FIRST, [0, 0, 10]], [*FILE2, "4 finite numbers", "[0, 0, 10]"]),
    "five_numbers": ([FIRST, [0, 0, 10, 10, 1]], [*FILE2, "4 finite numbers"]),
    "not_a_list": ([FIRST, 7], [*FILE2, "4 finite numbers"]),
    "a_string": ([FIRST, [0, 0, "10", 10]], [*FILE2, "4 finite numbers"]),
    "a_boolean": ([FIRST, [0, 0, True, 10]], [*FILE2, "4 finite numbers"]),
    "nan": (f"[{FIRST}, [0, 0, NaN, 10]]", [*FILE2, "4 finite numbers"]),
    "infinite": (f"[{FIRST}, [0, 0, 1e400, 10]]", [*FILE2, "4 finite numbers"]),
    "huge_integer": (f"[{FIRST}, [0, 0, 1{'0' * 400}, 10]]", [*FILE2, "4 finite numbers"]),
    "outside_right": ([FIRST, [0, 0, 51, 10]], [*FILE2, "not inside the image", "x2 <= 50"]),
    "outside_bottom": ([FIRST, [0, 0, 10, 60.5]], [*FILE2, "not inside the image", "y2 <= 60"]),
    "negative": ([FIRST, [-1, 0, 10, 10]], [*FILE2, "not inside the image", "[-1, 0, 10, 10]"]),
    "first_file_outside": ([[0, 0, 41, 10], FIRST], [*FILE1, "not inside the image", "x2 <= 40"]),
    "inverted": ([FIRST, [10, 0, 5, 10]], [*FILE2, "not a box"]),
    "empty": ([FIRST, [5, 5, 5, 9]], [*FILE2, "not a box"]),
    "degenerate": ([FIRST, [5, 5, 6.5, 20]], [*FILE2, "1.5x15 pixels", "at least 2 pixels"]),
    "degenerate_height": ([FIRST, [0, 3, 50, 4]], [*FILE2, "50x1 pixels", "at least 2 pixels"]),
}
TWO = [png_bytes(40, 30, seed=1), png_bytes(50, 60, "RGB", seed=2)]


@pytest.mark.parametrize("case", BAD)
def test_bad_boxes_are_422_and_nothing_is_written(client, settings, case):
    create(client, [png_bytes(28, 28)])  # something there already, that stays as it is
    boxes, fragments = BAD[case]
    before = snapshot(settings)
    assert before[1]  # the blob directory is looked at, not missing
    r = post(client, TWO, boxes)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str)
    for fragment in fragments:
        assert fragment in detail, (fragment, detail)
    assert snapshot(settings) == before


def test_boxes_too_long_is_422_and_nothing_is_written(client, settings):
    before = snapshot(settings)
    r = post(client, TWO, json.dumps([[0, 0, 10, 10]] * 5000))
    assert r.status_code == 422 and "boxes" in r.text
    assert snapshot(settings) == before


def test_boxes_on_the_edges_and_of_the_minimum_size_are_accepted(client):
    body = create(client, TWO, [[0, 0, 40, 30], [48, 58, 50, 60]])
    assert body["num_labeled"] == 2


def test_sets_without_boxes_are_as_before(client, settings):
    crops = [png_bytes(28, 28), png_bytes(30, 24, "RGB", seed=1)]
    body = create(client, crops)
    assert (body["num_exemplars"], body["num_labeled"]) == (2, 0)
    assert client.get(f"{URL}/{body['id']}").json()["num_labeled"] == 0
    loc = Localizer(load_bundle(settings.bundle_dir / f"{body['bundle']}.pt", "cpu"), "cpu")
    np.testing.assert_allclose(stored_prototype(settings, body["id"]),
                               loc.prototype([decoded(c) for c in crops]).numpy(), rtol=1e-5, atol=1e-6)
    with sessions(settings) as make, make() as s:
        rows = list(s.scalars(select(Exemplar).order_by(Exemplar.position)))
        assert [(r.box, r.box_x1, r.box_y2) for r in rows] == [(None, None, None)] * 2
    # An empty form field is refused (app.routes.strict), not taken for an absent one: `-F boxes=$UNSET` must not
    # turn whole images into crops.
    r = post(client, crops, "")
    assert r.status_code == 422 and "form field 'boxes' is empty" in r.json()["detail"], r.text


def test_the_spec_describes_boxes_and_num_labeled(client):
    spec = client.get("/openapi.json").json()
    form = spec["paths"][URL]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    props = spec["components"]["schemas"][form["$ref"].rsplit("/", 1)[1]]["properties"] if "$ref" in form \
        else form["properties"]
    assert "[x1, y1, x2, y2]" in props["boxes"]["description"]
    assert "labeled examples" in props["boxes"]["description"]
    public = spec["components"]["schemas"]["ExemplarSetPublic"]
    assert "num_labeled" in public["required"] and public["properties"]["num_labeled"]["type"] == "integer"


@pytest.mark.parametrize(("field", "size"), [("files", (1, 1)), ("files", (1, 40)), ("files", (40, 1)),
                                             ("negative_files", (1, 30))])
def test_crops_under_two_pixels_are_422_naming_the_file_and_nothing_is_written(client, settings, field, size):
    create(client, [png_bytes(28, 28)])
    before = snapshot(settings)
    good, tiny = png_bytes(28, 28, seed=3), png_bytes(*size, seed=4, square=False)
    parts = [("files", ("good.png", good, "image/png"))]
    parts += [(field, ("tiny.png", tiny, "image/png"))] if field == "files" else [
        ("negative_files", ("ok.png", good, "image/png")), (field, ("tiny.png", tiny, "image/png"))]
    r = client.post(URL, files=parts)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert f"{field}: file 2 of 2 ('tiny.png')" in detail and f"{size[0]}x{size[1]} pixels" in detail, detail
    assert "at least 2 pixels" in detail
    assert snapshot(settings) == before
    # 2 x 2 is the smallest crop, as it is the smallest box
    smallest = [("files", ("two.png", png_bytes(2, 2, square=False), "image/png"))]
    assert client.post(URL, files=smallest).status_code == 201
