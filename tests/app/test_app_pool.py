"""An exemplar set's image pool: add over many requests under a cap (nothing of a refused request stored, the
cap held by concurrent adds), list and count, delete one or all, deleted with the set, localize's ``keep``,
and adaptation jobs that take the pool (a snapshot; the images they took are kept while they are queued)."""

import io
import uuid
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image
from service_fixtures import (
    at_once,
    files,
    make_test_settings,
    migrate,
    png_bytes,
    snapshot,
    stored_files,
)
from sqlalchemy import select

from app import pool
from app.db import make_engine, make_sessionmaker
from app.images import DecodedImage
from app.tables import ExemplarSet, JobImage, PoolImage


@pytest.fixture(params=["sqlite", "postgresql"])
def pool_settings(request, tmp_path, bundle_dir):
    """Settings with a small pool cap (5 images, 200 kB), on SQLite then on PostgreSQL."""
    url = f"sqlite:///{tmp_path}/qloc.db" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    s = make_test_settings(tmp_path, bundle_dir, database_url=url, max_pool_images=5, max_pool_bytes=200_000)
    migrate(s.database_url)
    return s


@pytest.fixture
def api(pool_settings):
    from fastapi.testclient import TestClient

    from app.main import create_app

    app = create_app(pool_settings)
    yield TestClient(app)
    app.state.engine.dispose()


def new_set(api):
    r = api.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9)))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def named(*names, seed=0):
    return [("files", (name, png_bytes(84, 84, seed=seed + i), "image/png")) for i, name in enumerate(names)]


@contextmanager
def session_on(settings):
    """A session on the settings' database, its engine disposed afterwards."""
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as s:
            yield s
    finally:
        engine.dispose()


def decoded(n, name="{}.png"):
    """``n`` 84 x 84 PNG uploads as the routes decode them -> (the images, the bytes of each)."""
    image = Image.open(io.BytesIO(png_bytes(84, 84)))
    image.load()
    data = png_bytes(84, 84)
    return [DecodedImage(filename=name.format(i), data=data, image=image, format="PNG", width=84, height=84)
            for i in range(n)], data


def pool_rows(settings, set_id):
    with session_on(settings) as s:
        return list(s.scalars(select(PoolImage).where(PoolImage.exemplar_set_id == uuid.UUID(set_id))))


def test_add_over_requests_list_count_and_delete(api, pool_settings):
    set_id = new_set(api)
    r = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a.png", "b.png"))
    assert r.status_code == 201, r.text
    first = r.json()
    assert [im["filename"] for im in first["data"]] == ["a.png", "b.png"]
    assert first["num_pool_images"] == 2 and first["max_pool_images"] == 5 and first["max_pool_bytes"] == 200_000
    r = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("c.png", "d.png", "e.png", seed=5))
    assert r.status_code == 201, r.text
    sizes = [im["size"] for im in first["data"] + r.json()["data"]]

    es = api.get(f"/v1/exemplar-sets/{set_id}").json()
    assert es["num_pool_images"] == 5 and es["pool_bytes"] == sum(sizes)
    listed = api.get(f"/v1/exemplar-sets/{set_id}/images").json()
    assert listed["count"] == 5 and listed["pool_bytes"] == sum(sizes)
    assert [im["filename"] for im in listed["data"]] == ["a.png", "b.png", "c.png", "d.png", "e.png"]  # pool order
    page = api.get(f"/v1/exemplar-sets/{set_id}/images", params={"limit": 2, "offset": 1}).json()
    assert [im["filename"] for im in page["data"]] == ["b.png", "c.png"] and page["count"] == 5
    rows = {str(r.id): r for r in pool_rows(pool_settings, set_id)}
    assert all(pool_settings.storage_dir.joinpath(r.blob).is_file() for r in rows.values())
    assert all(r.blob.startswith(f"exemplar-sets/{set_id}/pool/") for r in rows.values())

    # one image: row, file and counts go
    gone = listed["data"][1]
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images/{gone['id']}").status_code == 204
    assert not pool_settings.storage_dir.joinpath(rows[gone["id"]].blob).exists()
    es = api.get(f"/v1/exemplar-sets/{set_id}").json()
    assert es["num_pool_images"] == 4 and es["pool_bytes"] == sum(sizes) - gone["size"]
    r = api.delete(f"/v1/exemplar-sets/{set_id}/images/{gone['id']}")
    assert r.status_code == 404 and "not found" in r.json()["detail"]
    other = new_set(api)  # an image of another set's pool is not this set's
    assert api.delete(f"/v1/exemplar-sets/{other}/images/{listed['data'][0]['id']}").status_code == 404

    # all of them
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").status_code == 204
    assert api.get(f"/v1/exemplar-sets/{set_id}/images").json()["count"] == 0
    es = api.get(f"/v1/exemplar-sets/{set_id}").json()
    assert es["num_pool_images"] == 0 and es["pool_bytes"] == 0
    assert not any("/pool/" in f for f in stored_files(pool_settings.storage_dir))
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").status_code == 204  # an empty pool: nothing to do

    unknown = uuid.uuid4()
    for method, url in [("get", f"/v1/exemplar-sets/{unknown}/images"),
                        ("delete", f"/v1/exemplar-sets/{unknown}/images"),
                        ("delete", f"/v1/exemplar-sets/{unknown}/images/{unknown}")]:
        assert getattr(api, method)(url).status_code == 404
    r = api.post(f"/v1/exemplar-sets/{unknown}/images", files=named("x.png"))
    assert r.status_code == 404


def test_a_request_past_the_cap_is_refused_whole_and_stores_nothing(api, pool_settings):
    set_id = new_set(api)
    assert api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("1", "2", "3", "4")).status_code == 201
    before = snapshot(pool_settings)
    r = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("5", "6"))
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert "holds 4 images" in detail and "at most 5" in detail and "adds 2 images" in detail and "DELETE" in detail
    assert snapshot(pool_settings) == before
    assert api.get(f"/v1/exemplar-sets/{set_id}").json()["num_pool_images"] == 4
    assert api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("5")).status_code == 201  # up to the cap
    assert api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("6")).status_code == 409

    # bytes: a pool of 200 kB takes no 3 files of 90 kB, whatever its image count
    noise = [np.random.default_rng(i).integers(0, 256, (295, 295), dtype=np.uint8) for i in range(3)]
    big = []
    for arr in noise:
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "PNG")
        big.append(buf.getvalue())
    assert all(80_000 < len(b) < 100_000 for b in big)
    fresh = new_set(api)
    before = snapshot(pool_settings)
    r = api.post(f"/v1/exemplar-sets/{fresh}/images", files=files(*big))
    assert r.status_code == 409 and "200000 bytes" in r.json()["detail"]
    assert snapshot(pool_settings) == before
    assert api.post(f"/v1/exemplar-sets/{fresh}/images", files=files(*big[:2])).status_code == 201

    # a bad file among good ones: nothing stored either
    before = snapshot(pool_settings)
    bad = ("files", ("bad.png", b"nope", "image/png"))
    r = api.post(f"/v1/exemplar-sets/{fresh}/images", files=[*named("ok"), bad])
    assert r.status_code == 415
    assert snapshot(pool_settings) == before


def test_concurrent_adds_never_pass_the_cap(api, pool_settings):
    set_id = uuid.UUID(new_set(api))
    two, data = decoded(2)

    def add(ctx, i):
        with ctx.session_factory() as s:
            try:
                return len(pool.add(s, ctx.store, set_id=set_id, images=two, limits=pool.Limits(5, 10**9)))
            except pool.PoolFull:
                return "full"

    results = at_once(pool_settings, 8, add)
    assert sorted(results, key=str) == [2, 2] + ["full"] * 6  # 4 of 5: a third pair would pass the cap
    rows = pool_rows(pool_settings, str(set_id))
    assert len(rows) == 4 and len([f for f in stored_files(pool_settings.storage_dir) if "/pool/" in f]) == 4
    es = api.get(f"/v1/exemplar-sets/{set_id}").json()
    assert es["num_pool_images"] == 4 and es["pool_bytes"] == 4 * len(data)


def test_add_holds_the_byte_cap_itself_and_changes_only_its_sets_counts(api, pool_settings):
    """``add`` decides for good, whatever ``check_room`` saw: the byte cap at its bound (the image count's is above),
    the message with what the pool holds now, nothing stored when refused, and only the set added to counted."""
    from app.storage import BlobStore

    mine, other = uuid.UUID(new_set(api)), uuid.UUID(new_set(api))
    one, data = decoded(1, name="a.png")
    store = BlobStore(pool_settings.storage_dir)
    with session_on(pool_settings) as s:
        exact = pool.Limits(max_images=5, max_bytes=2 * len(data))  # two images fill it exactly
        rows = pool.add(s, store, set_id=mine, images=one + one, limits=exact)
        assert [(r.position, r.blob) for r in rows] == [
            (k, f"exemplar-sets/{mine}/pool/{r.id}.png") for k, r in enumerate(rows)]
        before = stored_files(pool_settings.storage_dir)
        with pytest.raises(pool.PoolFull) as full:
            pool.add(s, store, set_id=mine, images=one, limits=exact)
        assert stored_files(pool_settings.storage_dir) == before
        assert full.value.args[0] == (
            f"the set's image pool is full: it holds 2 images ({2 * len(data)} bytes) of at most 5 "
            f"({2 * len(data)} bytes), and this request adds 1 image ({len(data)} bytes). Nothing was stored: "
            f"delete pool images (DELETE /v1/exemplar-sets/{mine}/images/{{image_id}}, or all of them with "
            f"DELETE /v1/exemplar-sets/{mine}/images) or send fewer")
        es = s.get_one(ExemplarSet, mine)
        s.refresh(es)
        with pytest.raises(pool.PoolFull) as full:
            pool.check_room(es, one, exact)
        assert f"DELETE /v1/exemplar-sets/{mine}/images/{{image_id}}" in full.value.args[0]
        pool.check_room(es, one, pool.Limits(max_images=3, max_bytes=3 * len(data)))  # room for one: no error
        s.expire_all()
        counts = {sid: (s.get_one(ExemplarSet, sid).num_pool_images, s.get_one(ExemplarSet, sid).pool_bytes)
                  for sid in (mine, other)}
    assert counts == {mine: (2, 2 * len(data)), other: (0, 0)}


def test_the_pool_is_deleted_with_its_set(api, pool_settings):
    set_id = new_set(api)
    before = snapshot(pool_settings)
    api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b", "c"))
    job = api.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"source": "pool"})
    assert job.status_code == 202, job.text
    assert api.post(f"/v1/adaptations/{job.json()['id']}/cancel").status_code == 202
    counts, stored = snapshot(pool_settings)
    assert counts["pool_images"] == 3 and len([f for f in stored if "/pool/" in f]) == 3
    assert api.delete(f"/v1/exemplar-sets/{set_id}").status_code == 204
    counts, stored = snapshot(pool_settings)
    assert counts["pool_images"] == counts["job_images"] == 0 and not any(set_id in f for f in stored)
    assert counts["exemplar_sets"] == before[0]["exemplar_sets"] - 1


def test_localize_keeps_its_images_only_when_asked(api, pool_settings, monkeypatch):
    from app.routes import localize

    kept_bytes = []  # whether each request's decoded uploads kept their bytes (only keep=true needs them)
    real_read = localize.read_images

    def read_images(*args, **kwargs):
        images = real_read(*args, **kwargs)
        kept_bytes.append([bool(im.data) for im in images])
        return images

    monkeypatch.setattr(localize, "read_images", read_images)
    set_id = new_set(api)
    r = api.post(f"/v1/exemplar-sets/{set_id}/localize", files=named("a.png", "b.png"))
    assert r.status_code == 200 and "kept" not in r.json()
    assert api.get(f"/v1/exemplar-sets/{set_id}/images").json()["count"] == 0

    r = api.post(f"/v1/exemplar-sets/{set_id}/localize", params={"keep": "true"},
                 files=named("a.png", "b.png", "c.png"))
    assert r.status_code == 200, r.text
    kept = r.json()["kept"]
    listed = api.get(f"/v1/exemplar-sets/{set_id}/images").json()
    assert [im["id"] for im in listed["data"]] == kept and len(kept) == 3
    assert [im["filename"] for im in listed["data"]] == ["a.png", "b.png", "c.png"]
    sent = png_bytes(84, 84, seed=0)  # the first file, stored as uploaded
    row = next(r for r in pool_rows(pool_settings, set_id) if str(r.id) == kept[0])
    assert pool_settings.storage_dir.joinpath(row.blob).read_bytes() == sent

    # 3 of 5 held: 3 more do not fit, refused before any work, nothing stored
    before = snapshot(pool_settings)
    r = api.post(f"/v1/exemplar-sets/{set_id}/localize", params={"keep": "true"}, files=named("d", "e", "f"))
    assert r.status_code == 409 and "pool is full" in r.json()["detail"]
    assert snapshot(pool_settings) == before
    r = api.post(f"/v1/exemplar-sets/{set_id}/localize", params={"keep": "true"}, files=named("d", "e"))
    assert r.status_code == 200 and len(r.json()["kept"]) == 2
    assert kept_bytes == [[False, False], [True, True, True], [True, True, True], [True, True]]


def test_jobs_on_the_pool_the_files_or_both(api, pool_settings):
    set_id = new_set(api)
    url = f"/v1/exemplar-sets/{set_id}/adaptations"
    before = snapshot(pool_settings)
    for data, upload, needle in [({}, None, "pool is empty"), ({"source": "pool"}, None, "pool is empty"),
                                 ({"source": "both"}, None, "no file was posted"),
                                 ({"source": "files"}, None, "at least one file"),
                                 ({"source": "pool"}, named("a"), "post no files"),
                                 ({"source": "everything"}, named("a"), "")]:
        r = api.post(url, data=data, files=upload) if upload else api.post(url, data=data)
        assert r.status_code == 422, (data, r.text)
        assert needle in str(r.json()["detail"])
    assert snapshot(pool_settings) == before

    api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("p1", "p2", "p3"))
    pooled = api.post(url, data={"source": "pool", "iterations": "2"})
    assert pooled.status_code == 202, pooled.text
    assert pooled.json()["params"]["num_images"] == pooled.json()["params"]["num_pool_images"] == 3
    implicit = api.post(url, data={"iterations": "2"})  # no file: the pool
    assert implicit.json()["params"]["num_pool_images"] == 3
    r = api.post(url, data={"source": "both", "iterations": "2"})  # the files lost on the way: not a pool job
    assert r.status_code == 422 and "no file was posted" in r.json()["detail"]
    both = api.post(url, data={"source": "both", "iterations": "2"}, files=named("f1", "f2"))
    assert both.status_code == 202, both.text
    assert both.json()["params"]["num_images"] == 5 and both.json()["params"]["num_pool_images"] == 3
    only_files = api.post(url, files=named("f1"))
    assert only_files.json()["params"]["num_images"] == 1 and only_files.json()["params"]["num_pool_images"] == 0

    with session_on(pool_settings) as s:
        rows = list(s.scalars(select(JobImage).where(JobImage.job_id == uuid.UUID(both.json()["id"]))
                              .order_by(JobImage.position)))
        pool_blobs = {r.id: r.blob for r in s.scalars(select(PoolImage))}
    assert [r.filename for r in rows] == ["f1", "f2", "p1", "p2", "p3"]
    assert [r.pool_image_id is None for r in rows] == [True, True, False, False, False]
    assert all(r.blob == pool_blobs[r.pool_image_id] for r in rows[2:])  # the pool's files, not copies

    # an idempotent replay of a pool job is the same job
    r1 = api.post(url, data={"source": "pool", "iterations": "2"}, headers={"Idempotency-Key": "pool-1"})
    r2 = api.post(url, data={"source": "pool", "iterations": "2"}, headers={"Idempotency-Key": "pool-1"})
    assert r1.json()["id"] == r2.json()["id"] and r2.headers["Idempotent-Replayed"] == "true"
    # ... also once the pool it took is gone: the retry gets its job, not "the pool is empty"
    for job in api.get(f"/v1/exemplar-sets/{set_id}/adaptations").json()["data"]:
        if job["status"] in ("queued", "running"):
            assert api.post(f"/v1/adaptations/{job['id']}/cancel").status_code == 202
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").status_code == 204
    r3 = api.post(url, data={"source": "pool", "iterations": "2"}, headers={"Idempotency-Key": "pool-1"})
    assert r3.status_code == 202 and r3.json()["id"] == r1.json()["id"], r3.text
    r4 = api.post(url, data={"source": "pool", "iterations": "2"}, headers={"Idempotency-Key": "pool-2"})
    assert r4.status_code == 422 and "pool is empty" in r4.json()["detail"], r4.text


def test_images_a_queued_job_took_are_kept_until_it_ends(api, pool_settings):
    set_id = new_set(api)
    added = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b")).json()["data"]
    job = api.post(f"/v1/exemplar-sets/{set_id}/adaptations", data={"source": "pool"}).json()
    late = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("c")).json()["data"][0]  # not the job's
    assert api.get(f"/v1/adaptations/{job['id']}").json()["params"]["num_images"] == 2

    before = snapshot(pool_settings)
    for url in (f"/v1/exemplar-sets/{set_id}/images/{added[0]['id']}", f"/v1/exemplar-sets/{set_id}/images"):
        r = api.delete(url)
        assert r.status_code == 409, r.text
        assert job["id"] in r.json()["detail"] and "cancel" in r.json()["detail"]
    assert snapshot(pool_settings) == before
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images/{late['id']}").status_code == 204  # not taken by a job

    assert api.post(f"/v1/adaptations/{job['id']}/cancel").status_code == 202  # the job ends
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images/{added[0]['id']}").status_code == 204
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").status_code == 204
    assert pool_rows(pool_settings, set_id) == []
    counts, _ = snapshot(pool_settings)
    assert counts["job_images"] == 2  # the finished job keeps its record, unlinked from the deleted images
    with session_on(pool_settings) as s:
        assert s.scalar(select(ExemplarSet.num_pool_images).where(ExemplarSet.id == uuid.UUID(set_id))) == 0
        assert all(r.pool_image_id is None for r in s.scalars(select(JobImage)))


def test_what_a_refused_deletion_names_one_job_or_the_first_five(api, pool_settings):
    set_id = new_set(api)
    (image,) = api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a")).json()["data"]
    url = f"/v1/exemplar-sets/{set_id}/adaptations"
    first = api.post(url, data={"source": "pool"}).json()["id"]
    r = api.delete(f"/v1/exemplar-sets/{set_id}/images/{image['id']}")
    assert (r.status_code, r.json()["detail"]) == (409, (
        f"1 queued or running adaptation job ({first}) adapts on this pool image: it is kept until it ends; cancel "
        "it (POST /v1/adaptations/{job_id}/cancel) or wait, then delete again"))
    jobs = sorted([uuid.UUID(first)] + [uuid.UUID(api.post(url, data={"source": "pool"}).json()["id"])
                                        for _ in range(5)])
    r = api.delete(f"/v1/exemplar-sets/{set_id}/images")
    shown = ", ".join(str(j) for j in jobs[:5])
    assert (r.status_code, r.json()["detail"]) == (409, (
        f"6 queued or running adaptation jobs ({shown}, ...) adapt on images of this pool: it is kept until they "
        "end; cancel them (POST /v1/adaptations/{job_id}/cancel) or wait, then delete again"))
    with session_on(pool_settings) as s, pytest.raises(pool.ImageInUse) as in_use:
        pool.delete_images(s, set_id=uuid.UUID(set_id))
    assert in_use.value.job_ids == jobs
    assert api.post(f"/v1/adaptations/{jobs[5]}/cancel").status_code == 202
    assert api.delete(f"/v1/exemplar-sets/{set_id}/images").json()["detail"].startswith(
        f"5 queued or running adaptation jobs ({shown}) adapt on images of this pool")  # five: all named


def test_deleting_one_sets_pool_images_leaves_other_jobs_links(api, pool_settings):
    """Deleting images unlinks only the rows that named them: another set's queued job keeps the pool images it took
    (still refused for deletion), and a finished job of the same set keeps its other links."""
    mine, other = new_set(api), new_set(api)
    a, b = api.post(f"/v1/exemplar-sets/{mine}/images", files=named("a", "b")).json()["data"]
    api.post(f"/v1/exemplar-sets/{other}/images", files=named("c"))
    done = api.post(f"/v1/exemplar-sets/{mine}/adaptations", data={"source": "pool"}).json()["id"]
    assert api.post(f"/v1/adaptations/{done}/cancel").status_code == 202
    waiting = api.post(f"/v1/exemplar-sets/{other}/adaptations", data={"source": "pool"}).json()["id"]
    assert api.delete(f"/v1/exemplar-sets/{mine}/images/{a['id']}").status_code == 204
    with session_on(pool_settings) as s:
        links = {(str(r.job_id), str(r.pool_image_id) if r.pool_image_id else None)
                 for r in s.scalars(select(JobImage))}
    assert {(j, i) for j, i in links if j == done} == {(done, None), (done, b["id"])}
    assert [i is not None for j, i in links if j == waiting] == [True]
    assert api.delete(f"/v1/exemplar-sets/{other}/images").status_code == 409  # the waiting job still holds it


def test_a_failed_write_is_not_taken_for_a_deleted_set_while_the_set_is_there(api, pool_settings):
    """``deleted_meanwhile`` after an upload failed: a set still there keeps every file (a full disk is not a
    deletion), and only a set gone has what is left of its folder removed."""
    from app.storage import BlobStore

    set_id = new_set(api)
    assert api.post(f"/v1/exemplar-sets/{set_id}/images", files=named("a", "b")).status_code == 201
    before = stored_files(pool_settings.storage_dir)
    store = BlobStore(pool_settings.storage_dir)
    with session_on(pool_settings) as s:
        for error in (OSError(28, "No space left on device"), ValueError("not a storage error")):
            assert not pool.deleted_meanwhile(s, store, uuid.UUID(set_id), error)
        assert stored_files(pool_settings.storage_dir) == before
        other = new_set(api)
        assert pool.deleted_meanwhile(s, store, uuid.UUID(other), pool.SetGone(other))  # said gone: it is
        assert api.delete(f"/v1/exemplar-sets/{other}").status_code == 204
        (pool_settings.storage_dir / "exemplar-sets" / other / "pool").mkdir(parents=True)  # a write re-made it
        assert pool.deleted_meanwhile(s, store, uuid.UUID(other), OSError(2, "No such file or directory"))
        assert not (pool_settings.storage_dir / "exemplar-sets" / other).exists()
    assert stored_files(pool_settings.storage_dir) == before


@pytest.mark.parametrize("when", ["before_the_write", "under_the_write"])
@pytest.mark.parametrize("route", ["pool", "keep", "adaptation"])
def test_a_set_deleted_while_an_upload_writes_its_files_is_404_and_leaves_no_file(api, pool_settings, monkeypatch,
                                                                                 route, when):
    """DELETE of the set lands while an upload for it (pool images, localize keep=true, a job's images) writes its
    files: deleted before the write (the write re-makes the folder; the set's lock then finds no set), or its folder
    removed under the write (the write fails). Either way a JSON 404, no 500, and nothing left of the set on disk."""
    from app.storage import BlobStore

    set_id = new_set(api)
    original = BlobStore.put
    done = []

    def put(self, key, data):  # noqa: ANN001, ANN202
        if not done and key.startswith(f"exemplar-sets/{set_id}/"):
            done.append(key)
            assert api.delete(f"/v1/exemplar-sets/{set_id}").status_code == 204  # its rows, then its folder
            if when == "under_the_write":
                raise FileNotFoundError(2, "No such file or directory", str(self.path(key)))
        return original(self, key, data)

    monkeypatch.setattr(BlobStore, "put", put)
    url = {"pool": f"/v1/exemplar-sets/{set_id}/images", "keep": f"/v1/exemplar-sets/{set_id}/localize?keep=true",
           "adaptation": f"/v1/exemplar-sets/{set_id}/adaptations"}[route]
    r = api.post(url, files=named("a.png", "b.png"), data={"iterations": "2"} if route == "adaptation" else None)
    assert done, "the upload wrote no file"
    assert r.status_code == 404 and "not found" in r.json()["detail"], r.text
    assert not (pool_settings.storage_dir / "exemplar-sets" / set_id).exists(), stored_files(pool_settings.storage_dir)
    assert api.get(f"/v1/exemplar-sets/{set_id}").status_code == 404
