"""``app.routes.labelstudio`` by value, without HTTP: which images of a Label Studio project a training webhook adapts
on (``_project_images``: every reason an image or the whole project is skipped, in its words), which unfinished job
of the set it answers instead (``_unfinished_job``), and the bodies of /setup, /predict and the webhook (``connect``,
``pre_annotate``, ``start_training``), on SQLite and PostgreSQL. The protocol through the app, against a fake Label
Studio: ``test_labelstudio.py``."""

from __future__ import annotations

import json
import logging
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import Response
from labelstudio_fake import FakeLabelStudio
from pydantic import ValidationError
from service_fixtures import (
    BundleCheck,
    RecordingQueue,
    make_test_settings,
    new_job,
    new_set,
    png_bytes,
    refusal,
    upload_file,
)
from sqlalchemy import select

from app.deps import Caller
from app.labelstudio import Access, Refused
from app.routes.labelstudio import (
    PredictRequest,
    SetupRequest,
    WebhookEvent,
    _project_images,
    _unfinished_job,
    connect,
    pre_annotate,
    start_training,
)
from app.routes.pool import add_to_pool
from app.routes.uploads import read_images
from app.tables import AdaptationJob, ExemplarSet, LabelStudioSetup

CONFIG = ('<View><Image name="i" value="$img"/><RectangleLabels name="l" toName="i"><Label value="x"/>'
          '</RectangleLabels></View>')
PNG = png_bytes(20, 16)


class Fetcher:
    """``ImageFetcher`` as ``_project_images`` uses it: ``access`` and ``fetch``, answered from ``answers`` (bytes, or
    a ``Refused`` to raise) by URL; every call recorded."""

    def __init__(self, answers: dict[str, bytes | Refused], url: str | None = "http://ls:8080"):
        self.access = Access(url, "token")
        self.answers = answers
        self.calls: list[tuple] = []

    def fetch(self, url: str, where: str, task_id: int | None = None) -> bytes:
        self.calls.append((url, where, task_id))
        answer = self.answers[url]
        if isinstance(answer, Refused):
            raise answer
        return answer


def listing(tasks: object, limit: int = 8) -> dict[str, bytes]:
    return {f"/api/tasks/?project=7&page_size={limit}&page=1": json.dumps(tasks).encode()}


SET = ExemplarSet(name="cats")


def test_a_project_it_cannot_list_gives_no_image_and_says_why():
    project = {"id": 7, "label_config": CONFIG}
    nothing = Fetcher({})
    assert _project_images(nothing, {"label_config": CONFIG}, SET, 8) == (
        [], ["the event names no Label Studio project"])
    assert _project_images(nothing, {"id": "seven"}, SET, 8) == ([], ["the event names no Label Studio project"])
    assert _project_images(Fetcher({}, url=None), project, SET, 8) == (
        [], ["Label Studio's address is unknown (no /setup of this project gave it; set QLOC_LABELSTUDIO_URL)"])
    assert _project_images(nothing, {"id": 7, "label_config": "<View/>"}, SET, 8)[1] == [
        "label_config has no <RectangleLabels> tag whose toName is an <Image>: qloc predicts bounding boxes, e.g. "
        '<Image name="image" value="$image"/> <RectangleLabels name="label" toName="image"><Label value="object"/>'
        "</RectangleLabels>"]
    assert nothing.calls == []  # nothing asked of Label Studio for any of these
    refused = Fetcher({"/api/tasks/?project=7&page_size=8&page=1": Refused(422, "the task list: 403 Forbidden")})
    assert _project_images(refused, project, SET, 8) == ([], ["the task list: 403 Forbidden"])
    assert refused.calls == [("/api/tasks/?project=7&page_size=8&page=1", "the task list of Label Studio project 7",
                              None)]
    garbled = Fetcher({"/api/tasks/?project=7&page_size=8&page=1": b"<html>"})
    assert _project_images(garbled, project, SET, 8) == ([], ["the task list of Label Studio project 7 is not JSON"])


def test_each_task_is_read_or_skipped_with_its_reason_up_to_the_limit():
    tasks = [
        {"id": 1, "data": {"img": "/data/1.png"}},
        {"id": 2, "data": {"image": "/data/2.png"}},  # another key than the config's $img
        "not a task",
        {"id": "abc", "data": {"img": "/data/3.png"}},  # refused by the fetcher
        {"data": {"img": "/data/4.png"}},  # not an image
        {"id": 5, "data": "/data/5.png"},
        {"id": 6, "data": {"img": "/data/6.png"}},
        {"id": 7, "data": {"img": "/data/7.png"}},  # past the limit: not read
    ]
    fetcher = Fetcher({**listing({"tasks": tasks}, limit=7), "/data/1.png": PNG,
                       "/data/3.png": Refused(422, "task abc: 404 Not Found"), "/data/4.png": b"GIF89a....",
                       "/data/6.png": PNG})
    uploads, problems = _project_images(fetcher, {"id": "7.1", "label_config": CONFIG}, SET, 7)
    assert [(u.filename, u.file.read()) for u in uploads] == [("task 1", PNG), ("task 6", PNG)]
    assert problems == ["task 2 has no data.img", "task #3 has no data.img", "task abc: 404 Not Found",
                        "task #5: GIF format; only PNG, JPEG or WebP images are accepted: convert it to one of them "
                        "first", "task 5 has no data.img"]
    assert [c[1:] for c in fetcher.calls[1:]] == [("task 1", 1), ("task abc", None), ("task #5", None),
                                                  ("task 6", 6)]
    as_a_list = Fetcher({**listing(tasks[:1], limit=1), "/data/1.png": PNG})  # the older API: a bare list
    assert [u.filename for u in _project_images(as_a_list, {"id": 7, "label_config": CONFIG}, SET, 1)[0]] == [
        "task 1"]
    neither = Fetcher(listing({"count": 0}))
    assert _project_images(neither, {"id": 7, "label_config": CONFIG}, SET, 8) == ([], [])
    not_a_list = Fetcher(listing({"tasks": "abc"}))
    assert _project_images(not_a_list, {"id": 7, "label_config": CONFIG}, SET, 8) == ([], [])
    long_id = "x" * 45  # named by its first 40 characters
    named = Fetcher({**listing([{"id": long_id, "data": {"img": "/data/1.png"}}], limit=1), "/data/1.png": PNG})
    assert [u.filename for u in _project_images(named, {"id": 7, "label_config": CONFIG}, SET, 1)[0]] == [
        "task " + "x" * 40]


def test_the_unfinished_job_answered_is_the_sets_latest(db):
    one, other = new_set(db), new_set(db)
    t0 = datetime(2026, 12, 7, 9, tzinfo=UTC)
    others = new_job(db, other, status="running", created_at=t0 + timedelta(hours=2))  # never this set's
    assert _in(db, one) is None
    new_job(db, one, status="succeeded", created_at=t0 + timedelta(hours=3))  # finished: not answered
    new_job(db, one, status="running", created_at=t0)
    newer = new_job(db, one, status="queued", created_at=t0 + timedelta(hours=1))
    assert _in(db, one) == newer
    assert _in(db, other) == others


def _in(db, set_id: uuid.UUID) -> uuid.UUID | None:  # type: ignore[no-untyped-def]
    with db() as s:
        job = _unfinished_job(s, set_id)
        return None if job is None else job.id


# --- /setup, /predict and the training webhook's bodies (``connect``, ``pre_annotate``, ``start_training``) by value:
# every answer and refusal whole, the record /setup leaves, what is asked of Label Studio. Nothing here localizes
# (``pre_annotate``'s answers through the engine: ``test_labelstudio.py``); a job's queue and bundle check are
# stand-ins, its rows and files real.

OWNER = Caller("k")
LS_CONFIG = ('<View><Image name="i" value="$picture"/><RectangleLabels name="l" toName="i"><Label value="x"/>'
             '</RectangleLabels></View>')  # the fake Label Studio's tasks hold their image as data.picture


@pytest.fixture
def settings(tmp_path, bundle_dir):  # type: ignore[no-untyped-def]
    return make_test_settings(tmp_path, bundle_dir)


def active_checkpoint(db, set_id: uuid.UUID) -> str:  # type: ignore[no-untyped-def]
    with db() as s:
        return str(s.get_one(ExemplarSet, set_id).active_checkpoint_id)


def setup_row(db, set_id: uuid.UUID, project: str) -> tuple | None:  # type: ignore[no-untyped-def]
    with db() as s:
        row = s.get(LabelStudioSetup, (set_id, project))
        return None if row is None else (row.url, row.token, row.max_instances)


def test_setup_records_the_address_token_and_instances_it_was_given(db, caplog):
    set_id = new_set(db)
    version = {"model_version": active_checkpoint(db, set_id)}

    def setup(project: str, **body: object) -> dict:
        with db() as s:
            return connect(set_id, SetupRequest(project=project, schema=CONFIG, **body), s, OWNER)

    assert setup("1", hostname="http://ls:8080/", access_token="tok", extra_params={"max_instances": 3}) == version
    assert setup_row(db, set_id, "1") == ("http://ls:8080", "tok", 3)  # the trailing slash stripped
    assert setup("2", hostname="https://ls.example//") == version
    assert setup_row(db, set_id, "2") == ("https://ls.example", None, 1)
    with caplog.at_level(logging.WARNING, logger="app.routes.labelstudio"):
        assert setup("3", hostname="ls.example:8080", access_token="") == version  # no scheme: not an address
    assert setup_row(db, set_id, "3") == (None, None, 1)  # an empty token is none
    assert [r.getMessage() for r in caplog.records] == [
        f"Label Studio /setup for set {set_id}: hostname 'ls.example:8080' is not an http(s) URL; its task images on "
        "Label Studio's paths cannot be fetched (set LABEL_STUDIO_HOST with http://, or QLOC_LABELSTUDIO_URL)"]
    with db() as s:
        assert refusal(connect, set_id, SetupRequest(project="4", schema=CONFIG, hostname="http://l\x00s"), s,
                       OWNER) == (422, "hostname contains a NUL byte (\\x00); remove it")
        assert refusal(connect, set_id, SetupRequest(project="4", schema=CONFIG, access_token="t\x00k"), s,
                       OWNER) == (422, "access_token contains a NUL byte (\\x00); remove it")
    assert setup_row(db, set_id, "4") is None


def predict_body(tasks: list[dict], **body: object) -> PredictRequest:
    return PredictRequest(tasks=tasks, label_config=CONFIG, project="1", **body)


def annotate(db, settings, set_id: uuid.UUID, body: PredictRequest) -> dict:  # type: ignore[no-untyped-def]
    """``pre_annotate`` with no engine: what it answers or refuses before any image is localized."""
    with db() as s:
        return pre_annotate(set_id, body, s, settings, None, OWNER, None, None, None, local=True,  # type: ignore[arg-type]
                            turns=None)


def test_predict_without_tasks_answers_the_active_checkpoint_and_a_task_without_its_image_is_named(db, settings):
    set_id = new_set(db)
    assert annotate(db, settings, set_id, predict_body([])) == {
        "results": [], "model_version": active_checkpoint(db, set_id)}
    tasks = [{"id": 5, "data": {"img": "data:,"}}, {"data": {"picture": "/data/1.png"}}]
    assert refusal(annotate, db, settings, set_id, predict_body(tasks)) == (
        422, 'task #2 has no data.img (the image of <Image value="$img"> in the label config)')
    assert refusal(annotate, db, settings, set_id, PredictRequest(tasks=[])) == (422, (
        "the labeling config is empty (/setup's `schema`, a task's `label_config`): Label Studio sends the project's; "
        "it needs a <RectangleLabels> tag on an <Image>"))
    with pytest.raises(ValidationError) as e:
        PredictRequest(tasks=[], project="1\x002")
    assert [err["msg"] for err in e.value.errors()] == ["Value error, project contains a NUL byte (\\x00); remove it"]


def test_predict_fetches_within_the_hosts_and_the_time_it_is_given(db, tmp_path, bundle_dir, fake_ls):
    set_id = new_set(db)
    hosts = make_test_settings(tmp_path, bundle_dir, labelstudio_fetch_hosts="example.invalid")
    task = [{"id": 1, "data": {"img": f"{fake_ls.url}/a.png"}}]
    assert refusal(annotate, db, hosts, set_id, predict_body(task)) == (422, (
        f"task 1: {fake_ls.url}/a.png: {fake_ls.url} is not among QLOC_LABELSTUDIO_FETCH_HOSTS (the hosts task "
        "images may come from, besides Label Studio's own address)"))
    assert fake_ls.seen == []  # refused before any request
    quick = make_test_settings(tmp_path, bundle_dir, labelstudio_fetch_timeout=0.3)
    slow = [{"id": 2, "data": {"img": f"{fake_ls.url}/slow/a.png"}}]  # answers after 2 s
    assert refusal(annotate, db, quick, set_id, predict_body(slow)) == (
        422, f"task 2: {fake_ls.url}/slow/a.png did not answer within 0.3 s")


def train(db, settings, store, set_id: uuid.UUID, event: dict, queue: RecordingQueue | None = None  # type: ignore[no-untyped-def]
          ) -> tuple[dict, Response]:
    """``start_training`` on ``event`` -> (its answer, the response it set)."""
    response = Response()
    with db() as s:
        answer = start_training(set_id, WebhookEvent(**event), response, s, settings, store, queue or RecordingQueue(),
                                None, OWNER, BundleCheck())  # type: ignore[arg-type]
    return answer, response


def test_the_webhook_ignores_other_events_and_answers_the_unfinished_job(db, settings, store):
    set_id = new_set(db)
    assert train(db, settings, store, set_id, {"action": "ANNOTATION_CREATED", "project": 3})[0] == {
        "status": "ignored", "action": "ANNOTATION_CREATED"}
    job = new_job(db, set_id, status="running")
    assert train(db, settings, store, set_id, {"action": "START_TRAINING", "project": 3})[0] == {
        "status": "already running", "job": str(job), "job_status": "running"}


def test_the_webhook_with_no_image_to_adapt_on_says_why(db, tmp_path, bundle_dir, store):
    set_id = new_set(db)
    unknown = make_test_settings(tmp_path, bundle_dir)
    assert refusal(train, db, unknown, store, set_id, {"action": "START_TRAINING", "project": 3}) == (422, (
        "no image to adapt on: the project's images could not be read (Label Studio's address is unknown (no /setup "
        "of this project gave it; set QLOC_LABELSTUDIO_URL)) and the set's image pool is empty"))
    with FakeLabelStudio({f"{k}.png": b"not an image" for k in range(4)}) as ls:  # and task 99's image is missing
        known = make_test_settings(tmp_path, bundle_dir, labelstudio_url=ls.url)
        # the project as its id: the event holds no label config, so its images cannot be named
        assert refusal(train, db, known, store, set_id, {"action": "START_TRAINING", "project": 3}) == (422, (
            "no image to adapt on: the project's images could not be read (the labeling config is empty (/setup's "
            "`schema`, a task's `label_config`): Label Studio sends the project's; it needs a <RectangleLabels> tag on "
            "an <Image>) and the set's image pool is empty"))
        event = {"action": "START_TRAINING", "project": {"id": 3, "label_config": LS_CONFIG}}
        not_an_image = "not a PNG, JPEG or WebP image"
        assert refusal(train, db, known, store, set_id, event) == (422, (  # the first three of five reasons
            f"no image to adapt on: the project's images could not be read (task 1: {not_an_image}; task 2: "
            f"{not_an_image}; task 3: {not_an_image}) and the set's image pool is empty"))
    with db() as s:
        assert s.scalars(select(AdaptationJob).where(AdaptationJob.exemplar_set_id == set_id)).all() == []


def test_the_webhook_starts_a_job_on_the_projects_images_and_the_pool(db, tmp_path, bundle_dir, store, fake_ls):
    set_id = new_set(db)
    settings = make_test_settings(tmp_path, bundle_dir, labelstudio_url=fake_ls.url, labelstudio_api_key="ls-tok")
    with db() as s:
        add_to_pool(s, store, settings, s.get_one(ExemplarSet, set_id), read_images([upload_file(PNG)], settings))
    queue = RecordingQueue()
    event = {"action": "START_TRAINING", "project": {"id": 3, "label_config": LS_CONFIG}}
    answer, response = train(db, settings, store, set_id, event, queue)
    job = uuid.UUID(answer["job"])
    missing = f"task 99: GET {fake_ls.url}/data/upload/3/missing.png answered 404"
    assert answer == {"status": "started", "job": str(job), "job_status": "queued", "source": "both",
                      "num_images": 4, "skipped": [missing]}
    assert (response.status_code, response.headers["Location"]) == (201, f"/v1/adaptations/{job}")
    assert queue.sent == [job]
    with db() as s:
        row = s.get_one(AdaptationJob, job)
        assert (row.activate, row.num_images, row.num_pool_images) == ("auto", 4, 1)
    assert ("/api/tasks/?project=3&page_size=8&page=1", "Token ls-tok") in fake_ls.seen


def test_the_webhook_lists_at_most_twenty_skipped_images(db, tmp_path, bundle_dir, store):
    set_id = new_set(db)
    images = {f"{k:02d}.png": b"junk" for k in range(23)} | {"ok.png": PNG}
    with FakeLabelStudio(images) as ls:
        settings = make_test_settings(tmp_path, bundle_dir, labelstudio_url=ls.url, max_files_per_request=32)
        answer, _ = train(db, settings, store, set_id, {"action": "START_TRAINING",
                                                          "project": {"id": 3, "label_config": LS_CONFIG}})
    assert answer["source"] == "files" and answer["num_images"] == 1  # no pool
    assert len(answer["skipped"]) == 20 and answer["skipped"][0].startswith("task 1: ")
