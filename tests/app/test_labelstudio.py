"""Label Studio's ML backend protocol (``/v1/labelstudio/{set_id}``): health, setup, predict, webhook, auth.

Fast protocol tests against the real app; task images come as ``data:`` URIs and from a local HTTP server (a
stand-in for Label Studio and for any image host). The run against a real Label Studio is
``scripts/labelstudio-e2e`` (README, "Label Studio").
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from fastapi.testclient import TestClient
from labelstudio_fake import IMAGES, JWT
from service_fixtures import api, db_settings, files, free_port, make_test_settings, migrate, png_bytes  # noqa: F401
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.db import make_engine
from app.labelstudio import Refused, parse_label_config, project_id
from app.main import create_app
from app.tables import AdaptationJob, LabelStudioSetup

CONFIG = """<View>
  <Image name="img" value="$picture"/>
  <RectangleLabels name="box" toName="img"><Label value="Other"/><Label value="Square"/></RectangleLabels>
</View>"""
KEY_A, KEY_B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"
LS_TOKEN = "ls-legacy-token-0123"


def data_uri(blob: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(blob).decode()


def new_set(client: TestClient, name: str = "square", headers: dict | None = None, **data: Any) -> str:
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9)),
                     data={"name": name, "threshold": "0", **data}, headers=headers or {})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def tasks_of(urls: list[str]) -> list[dict]:
    return [{"id": 100 + k, "data": {"picture": u}, "project": 3} for k, u in enumerate(urls)]


def predict(client: TestClient, sid: str, urls: list[str], config: str = CONFIG, **kw: Any):  # type: ignore[no-untyped-def]
    return client.post(f"/v1/labelstudio/{sid}/predict", json={
        "tasks": tasks_of(urls), "label_config": config, "project": "3.1712345678",
        "params": {"login": None, "password": None, "context": None}}, **kw)


@pytest.fixture
def keyed(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    settings = make_test_settings(tmp_path, bundle_dir, api_keys=[KEY_A, KEY_B])
    migrate(settings.database_url)
    with TestClient(create_app(settings)) as c:
        yield c


# --- the label config


def test_label_config_picks_the_rectangle_labels_and_the_sets_label():
    t = parse_label_config(CONFIG, set_name="SQUARE")
    assert (t.from_name, t.to_name, t.image_key, t.label) == ("box", "img", "picture", "Square")
    one = '<View><Image name="i" value="$image"/><RectangleLabels name="l" toName="i"><Label value="x"/>' \
          '</RectangleLabels></View>'
    assert parse_label_config(one, set_name=None).label == "x"  # one label: it, whatever the set's name
    for bad, words in (
        ("", "empty"), ("<View", "not valid XML"),
        ('<!DOCTYPE x [<!ENTITY a "b">]><View/>', "DOCTYPE"),
        ('<View><Image name="i" value="$image"/><Choices name="c" toName="i"/></View>', "no <RectangleLabels>"),
        ('<View><Image name="i" value="http://x/a.png"/><RectangleLabels name="l" toName="i"><Label value="x"/>'
         '</RectangleLabels></View>', "task data key"),
        (CONFIG, "name the exemplar set like one of them"),
    ):
        with pytest.raises(Refused) as e:
            parse_label_config(bad, set_name="circle")
        assert e.value.status == 422 and words in e.value.detail, e.value.detail


def test_project_ids_parse():
    assert [project_id(p) for p in ("12.1712345678", 12, {"id": 7}, None, True)] == ["12", "12", "7", "", ""]


# --- health, setup


def test_health_and_setup_answer_the_active_checkpoint(client):
    sid = new_set(client)
    for path in ("/health", "", "/"):
        r = client.get(f"/v1/labelstudio/{sid}{path}")
        assert r.status_code == 200 and r.json()["status"] == "UP", (path, r.text)
    (base,) = client.get(f"/v1/exemplar-sets/{sid}/checkpoints").json()["data"]
    r = client.post(f"/v1/labelstudio/{sid}/setup", json={
        "project": "3.1712345678", "schema": CONFIG, "hostname": "http://localhost:8080", "access_token": "t",
        "extra_params": None})
    assert r.status_code == 200 and r.json() == {"model_version": base["id"]}
    assert client.get(f"/v1/labelstudio/{sid}/versions").json() == {"versions": [base["id"]]}
    assert client.get(f"/v1/labelstudio/{sid}/metrics").json() == {}
    r = client.post(f"/v1/labelstudio/{sid}/setup", json={"project": "3.1", "schema": "<View/>"})
    assert r.status_code == 422 and "RectangleLabels" in r.json()["detail"]
    unknown = "00000000-0000-0000-0000-000000000000"
    assert client.get(f"/v1/labelstudio/{unknown}/health").status_code == 404
    assert client.post(f"/v1/labelstudio/{unknown}/setup", json={"schema": CONFIG}).status_code == 404
    assert client.get("/v1/labelstudio/not-a-uuid/health").status_code == 422


# --- predict


def test_extra_params_max_instances_gives_a_region_per_found_instance(client):
    sid = new_set(client)
    imgs = [png_bytes(seed=1), png_bytes(160, 100, seed=2)]
    setup = {"project": "3.1712345678", "schema": CONFIG}
    for bad in ({"max_instances": 0}, {"max_instances": 33}, {"max_instances": "4"}, "[", [4]):
        r = client.post(f"/v1/labelstudio/{sid}/setup", json={**setup, "extra_params": bad})
        assert r.status_code == 422, (bad, r.text)
        assert "max_instances" in r.json()["detail"] or "extra_params" in r.json()["detail"]
    assert predict(client, sid, [data_uri(b) for b in imgs]).json()["results"][0]["result"][0]["id"] == "qloc-0"
    r = client.post(f"/v1/labelstudio/{sid}/setup", json={**setup, "extra_params": '{"max_instances": 3}'})
    assert r.status_code == 200, r.text
    body = predict(client, sid, [data_uri(b) for b in imgs]).json()
    many = client.post(f"/v1/exemplar-sets/{sid}/localize?max_instances=3", files=files(*imgs)).json()["results"]
    for pred, p in zip(body["results"], many, strict=True):
        found = [i for i in p["instances"] if i["found"]]
        assert len(pred["result"]) == len(found) >= 1
        for region, inst in zip(pred["result"], found, strict=True):
            x1, y1, x2, y2 = inst["box"]
            assert [region["value"]["x"], region["value"]["width"]] == pytest.approx(
                [100 * x1 / p["width"], 100 * (x2 - x1) / p["width"]])


def test_predict_with_data_uris_answers_localizes_boxes_in_percent(client):
    sid = new_set(client)
    imgs = [png_bytes(seed=1), png_bytes(160, 100, seed=2), png_bytes(50, 70, seed=3)]
    plain = client.post(f"/v1/exemplar-sets/{sid}/localize", files=files(*imgs)).json()
    r = predict(client, sid, [data_uri(b) for b in imgs])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_version"] == plain["checkpoint_id"]
    assert len(body["results"]) == 3
    for pred, p in zip(body["results"], plain["results"], strict=True):
        assert pred["model_version"] == plain["checkpoint_id"]
        assert pred["score"] == pytest.approx(p["confidence"])
        (region,) = pred["result"]
        assert (region["from_name"], region["to_name"], region["type"]) == ("box", "img", "rectanglelabels")
        assert (region["original_width"], region["original_height"]) == (p["width"], p["height"])
        x1, y1, x2, y2 = p["box"]
        w, h = p["width"], p["height"]
        v = region["value"]
        assert v["rectanglelabels"] == ["Square"]
        assert [v["x"], v["y"], v["width"], v["height"]] == pytest.approx(
            [100 * x1 / w, 100 * y1 / h, 100 * (x2 - x1) / w, 100 * (y2 - y1) / h])
    # the same tasks in localize's own Label Studio format: the same regions
    ls = client.post(f"/v1/exemplar-sets/{sid}/localize?format=labelstudio&label=Square", files=files(*imgs)).json()
    for pred, task in zip(body["results"], ls, strict=True):
        assert pred["result"][0]["value"] == task["predictions"][0]["result"][0]["value"]


def test_predict_fetches_http_urls_and_label_studio_paths_with_its_token(client, fake_ls):
    sid = new_set(client)
    imgs = list(IMAGES.values())
    plain = client.post(f"/v1/exemplar-sets/{sid}/localize", files=files(*imgs)).json()["results"]
    # absolute URLs: fetched as they are, no token (none is known yet)
    r = predict(client, sid, [f"{fake_ls.url}/any/{n}" for n in IMAGES])
    assert r.status_code == 200, r.text
    assert [p["result"][0]["value"]["x"] for p in r.json()["results"]] == pytest.approx(
        [100 * p["box"][0] / p["width"] for p in plain])
    assert all(auth is None for _, auth in fake_ls.seen)
    # a Label Studio path or a cloud storage URI before /setup: Label Studio's address is unknown
    for url in ("/data/upload/3/a.png", "s3://bucket/a.png"):
        r = predict(client, sid, [url])
        assert r.status_code == 422 and "QLOC_LABELSTUDIO_URL" in r.json()["detail"], r.text
    # /setup gives the address and the token: paths and Label Studio's own absolute URLs carry it
    assert client.post(f"/v1/labelstudio/{sid}/setup", json={
        "project": "3.1712345678", "schema": CONFIG, "hostname": fake_ls.url, "access_token": LS_TOKEN}
    ).status_code == 200
    fake_ls.seen.clear()
    r = predict(client, sid, ["/data/upload/3/a.png", f"{fake_ls.url}/data/upload/3/b.png"])
    assert r.status_code == 200, r.text
    assert sorted(fake_ls.seen) == [("/data/upload/3/a.png", f"Token {LS_TOKEN}"),
                                    ("/data/upload/3/b.png", f"Token {LS_TOKEN}")]
    # a cloud storage URI: read through Label Studio's resolver for its task
    fake_ls.seen.clear()
    r = predict(client, sid, ["s3://bucket/dir/c.png"])
    assert r.status_code == 200, r.text
    fileuri = base64.urlsafe_b64encode(b"s3://bucket/dir/c.png").decode()
    assert fake_ls.seen == [(f"/tasks/100/resolve/?fileuri={fileuri}", f"Token {LS_TOKEN}")]
    # a personal access token (JWT) is exchanged for an access token first
    client.post(f"/v1/labelstudio/{sid}/setup", json={"project": "3.1712345678", "schema": CONFIG,
                                                      "hostname": fake_ls.url, "access_token": JWT})
    fake_ls.seen.clear()
    assert predict(client, sid, ["/data/upload/3/c.png"]).status_code == 200
    assert fake_ls.seen == [("/api/token/refresh/", None), ("/data/upload/3/c.png", "Bearer short-lived")]


def test_predict_splits_many_tasks_into_localize_requests(client, settings):
    sid = new_set(client)
    n = settings.max_files_per_request + 3
    imgs = [png_bytes(40 + k, 40, seed=k) for k in range(n)]
    r = predict(client, sid, [data_uri(b) for b in imgs])
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == n
    assert [p["result"][0]["original_width"] for p in results] == [40 + k for k in range(n)]


def test_predict_refuses_bad_input_with_a_message(client, fake_ls, tmp_path):
    sid = new_set(client)
    ok = data_uri(png_bytes(seed=1))
    closed = f"http://127.0.0.1:{free_port()}/a.png"
    cases = [
        ([ok], "<View/>", 422, "RectangleLabels"),
        ([ok], CONFIG.replace("Square", "Circle"), 422, "name the exemplar set like one of them"),
        ([closed], CONFIG, 422, "task 100: cannot fetch http://127.0.0.1"),
        ([ok, f"{fake_ls.url}/nothing.png"], CONFIG, 422, "task 101: GET"),
        (["ftp://host/a.png"], CONFIG, 422, "only http(s) URLs"),
        (["data:image/png;base64,!!!"], CONFIG, 422, "not valid base64"),
        (["data:nocomma"], CONFIG, 422, "comma"),
        ([data_uri(b"GIF89a" + b"0" * 20)], CONFIG, 415, "task 100"),
        ([data_uri(b"hello")], CONFIG, 415, "task 100"),
        ([data_uri(b"\x89PNG\r\n\x1a\n" + b"0" * 300_000)], CONFIG, 413, "larger than"),
        ([5], CONFIG, 422, "not a string"),
    ]
    for urls, config, code, words in cases:
        r = predict(client, sid, urls, config)  # type: ignore[arg-type]
        assert r.status_code == code and words in r.json()["detail"], (urls[0] if urls else None, r.text)
    r = client.post(f"/v1/labelstudio/{sid}/predict", json={"tasks": [{"id": 1, "data": {"image": ok}}],
                                                              "label_config": CONFIG})
    assert r.status_code == 422 and "has no data.picture" in r.json()["detail"]
    for body in ({"label_config": CONFIG}, {"tasks": "x", "label_config": CONFIG}, {"tasks": [1]}, []):
        assert client.post(f"/v1/labelstudio/{sid}/predict", json=body).status_code == 422
    unknown = "00000000-0000-0000-0000-000000000000"
    r = predict(client, unknown, [ok])
    assert r.status_code == 404 and r.json()["detail"] == "exemplar set not found"
    r = client.post(f"/v1/labelstudio/{sid}/predict", content=b"{not json",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422


# --- auth


def test_api_keys_as_label_studio_sends_them(keyed):
    sid = new_set(keyed, headers={"X-API-Key": KEY_A})
    ok = data_uri(png_bytes(seed=1))
    assert keyed.get(f"/v1/labelstudio/{sid}/health").status_code == 401
    assert predict(keyed, sid, [ok]).status_code == 401
    assert predict(keyed, sid, [ok], auth=("qloc", "wrong-key-0123456789")).status_code == 401
    # Label Studio's ML backend "Basic Auth": the key as the password (or as the user, without a password)
    assert predict(keyed, sid, [ok], auth=("labelstudio", KEY_A)).status_code == 200
    assert keyed.get(f"/v1/labelstudio/{sid}/health", auth=(KEY_A, "")).status_code == 200
    assert predict(keyed, sid, [ok], headers={"X-API-Key": KEY_A}).status_code == 200
    assert predict(keyed, sid, [ok], headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    # another key's set is not there
    assert predict(keyed, sid, [ok], auth=("labelstudio", KEY_B)).status_code == 404
    r = keyed.post(f"/v1/labelstudio/{sid}/webhook", json={"action": "START_TRAINING"}, auth=("x", KEY_B))
    assert r.status_code == 404


# --- webhook


def test_webhook_starts_one_job_on_the_projects_images(api, fake_ls):  # noqa: F811 -- SQLite, then PostgreSQL
    client = api
    sid = new_set(client)
    hook = f"/v1/labelstudio/{sid}/webhook"
    r = client.post(hook, json={"action": "ANNOTATION_CREATED", "project": {"id": 3}, "annotation": {"id": 1}})
    assert r.status_code == 200 and r.json()["status"] == "ignored"
    # Label Studio's address unknown and an empty pool: nothing to adapt on
    event = {"action": "START_TRAINING", "project": {"id": 3, "label_config": CONFIG}}
    r = client.post(hook, json=event)
    assert r.status_code == 422 and "pool is empty" in r.json()["detail"], r.text
    client.post(f"/v1/labelstudio/{sid}/setup", json={"project": "3.1712345678", "schema": CONFIG,
                                                      "hostname": fake_ls.url, "access_token": LS_TOKEN})
    r = client.post(hook, json=event)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "started" and body["source"] == "files" and body["num_images"] == len(IMAGES)
    assert any("task 99" in s for s in body["skipped"])  # its image is missing: skipped, not fatal
    job = client.get(f"/v1/adaptations/{body['job']}").json()
    assert job["status"] == "queued" and job["params"]["num_images"] == len(IMAGES)
    assert ("/api/tasks/?project=3&page_size=8&page=1", f"Token {LS_TOKEN}") in fake_ls.seen
    # asked again while it waits: the same job, no second one
    r = client.post(hook, json=event)
    assert r.status_code == 200 and r.json()["job"] == body["job"] and r.json()["status"] == "already queued"
    assert client.get(f"/v1/exemplar-sets/{sid}/adaptations").json()["count"] == 1
    assert client.post(hook, json={"project": {"id": 3}}).status_code == 422  # no action


def test_what_setup_gave_is_seen_by_every_api_process(api, db_settings, fake_ls):  # noqa: F811 -- both databases
    """/setup reaches one API process; /predict and the webhook reach another (the embedded default runs one per
    core): both see its max_instances, address and token (recorded in the database, per set and project). A later
    /setup replaces max_instances and keeps the address it does not give; deleting the set deletes the record."""
    sid = new_set(api)
    imgs = [png_bytes(seed=1), png_bytes(160, 100, seed=2)]
    other = create_app(db_settings)
    with TestClient(other) as second:
        assert predict(second, sid, [data_uri(b) for b in imgs]).json()["results"][0]["result"][0]["id"] == "qloc-0"
        r = api.post(f"/v1/labelstudio/{sid}/setup", json={
            "project": "3.1712345678", "schema": CONFIG, "hostname": fake_ls.url, "access_token": LS_TOKEN,
            "extra_params": {"max_instances": 3}})
        assert r.status_code == 200, r.text
        regions = [pred["result"] for pred in predict(second, sid, [data_uri(b) for b in imgs]).json()["results"]]
        assert all(reg["id"].count("-") == 2 for res in regions for reg in res) and any(regions), regions
        r = second.post(f"/v1/labelstudio/{sid}/webhook",
                        json={"action": "START_TRAINING", "project": {"id": 3, "label_config": CONFIG}})
        assert r.status_code == 201 and r.json()["source"] == "files", r.text
        assert ("/api/tasks/?project=3&page_size=8&page=1", f"Token {LS_TOKEN}") in fake_ls.seen
        # another project of the same set has no setup of its own
        r = second.post(f"/v1/labelstudio/{sid}/predict", json={
            "tasks": tasks_of([data_uri(imgs[0])]), "label_config": CONFIG, "project": "4.1712345678"})
        assert r.json()["results"][0]["result"][0]["id"] == "qloc-0", r.text
        r = api.post(f"/v1/labelstudio/{sid}/setup", json={"project": "3.1712345678", "schema": CONFIG})
        assert r.status_code == 200  # max_instances back to 1; the address and token it did not give are kept
        assert predict(second, sid, [data_uri(imgs[0])]).json()["results"][0]["result"][0]["id"] == "qloc-0"
        for bad in ({"hostname": "http://a\x00b"}, {"access_token": "t\x00"}, {"hostname": "http://" + "h" * 2050},
                    {"project": "3\x00.1"}, {"project": True}, {"project": 3.5}):
            r = api.post(f"/v1/labelstudio/{sid}/setup", json={"project": "3.1", "schema": CONFIG, **bad})
            assert r.status_code == 422, (bad, r.text)
        r = second.post(f"/v1/labelstudio/{sid}/predict", json={
            "tasks": tasks_of([data_uri(imgs[0])]), "label_config": CONFIG, "project": "3\x00"})
        assert r.status_code == 422 and "NUL" in r.text, r.text
        r = second.post(f"/v1/labelstudio/{sid}/webhook", json={"action": "START_TRAINING", "project": {"id": "3\x00"}})
        assert r.status_code == 422 and "NUL" in r.text, r.text
    job = api.get(f"/v1/exemplar-sets/{sid}/adaptations").json()["data"][0]
    api.post(f"/v1/adaptations/{job['id']}/cancel")
    engine = make_engine(db_settings.database_url)
    try:
        with Session(engine) as s:
            assert s.scalar(select(func.count()).select_from(LabelStudioSetup)) == 1
            s.execute(update(AdaptationJob).values(status="canceled"))  # no worker runs here: ended by hand
            s.commit()
        assert api.delete(f"/v1/exemplar-sets/{sid}").status_code == 204
        with Session(engine) as s:
            assert s.scalar(select(func.count()).select_from(LabelStudioSetup)) == 0
    finally:
        engine.dispose()
        other.state.engine.dispose()


def test_webhook_falls_back_on_the_pool(api):  # noqa: F811
    client = api
    sid = new_set(client)
    assert client.post(f"/v1/exemplar-sets/{sid}/images", files=files(png_bytes(seed=4))).status_code in (200, 201)
    r = client.post(f"/v1/labelstudio/{sid}/webhook", json={"action": "START_TRAINING", "project": {"id": 3}})
    assert r.status_code == 201, r.text
    assert r.json()["source"] == "pool" and r.json()["num_images"] == 1


def test_fetch_hosts_limit_task_urls_and_their_redirects_to_the_hosts_given(tmp_path, bundle_dir, fake_ls):
    """``QLOC_LABELSTUDIO_FETCH_HOSTS``: a task URL (or a redirect) to another host is refused before any request
    reaches it; Label Studio's own address and the hosts given are fetched."""
    import httpx

    from app.labelstudio import Access, ImageFetcher, Refused

    here = fake_ls.url.split("//", 1)[1]  # 127.0.0.1:<port>
    with ImageFetcher(Access(None, None), max_bytes=10**6, timeout=5, hosts=["example.invalid"]) as f:
        with pytest.raises(Refused, match="is not among QLOC_LABELSTUDIO_FETCH_HOSTS") as e:
            f.fetch(f"{fake_ls.url}/any/a.png", "task 1")
        assert e.value.status == 422 and fake_ls.seen == []
    with ImageFetcher(Access(None, None), max_bytes=10**6, timeout=5, hosts=[here]) as f:
        assert f.fetch(f"{fake_ls.url}/any/a.png", "task 1") == IMAGES["a.png"]
    with ImageFetcher(Access(fake_ls.url, None), max_bytes=10**6, timeout=5, hosts=[]) as f:  # Label Studio's own
        assert f.fetch("/data/upload/1/b.png", "task 2") == IMAGES["b.png"]
    # a redirect is a request too: an allowed host that redirects elsewhere is refused there
    transport_seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        transport_seen.append(str(request.url))
        return httpx.Response(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})

    f = ImageFetcher(Access(None, None), max_bytes=10**6, timeout=5, hosts=["allowed.example"])
    f._client = httpx.Client(transport=httpx.MockTransport(handler), follow_redirects=True,
                             event_hooks={"request": [f._allowed]})
    with f, pytest.raises(Refused, match="169.254.169.254"):
        f.fetch("http://allowed.example/a.png", "task 3")
    assert transport_seen == ["http://allowed.example/a.png"]
    settings = make_test_settings(tmp_path, bundle_dir, labelstudio_fetch_hosts="a.example, B.example:81")
    assert settings.labelstudio_fetch_hosts == ["a.example", "b.example:81"]
