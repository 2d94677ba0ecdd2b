"""Exemplar sets and localization through the API, in process (SQLite, real files, real bundle format)."""

import io
import uuid

import pytest
from PIL import Image
from service_fixtures import TEST_BUNDLES, files, jpeg_bytes, png_bytes, row_counts, stored_files

from models.bundle import load_bundle
from models.inference import Localizer, pil_to_tensor, resize_batch


def create_set(client, *blobs, **data):
    r = client.post("/v1/exemplar-sets", files=files(*(blobs or (png_bytes(28, 28),))), data=data)
    assert r.status_code == 201, r.text
    return r


def test_create_read_list_delete(client, settings):
    r = create_set(client, png_bytes(28, 28), png_bytes(30, 24, "RGB", seed=1), name="fours")
    body = r.json()
    assert r.headers["location"] == f"/v1/exemplar-sets/{body['id']}"
    assert body["name"] == "fours" and body["num_exemplars"] == 2 and body["bundle"] == TEST_BUNDLES[0]
    assert body["active_checkpoint_id"] is not None

    assert client.get(f"/v1/exemplar-sets/{body['id']}").json() == body
    second = create_set(client).json()
    page = client.get("/v1/exemplar-sets", params={"limit": 1}).json()
    assert page["count"] == 2 and [s["id"] for s in page["data"]] == [body["id"]]
    page = client.get("/v1/exemplar-sets", params={"limit": 1, "offset": 1}).json()
    assert [s["id"] for s in page["data"]] == [second["id"]]

    ckpts = client.get(f"/v1/exemplar-sets/{body['id']}/checkpoints").json()["data"]
    assert [(c["kind"], c["iteration"], c["active"], c["parent_id"]) for c in ckpts] == [("base", 0, True, None)]
    assert ckpts[0]["id"] == body["active_checkpoint_id"]

    assert len([f for f in stored_files(settings.storage_dir) if body["id"] in f]) == 2
    assert client.delete(f"/v1/exemplar-sets/{body['id']}").status_code == 204
    assert client.get(f"/v1/exemplar-sets/{body['id']}").status_code == 404
    assert client.get(f"/v1/checkpoints/{ckpts[0]['id']}").status_code == 404
    assert not [f for f in stored_files(settings.storage_dir) if body["id"] in f]
    counts = row_counts(settings.database_url)
    assert counts["exemplar_sets"] == 1 and counts["exemplars"] == 1 and counts["checkpoints"] == 1


def test_bundle_form_field_chooses_the_bundle(client):
    body = create_set(client, bundle=TEST_BUNDLES[1]).json()
    assert body["bundle"] == TEST_BUNDLES[1]
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), data={"bundle": "no-such-bundle"})
    assert r.status_code == 422 and "unknown bundle" in r.json()["detail"]
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), data={"bundle": "../etc/passwd"})
    assert r.status_code == 422


def decoded(blob):
    return Image.open(io.BytesIO(blob))


def library_answer(settings, exemplars, uploads, **kwargs):
    """The library's own answer, without the service: the set's bundle file loaded afresh, the prototype of
    the same exemplar files, ``Localizer.localize`` on the same decoded uploads -> (localizer, prototype,
    ``Localization`` per upload)."""
    loc = Localizer(load_bundle(settings.bundle_dir / f"{TEST_BUNDLES[0]}.pt", "cpu"), "cpu")
    prototype = loc.prototype([decoded(b) for b in exemplars])
    return loc, prototype, loc.localize([decoded(b) for b in uploads], prototype, **kwargs)


def input_frame_boxes(loc, prototype, uploads, nearest):
    """Each upload's final box in the bundle's input frame (size x size), from ``Localizer.run``."""
    batch, _ = resize_batch([pil_to_tensor(decoded(b), 1) for b in uploads], loc.spec.size)
    return loc.run(batch, prototype, loc.agent(), nearest=nearest).boxes[-1].tolist()


def assert_same_answer(api, lib):
    assert api["box"] == pytest.approx(list(lib.box), rel=1e-5, abs=1e-3), (api, lib)
    assert api["score"] == pytest.approx(lib.score, rel=1e-4, abs=1e-6), (api, lib)


SCENES = [png_bytes(84, 84, seed=0), png_bytes(200, 120, seed=1), png_bytes(31, 77, seed=2),
          jpeg_bytes(150, 100)]  # RGB JPEG, converted to the bundle's grayscale input
SCENE_SIZES = [(84, 84), (200, 120), (31, 77), (150, 100)]


@pytest.mark.parametrize("nearest", [False, True])
def test_localize_boxes_in_uploaded_pixels_in_upload_order(client, settings, nearest):
    exemplars = [png_bytes(28, 28), png_bytes(30, 24, "RGB", seed=1)]
    set_id = create_set(client, *exemplars).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    r = client.post(url, files=files(*SCENES), params={"nearest": str(nearest).lower()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["exemplar_set_id"] == set_id and body["bundle"] == TEST_BUNDLES[0] and body["nearest"] is nearest
    assert [res["filename"] for res in body["results"]] == [f"img{i}.png" for i in range(4)]

    # The library's answer on the same images, bundle file and exemplars, image by image.
    loc, prototype, lib = library_answer(settings, exemplars, SCENES, nearest=nearest)
    size = loc.spec.size
    frame = input_frame_boxes(loc, prototype, SCENES, nearest)
    for res, want, in_frame, (w, h) in zip(body["results"], lib, frame, SCENE_SIZES, strict=True):
        assert (res["width"], res["height"]) == (w, h)
        assert "trajectory" not in res
        assert_same_answer(res, want)
        # Uploaded pixels: x scaled by w / size, y by h / size, from the box in the bundle's input frame.
        x1, y1, x2, y2 = in_frame
        sx, sy = w / size, h / size
        assert res["box"] == pytest.approx([x1 * sx, y1 * sy, x2 * sx, y2 * sy], rel=1e-5, abs=1e-3)
        assert 0 <= res["box"][0] < res["box"][2] <= w + 1e-3 and 0 <= res["box"][1] < res["box"][3] <= h + 1e-3
    if nearest:  # the answer depends on the image: a constant box cannot pass
        assert len({tuple(round(v, 3) for v in b) for b in frame}) >= 2, frame

    # Reordered uploads: the answers are permuted the same way (each result follows its own image).
    order = [2, 0, 3, 1]
    again = client.post(url, files=files(*[SCENES[i] for i in order]),
                        params={"nearest": str(nearest).lower()}).json()["results"]
    for res, i in zip(again, order, strict=True):
        assert (res["width"], res["height"]) == SCENE_SIZES[i]
        assert_same_answer(res, lib[i])


def test_localize_is_deterministic(client, settings):
    """One image's box does not depend on the request, its batch or its place in it: the library's answer
    for that image alone, every time; and two images that differ get different boxes."""
    exemplars = [png_bytes(28, 28)]
    set_id = create_set(client, *exemplars).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    a, b, c = png_bytes(seed=1), png_bytes(seed=0), png_bytes(90, 60, seed=4)
    for nearest in ("false", "true"):
        alone = {name: library_answer(settings, exemplars, [blob], nearest=nearest == "true")[2][0]
                 for name, blob in (("a", a), ("b", b), ("c", c))}
        if nearest == "true":
            assert alone["a"].box != alone["b"].box  # same size, different content: a constant box fails
        assert alone["a"].box != alone["c"].box  # different sizes
        for batch in (["a", "b", "c"], ["b"], ["c", "a"], ["a", "b", "c"], ["b", "c", "a", "a"]):
            blobs = {"a": a, "b": b, "c": c}
            r = client.post(url, files=files(*[blobs[n] for n in batch]), params={"nearest": nearest})
            assert r.status_code == 200, r.text
            for name, res in zip(batch, r.json()["results"], strict=True):
                assert_same_answer(res, alone[name])


def test_localize_trajectory_and_checkpoint_choice(client):
    body = create_set(client).json()
    set_id, base_id = body["id"], body["active_checkpoint_id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    r = client.post(url, files=files(png_bytes(100, 50)), params={"trajectory": "true", "checkpoint": "base"})
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    assert r.json()["checkpoint_id"] == base_id
    assert res["trajectory"][0] == [0.0, 0.0, 100.0, 50.0] and res["trajectory"][-1] == res["box"]
    r = client.post(url, files=files(png_bytes()), params={"checkpoint": base_id})
    assert r.status_code == 200 and r.json()["checkpoint_id"] == base_id
    assert client.post(url, files=files(png_bytes()), params={"checkpoint": str(uuid.uuid4())}).status_code == 404
    assert client.post(url, files=files(png_bytes()), params={"checkpoint": "latest"}).status_code == 422
    other = create_set(client).json()["active_checkpoint_id"]  # another set's checkpoint
    assert client.post(url, files=files(png_bytes()), params={"checkpoint": other}).status_code == 404


def test_localize_answers_with_the_agent_of_the_checkpoint_it_serves(client):
    """An adapted checkpoint's own agent answers, named by its id or active once activated, and the base's is
    the bundle's own whichever ran before it (the engine keeps each checkpoint's agent apart). Two checkpoints
    whose agents always take one action: ``stay`` keeps the whole image, ``shrink_tl`` shrinks toward its corner."""
    from app.tables import Checkpoint
    from models.bundle import policy_to_bytes
    from models.core.actions import ACTION_NAMES

    body = create_set(client).json()
    set_id, base_id = body["id"], body["active_checkpoint_id"]
    state = client.app.state
    bundle = state.bundles.get(body["bundle"]).bundle

    def always(action: str) -> str:  # an adapted checkpoint (as a job writes it) whose agent always takes `action`
        agent = {k: v.clone() for k, v in bundle.agent_state.items()}
        agent["policy.weight"].zero_()
        agent["policy.bias"].fill_(-10.0)
        agent["policy.bias"][ACTION_NAMES.index(action)] = 10.0
        key, ckpt = f"exemplar-sets/{set_id}/{action}.pt", uuid.uuid4()
        sha = state.store.put(key, policy_to_bytes(agent, bundle_name=bundle.name, bundle_sha256=bundle.sha256,
                                                   prototype_dim=bundle.prototype_dim))
        with state.session_factory.begin() as s:
            s.add(Checkpoint(id=ckpt, exemplar_set_id=uuid.UUID(set_id), parent_id=uuid.UUID(base_id),
                             kind="adapted", iteration=1, sha256=sha, metrics={}, blob=key))
        return str(ckpt)

    stay, corner = always("stay"), always("shrink_tl")
    url = f"/v1/exemplar-sets/{set_id}/localize"

    def paths(checkpoint: str, served: str) -> list[list[list[float]]]:
        r = client.post(url, files=files(png_bytes(84, 84, seed=3), png_bytes(120, 90, seed=4)),
                        params={"trajectory": "true", "checkpoint": checkpoint})
        assert r.status_code == 200 and r.json()["checkpoint_id"] == served, r.text
        return [res["trajectory"] for res in r.json()["results"]]

    whole = [[0.0, 0.0, 84.0, 84.0]], [[0.0, 0.0, 120.0, 90.0]]
    base = paths("active", base_id)  # the bundle's agent first: cached before any checkpoint's
    assert all(len({tuple(b) for b in t}) > 1 for t in base)  # it moves
    for _ in range(2):  # and again: each checkpoint is kept apart from the others once cached
        kept = paths(stay, stay)
        assert [sorted({tuple(b) for b in t}) for t in kept] == [[tuple(w[0])] for w in whole]
        shrunk = paths(corner, corner)
        for t, (w,) in zip(shrunk, whole, strict=True):
            assert t[0] == w and all(b[:2] == [0.0, 0.0] for b in t)  # anchored at the top-left corner
            assert t[-1][2] < w[2] / 2 and t[-1][3] < w[3] / 2  # shrunk far
        assert paths("base", base_id) == paths(base_id, base_id) == base
    assert client.post(f"/v1/checkpoints/{stay}/activate").status_code == 200
    assert paths("active", stay) == kept and paths("base", base_id) == base
    assert client.post(f"/v1/checkpoints/{corner}/activate").status_code == 200
    assert paths("active", corner) == shrunk and paths(stay, stay) == kept


def test_localize_reads_the_set_and_its_active_checkpoint_in_one_query(client):
    """One SQL round trip before the model runs (one client's latency feels each); other checkpoints still
    resolve, and a set unknown to the caller is still a 404."""
    from sqlalchemy import event

    body = create_set(client).json()
    url = f"/v1/exemplar-sets/{body['id']}/localize"
    selects: list[str] = []

    def count(conn, cursor, statement, *args):  # noqa: ANN001, ANN002
        if statement.lstrip().upper().startswith("SELECT"):
            selects.append(statement)

    engine = client.app.state.engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        r = client.post(url, files=files(png_bytes()))
        assert r.status_code == 200, r.text
        assert r.json()["checkpoint_id"] == body["active_checkpoint_id"]
        assert len(selects) == 1 and "JOIN" in selects[0].upper(), [q[-300:] for q in selects]
        selects.clear()
        r = client.post(url, files=files(png_bytes()), params={"checkpoint": "base"})
        assert r.status_code == 200 and r.json()["checkpoint_id"] == body["active_checkpoint_id"]
        assert len(selects) == 2  # the set, then the base checkpoint by its kind
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert client.post(f"/v1/exemplar-sets/{uuid.uuid4()}/localize", files=files(png_bytes())).status_code == 404


def test_health_ready_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.head("/healthz").status_code == client.head("/readyz").status_code == 200  # probes that send HEAD
    ops = [op["operationId"] for path in client.get("/openapi.json").json()["paths"].values() for op in path.values()]
    assert len(ops) == len(set(ops)) and {"healthz", "healthz_head", "readyz", "readyz_head"} <= set(ops)  # unique
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"database": "ok", "broker": "ok", "bundle": "ok"}
    set_id = create_set(client).json()["id"]
    client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes(), png_bytes(seed=1)))
    text = client.get("/metrics").text
    assert 'qloc_http_request_duration_seconds_count{method="POST",route="/v1/exemplar-sets/{set_id}/localize"' in text
    assert "qloc_localize_batch_size_sum 2.0" in text
    assert 'qloc_jobs{status="queued"} 0.0' in text
    assert "# TYPE qloc_job_duration_seconds_mean gauge" in text


def test_localize_best_of_n_search(client):
    set_id = create_set(client).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    uploads = [png_bytes(seed=s) for s in range(6)]
    greedy = client.post(url, files=files(*uploads)).json()
    assert greedy["samples"] == 0  # the server's default: the greedy episode alone
    best = client.post(url, files=files(*uploads), params={"samples": 15, "trajectory": "true"})
    assert best.status_code == 200, best.text
    assert best.json()["samples"] == 15
    again = client.post(url, files=files(*uploads), params={"samples": 15, "trajectory": "true"}).json()
    assert again["results"] == best.json()["results"]  # seeded: the same answer every time
    for g, b in zip(greedy["results"], best.json()["results"], strict=True):
        assert b["score"] <= g["score"] + 1e-4  # the greedy episode is one of the candidates
        assert b["trajectory"][-1] == b["box"]
    assert any(b["score"] < g["score"] - 1e-4 for g, b in zip(greedy["results"], best.json()["results"],
                                                               strict=True))
    for bad in (-1, 64, "many"):
        r = client.post(url, files=files(png_bytes()), params={"samples": bad})
        assert r.status_code == 422 and "samples" in r.text


def test_localize_nearest_answers_with_the_nearest_visited_box(client):
    set_id = create_set(client).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    uploads = [png_bytes(seed=s) for s in range(6)]
    last = client.post(url, files=files(*uploads), params={"trajectory": "true"}).json()
    assert last["nearest"] is False  # the server's default: the episode's last box
    r = client.post(url, files=files(*uploads), params={"nearest": "true", "trajectory": "true"})
    assert r.status_code == 200, r.text
    near = r.json()
    assert near["nearest"] is True
    for a, b in zip(last["results"], near["results"], strict=True):
        assert b["score"] <= a["score"] + 1e-4  # the last box is one of the candidates
        assert b["box"] in b["trajectory"][1:] and b["trajectory"][-1] == b["box"]
        stop = b["trajectory"].index(b["box"])
        assert b["trajectory"][:stop + 1] == a["trajectory"][:stop + 1]  # the same greedy path up to the answer
    r = client.post(url, files=files(png_bytes()), params={"nearest": "maybe"})
    assert r.status_code == 422 and "nearest" in r.text


def test_server_setting_overrides_the_bundles_default_answer(settings, monkeypatch):
    from fastapi.testclient import TestClient

    from app.config import Settings
    from app.main import create_app

    monkeypatch.setenv("QLOC_LOCALIZE_NEAREST", "true")
    assert Settings().localize_nearest is True
    monkeypatch.delenv("QLOC_LOCALIZE_NEAREST")
    assert Settings().localize_nearest is None  # unset: each bundle decides
    with TestClient(create_app(settings.model_copy(update={"localize_nearest": True}))) as c:
        set_id = create_set(c).json()["id"]
        r = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()))
        assert r.status_code == 200 and r.json()["nearest"] is True  # the cMNIST bundle's own default is last
        r = c.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes()), params={"nearest": "false"})
        assert r.json()["nearest"] is False  # the request has the last word


def test_localize_answers_while_another_connection_holds_the_sqlite_write_lock(client, settings):
    """A localize request only reads: on SQLite it begins a deferred transaction and does not queue behind a
    writer (before, every transaction took the write lock and waited up to the 30 s busy timeout)."""
    import sqlite3

    from sqlalchemy.engine import make_url

    sid = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
    writer = sqlite3.connect(make_url(settings.database_url).database, timeout=0, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")  # held until the request has answered
        r = client.post(f"/v1/exemplar-sets/{sid}/localize", files=files(png_bytes(seed=3)))
        assert r.status_code == 200, r.text
        assert writer.in_transaction
    finally:
        writer.rollback()
        writer.close()
