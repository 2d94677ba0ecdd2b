"""``app.routes.labelstudio``'s helpers by value, without HTTP: which images of a Label Studio project a training
webhook adapts on (``_project_images``: every reason an image or the whole project is skipped, in its words) and
which unfinished job of the set it answers instead (``_unfinished_job``, on SQLite and PostgreSQL). The protocol
through the app, against a fake Label Studio: ``test_labelstudio.py``."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

from service_fixtures import new_job, new_set, png_bytes

from app.labelstudio import Access, Refused
from app.routes.labelstudio import _project_images, _unfinished_job
from app.tables import ExemplarSet

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
