"""Exemplar sets and localization through the API, in process (SQLite, real files, real bundle format)."""

import uuid

from service_fixtures import TEST_BUNDLES, files, jpeg_bytes, png_bytes, row_counts, stored_files


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


def test_localize_boxes_in_uploaded_pixels_in_upload_order(client):
    set_id = create_set(client).json()["id"]
    sizes = [(84, 84), (200, 120), (31, 77)]
    uploads = [png_bytes(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    uploads.append(jpeg_bytes(150, 100))  # RGB JPEG, converted to the bundle's grayscale input
    sizes.append((150, 100))
    r = client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(*uploads))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["exemplar_set_id"] == set_id and body["bundle"] == TEST_BUNDLES[0]
    assert [res["filename"] for res in body["results"]] == [f"img{i}.png" for i in range(4)]
    for res, (w, h) in zip(body["results"], sizes, strict=True):
        assert (res["width"], res["height"]) == (w, h)
        x1, y1, x2, y2 = res["box"]
        assert 0 <= x1 < x2 <= w + 1e-3 and 0 <= y1 < y2 <= h + 1e-3
        assert "trajectory" not in res
        assert res["score"] >= 0


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


def test_localize_is_deterministic(client):
    set_id = create_set(client).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    a = client.post(url, files=files(png_bytes(seed=3), png_bytes(seed=4))).json()["results"]
    b = client.post(url, files=files(png_bytes(seed=3))).json()["results"]
    assert a[0]["box"] == b[0]["box"]


def test_health_ready_metrics(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["checks"] == {"database": "ok", "broker": "ok", "bundle": "ok"}
    set_id = create_set(client).json()["id"]
    client.post(f"/v1/exemplar-sets/{set_id}/localize", files=files(png_bytes(), png_bytes(seed=1)))
    text = client.get("/metrics").text
    assert 'qloc_http_request_duration_seconds_count{method="POST",route="/v1/exemplar-sets/{set_id}/localize"' in text
    assert "qloc_localize_batch_size_sum 2.0" in text
    assert 'qloc_jobs{status="queued"} 0.0' in text
    assert "# TYPE qloc_job_duration_seconds summary" in text


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
