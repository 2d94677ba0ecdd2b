"""``app.client.QlocClient`` by value over a scripted transport (``httpx.MockTransport``): each method's request
(method, path, query, form, headers), the retry policy (what is retried after a 503 or a lost connection, how long it
waits, which key a job creation carries), the errors raised, and ``wait``'s polling. The round trips through the real
API are ``test_app_client.py``'s; these need no server and pin what a mutant of the client would change."""

from __future__ import annotations

import email.utils
import json
import urllib.parse
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import numpy as np
import pytest

from app.client import CREATE_SET_TIMEOUT, KEPT_HEADER, QlocClient, QlocError, describe_detail
from app.client_models import AdaptationJob, Checkpoint, ExemplarSet

SET = "5e7a0000-0000-4000-8000-000000000001"  # fixed: parametrized test ids must be the same on every xdist worker
JOB = "70b00000-0000-4000-8000-000000000002"
CKPT = "c4e00000-0000-4000-8000-000000000003"
NOW = "2026-01-01T00:00:00Z"
SET_BODY = {"id": SET, "name": "fours", "num_exemplars": 2, "num_labeled": 0, "bundle": "b", "bundle_sha256": None,
            "active_checkpoint_id": CKPT, "created_at": NOW}
JOB_BODY = {"id": JOB, "exemplar_set_id": SET, "status": "queued", "checkpoint_id": None, "error": None,
            "progress": {"iteration": 0, "total": 10, "mean_reward": None},
            "params": {"iterations": 10, "learning_rate": 0.001, "seed": 0, "activate": "auto", "num_images": 1,
                       "base_checkpoint_id": CKPT},
            "verdict": None, "validation": None, "attempts": 0, "cancel_requested": False, "created_at": NOW,
            "started_at": None, "finished_at": None}
CKPT_BODY = {"id": CKPT, "exemplar_set_id": SET, "parent_id": None, "job_id": None, "kind": "base", "iteration": 0,
             "sha256": "s", "metrics": {}, "active": True, "created_at": NOW}
LOCALIZE_BODY = {"exemplar_set_id": SET, "checkpoint_id": CKPT, "bundle": "b", "samples": 0, "nearest": False,
                 "results": [{"filename": "image0.png", "width": 8, "height": 8, "box": [0, 0, 4, 4], "score": 1.0}]}
PAGE = {"count": 0, "limit": 5, "offset": 10, "data": []}
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


class Server:
    """A scripted API: answers in order (a callable, a response, or an exception to raise), every request kept."""

    def __init__(self, *answers):  # noqa: ANN002
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer(request) if callable(answer) else answer

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]


def client(server: Server, **kw) -> tuple[QlocClient, list[float]]:  # noqa: ANN003
    waits: list[float] = []
    http = httpx.Client(base_url="http://qloc.test", transport=httpx.MockTransport(server))
    return QlocClient(http_client=http, sleep=waits.append, **kw), waits


def ok(body, status: int = 200, **headers) -> httpx.Response:  # noqa: ANN001, ANN003
    return httpx.Response(status, json=body, headers=headers)


def form(request: httpx.Request) -> dict[str, list[str]]:
    """The multipart form's text fields, and each file field's filenames."""
    ctype = request.headers["content-type"]
    if ctype == "application/x-www-form-urlencoded":  # a form without files
        return urllib.parse.parse_qs(request.content.decode())
    boundary = ctype.split("boundary=")[1].encode()
    fields: dict[str, list[str]] = {}
    for part in request.content.split(b"--" + boundary)[1:-1]:
        head, _, body = part.partition(b"\r\n\r\n")
        disposition = next(line for line in head.decode().split("\r\n") if line.startswith("Content-Disposition"))
        name = disposition.split('name="')[1].split('"')[0]
        value = disposition.split('filename="')[1].split('"')[0] if "filename=" in disposition else body[:-2].decode()
        fields.setdefault(name, []).append(value)
    return fields


def test_each_read_asks_its_path_with_the_key_and_json():
    server = Server(ok(SET_BODY))
    qloc, _ = client(server, api_key="k" * 16)
    es = qloc.get_exemplar_set(SET)
    assert (server.last.method, server.last.url.path) == ("GET", f"/v1/exemplar-sets/{SET}")
    assert server.last.headers["X-API-Key"] == "k" * 16 and server.last.headers["Accept"] == "application/json"
    assert isinstance(es, ExemplarSet) and str(es.id) == SET
    qloc.get_exemplar_set(es)  # the client's own model names its id
    assert server.last.url.path == f"/v1/exemplar-sets/{SET}"
    keyless = Server(ok(SET_BODY))
    client(keyless)[0].get_exemplar_set(uuid.UUID(SET))
    assert "X-API-Key" not in keyless.last.headers


@pytest.mark.parametrize(("call", "path"), [
    (lambda q: q.list_exemplar_sets(limit=5, offset=10), "/v1/exemplar-sets"),
    (lambda q: q.list_adaptations(SET, limit=5, offset=10), f"/v1/exemplar-sets/{SET}/adaptations"),
    (lambda q: q.list_checkpoints(SET, limit=5, offset=10), f"/v1/exemplar-sets/{SET}/checkpoints"),
], ids=["sets", "adaptations", "checkpoints"])
def test_listings_page_by_limit_and_offset(call, path):
    server = Server(ok(PAGE))
    qloc, _ = client(server)
    page = call(qloc)
    assert server.last.method == "GET" and server.last.url.path == path
    assert dict(server.last.url.params) == {"limit": "5", "offset": "10"} and page.count == 0


def test_the_pool_routes():
    pool = {**PAGE, "num_pool_images": 0, "pool_bytes": 0, "max_pool_images": 10, "max_pool_bytes": 100}
    server = Server(ok(pool))
    qloc, _ = client(server)
    qloc.list_pool_images(SET, limit=5, offset=10)
    assert server.last.url.path == f"/v1/exemplar-sets/{SET}/images"
    assert dict(server.last.url.params) == {"limit": "5", "offset": "10"}
    qloc.add_pool_images(SET, [PNG, PNG])
    assert (server.last.method, server.last.url.path) == ("POST", f"/v1/exemplar-sets/{SET}/images")
    assert form(server.last) == {"files": ["image0.png", "image1.png"]}
    server.answers = [httpx.Response(204)]
    image = str(uuid.uuid4())
    qloc.delete_pool_image(SET, image)
    assert (server.last.method, server.last.url.path) == ("DELETE", f"/v1/exemplar-sets/{SET}/images/{image}")
    qloc.clear_pool(SET)
    assert (server.last.method, server.last.url.path) == ("DELETE", f"/v1/exemplar-sets/{SET}/images")


def test_checkpoint_routes():
    server = Server(ok(CKPT_BODY))
    qloc, _ = client(server)
    ckpt = qloc.get_checkpoint(CKPT)
    assert isinstance(ckpt, Checkpoint) and server.last.url.path == f"/v1/checkpoints/{CKPT}"
    server.answers = [ok(SET_BODY)]
    assert isinstance(qloc.activate_checkpoint(ckpt), ExemplarSet)
    assert (server.last.method, server.last.url.path) == ("POST", f"/v1/checkpoints/{CKPT}/activate")
    server.answers = [httpx.Response(204)]
    qloc.delete_checkpoint(ckpt)
    assert (server.last.method, server.last.url.path) == ("DELETE", f"/v1/checkpoints/{CKPT}")
    qloc.delete_exemplar_set(SET)
    assert (server.last.method, server.last.url.path) == ("DELETE", f"/v1/exemplar-sets/{SET}")


def test_a_new_set_sends_its_form_and_waits_long_for_its_answer():
    server = Server(ok(SET_BODY, 201))
    qloc, _ = client(server)
    qloc.create_exemplar_set([PNG, PNG], name="fours", bundle="b", boxes=[(1, 2, 3, 4), [5, 6, 7.5, 8]],
                             negatives=PNG, threshold=0.25)
    r = server.last
    assert (r.method, r.url.path) == ("POST", "/v1/exemplar-sets")
    assert form(r) == {"name": ["fours"], "bundle": ["b"], "boxes": ["[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.5, 8.0]]"],
                       "threshold": ["0.25"], "files": ["image0.png", "image1.png"], "negative_files": ["image0.png"]}
    assert r.extensions["timeout"]["read"] == CREATE_SET_TIMEOUT == 900.0  # the client's 5 s is not enough
    qloc.create_exemplar_set(PNG)  # nothing optional: no empty fields
    assert form(server.last) == {"files": ["image0.png"]}
    for timeout, read in ((2000.0, 2000.0), (None, None)):  # a longer client timeout, or none, as it is
        server = Server(ok(SET_BODY, 201))
        qloc, _ = client(server)
        qloc.http.timeout = httpx.Timeout(timeout)
        qloc.create_exemplar_set(PNG)
        assert server.last.extensions["timeout"]["read"] == read


def test_a_set_is_changed_by_json_and_a_non_finite_threshold_is_refused_here():
    server = Server(httpx.ReadError("lost"), ok(SET_BODY))
    qloc, waits = client(server)
    qloc.update_exemplar_set(SET, name=None, threshold=0.75)
    assert [r.method for r in server.requests] == ["PATCH", "PATCH"] and waits == [0.5]  # the same change: retried
    assert json.loads(server.last.content) == {"name": None, "threshold": 0.75}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="threshold must be a finite number in"):
            qloc.update_exemplar_set(SET, threshold=bad)
    assert len(server.requests) == 2


def test_localize_sends_only_what_it_was_given():
    server = Server(ok(LOCALIZE_BODY))
    qloc, _ = client(server)
    answer = qloc.localize(SET, PNG)
    assert (server.last.method, server.last.url.path) == ("POST", f"/v1/exemplar-sets/{SET}/localize")
    assert dict(server.last.url.params) == {"checkpoint": "active"} and form(server.last) == {"files": ["image0.png"]}
    assert answer.results[0].box == [0, 0, 4, 4]
    ckpt = Checkpoint.model_validate(CKPT_BODY)
    qloc.localize(SET, [PNG, PNG], checkpoint=ckpt, trajectory=True, samples=3, nearest=False, keep=False,
                  max_instances=2, min_confidence=0.4, rerank="false", flag=True)
    assert dict(server.last.url.params) == {
        "checkpoint": CKPT, "trajectory": "true", "samples": "3", "nearest": "false", "keep": "false",
        "max_instances": "2", "min_confidence": "0.4", "rerank": "false", "flag": "true"}
    with pytest.raises(ValueError, match=r"^format='coco' answers an export, not a LocalizeResponse: call "
                                         r"QlocClient\.export$"):
        qloc.localize(SET, PNG, format="coco")
    assert len(server.requests) == 2


def test_localize_is_retried_after_a_lost_answer_unless_it_keeps_the_images():
    server = Server(httpx.ReadError("lost"), ok(LOCALIZE_BODY))
    qloc, _ = client(server)
    qloc.localize(SET, PNG)
    assert len(server.requests) == 2  # nothing is written: safe to send again
    server = Server(httpx.ReadError("lost"), ok(LOCALIZE_BODY))
    qloc, _ = client(server)
    with pytest.raises(QlocError, match="the server may have done it all the same: look before you retry"):
        qloc.localize(SET, PNG, keep=True)
    assert len(server.requests) == 1 and dict(server.last.url.params)["keep"] == "true"


def test_export_answers_the_servers_json_and_the_kept_ids():
    coco = {"images": [], "categories": [], "annotations": []}
    server = Server(ok(coco, **{KEPT_HEADER: "a,,b"}))
    qloc, _ = client(server)
    export = qloc.export(SET, PNG, keep=True, image_ids="7")
    assert dict(server.last.url.params) == {"checkpoint": "active", "keep": "true", "format": "coco",
                                            "image_ids": "7"}  # no trajectory: exports refuse it
    assert (export.format, export.data, export.kept) == ("coco", coco, ["a", "b"])
    server.answers = [ok([])]
    export = qloc.export(SET, PNG, format="labelstudio")
    assert dict(server.last.url.params)["format"] == "labelstudio" and export.kept is None and export.data == []


def test_a_job_carries_an_idempotency_key_and_its_form():
    server = Server(ok(JOB_BODY, 202))
    qloc, _ = client(server)
    job = qloc.create_adaptation(SET, [PNG], iterations=10, learning_rate=0.01, seed=4, activate=True)
    r = server.last
    assert (r.method, r.url.path) == ("POST", f"/v1/exemplar-sets/{SET}/adaptations")
    assert form(r) == {"iterations": ["10"], "learning_rate": ["0.01"], "seed": ["4"], "activate": ["true"],
                       "files": ["image0.png"]}
    assert uuid.UUID(r.headers["Idempotency-Key"]).version == 4 and isinstance(job, AdaptationJob)
    qloc.create_adaptation(SET, activate=False)  # no images: the pool, said
    assert form(server.last) == {"source": ["pool"], "activate": ["false"]}
    assert server.last.headers["Idempotency-Key"] != r.headers["Idempotency-Key"]  # a new job, a new key
    qloc.create_adaptation(SET, [PNG], source="both", idempotency_key="mine")
    assert form(server.last)["source"] == ["both"] and form(server.last)["activate"] == ["auto"]
    assert server.last.headers["Idempotency-Key"] == "mine"


def test_a_job_creation_retried_after_a_lost_answer_keeps_its_key_and_after_a_503_takes_a_new_one():
    server = Server(httpx.ReadError("lost"), httpx.Response(503, json={"detail": "queue down"}), ok(JOB_BODY, 202))
    qloc, waits = client(server)
    qloc.create_adaptation(SET, PNG)
    keys = [r.headers["Idempotency-Key"] for r in server.requests]
    assert len(keys) == 3 and keys[0] == keys[1] != keys[2]  # the same request again; after a 503 (a failed job) anew
    assert uuid.UUID(keys[2]).version == 4
    assert waits == [0.5, 1.0]
    server = Server(httpx.Response(503, json={"detail": "queue down"}))
    qloc, waits = client(server)
    with pytest.raises(QlocError) as e:
        qloc.create_adaptation(SET, PNG, idempotency_key="mine")  # a key of the caller's is never reused on a 503
    assert e.value.status == 503 and len(server.requests) == 1 and waits == []


def test_cancel_and_get_a_job():
    server = Server(ok(JOB_BODY, 202))
    qloc, _ = client(server)
    job = qloc.cancel_adaptation(JOB)
    assert (server.last.method, server.last.url.path) == ("POST", f"/v1/adaptations/{JOB}/cancel")
    server.answers = [ok(JOB_BODY)]
    qloc.get_adaptation(job)
    assert (server.last.method, server.last.url.path) == ("GET", f"/v1/adaptations/{JOB}")


def test_wait_polls_until_the_job_ends_and_says_how_far_it_got(capsys):
    running = {**JOB_BODY, "status": "running", "progress": {"iteration": 5, "total": 10, "mean_reward": 0.5}}
    done = {**JOB_BODY, "status": "succeeded", "verdict": "improved",
            "progress": {"iteration": 10, "total": 10, "mean_reward": 0.75}}
    server = Server(ok(JOB_BODY), ok(running), ok(done))
    qloc, waits = client(server)
    seen = []
    job = qloc.wait(JOB, poll=0.25, progress=False, on_update=lambda j: seen.append(j.status))
    assert job.status == "succeeded" and seen == ["queued", "running", "succeeded"] and waits == [0.25, 0.25]
    assert capsys.readouterr().err == ""  # no bar asked for
    server = Server(ok(running))
    qloc, waits = client(server)
    with pytest.raises(TimeoutError, match=f"job {JOB} still running after 0s"):
        qloc.wait(AdaptationJob.model_validate(running), timeout=0, progress=False)
    assert server.requests == [] and waits == []  # the job given: not read again before the deadline
    server = Server(ok(done))
    qloc, _ = client(server)
    qloc.wait(AdaptationJob.model_validate(running), poll=0, progress=True)
    assert "running reward 0.5000" in capsys.readouterr().err


def test_errors_carry_the_status_and_the_detail():
    cases = [(httpx.Response(404, json={"detail": "exemplar set not found"}), "exemplar set not found",
              "HTTP 404: exemplar set not found"),
             (httpx.Response(422, json={"detail": [{"loc": ["query", "samples"], "msg": "too big"},
                                                   {"loc": ["body"], "msg": "no file"}]}),
              [{"loc": ["query", "samples"], "msg": "too big"}, {"loc": ["body"], "msg": "no file"}],
              "HTTP 422: samples: too big; no file"),
             (httpx.Response(400, json=["odd"]), ["odd"], "HTTP 400: odd"),
             (httpx.Response(409, json={"other": 1}), {"other": 1}, "HTTP 409: {'other': 1}"),
             (httpx.Response(500, text="  " + "x" * 600), "x" * 500, "HTTP 500: " + "x" * 500),
             (httpx.Response(502, text=""), "Bad Gateway", "HTTP 502: Bad Gateway")]
    for response, detail, message in cases:
        qloc, waits = client(Server(response))
        with pytest.raises(QlocError) as e:
            qloc.get_exemplar_set(SET)
        assert (e.value.status, e.value.detail) == (response.status_code, detail)
        assert str(e.value) == f"GET http://qloc.test/v1/exemplar-sets/{SET}: {message}"
        assert e.value.method == "GET" and e.value.response is not None and waits == []


def test_describe_detail():
    assert describe_detail("plain") == "plain"
    assert describe_detail([{"loc": ["body", "files", 0], "msg": "bad"}, "text", {"msg": "no loc"}]) == (
        "files.0: bad; text; no loc")
    assert describe_detail([{"loc": ["path", "set_id"]}]) == "path.set_id: {'loc': ['path', 'set_id']}"
    assert describe_detail(7) == "7"
    assert str(QlocError(None, "cannot connect")) == "cannot connect"


def test_a_503_is_retried_after_what_the_server_says_else_a_doubling_wait_up_to_the_most():
    later = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=100), usegmt=True)
    server = Server(ok({"detail": "busy"}, 503, **{"Retry-After": "1.5"}),
                    ok({"detail": "busy"}, 503, **{"Retry-After": later}),
                    ok({"detail": "busy"}, 503, **{"Retry-After": "soon"}),
                    ok({"detail": "busy"}, 503, **{"Retry-After": "-3"}),
                    ok({"detail": "busy"}, 503), ok({"status": "ok"}))
    qloc, waits = client(server, retries=5, backoff=1.0, max_wait=30.0)
    assert qloc.health() == {"status": "ok"} and len(server.requests) == 6
    assert waits[0] == 1.5 and 25 <= waits[1] <= 30.0  # a date 100 s ahead, capped at max_wait
    assert waits[2:] == [4.0, 0.0, 16.0]  # unreadable: the backoff (1 x 2^2); negative: none; then 1 x 2^4
    server = Server(ok({"detail": "busy"}, 503))
    qloc, waits = client(server, retries=2, backoff=0.5)
    with pytest.raises(QlocError) as e:
        qloc.bundles()
    assert e.value.status == 503 and len(server.requests) == 3 and waits == [0.5, 1.0]


def test_a_date_without_a_zone_is_read_as_utc():
    when = (datetime.now(UTC) + timedelta(seconds=60)).strftime("%a, %d %b %Y %H:%M:%S")  # no zone at all
    server = Server(ok({}, 503, **{"Retry-After": when}), ok({"status": "ok"}))
    qloc, waits = client(server, max_wait=100.0)
    qloc.health()
    assert 50 <= waits[0] <= 60


def test_readiness_answers_its_503_without_retrying():
    server = Server(ok({"status": "unavailable", "checks": {"database": "error: x"}}, 503))
    qloc, waits = client(server)
    assert qloc.ready()["status"] == "unavailable" and len(server.requests) == 1 and waits == []
    assert (server.last.method, server.last.url.path) == ("GET", "/readyz")


def test_lost_connections_reads_are_retried_writes_are_not():
    for error in (httpx.ReadError("x"), httpx.ReadTimeout("x"), httpx.RemoteProtocolError("x"), httpx.WriteError("x")):
        server = Server(error, ok({"status": "ok"}))
        qloc, waits = client(server)
        assert qloc.health() == {"status": "ok"} and waits == [0.5], error
        server = Server(error)
        qloc, waits = client(server)
        with pytest.raises(QlocError) as e:
            qloc.request("POST", "/v1/x")
        assert e.value.status is None and f"the connection failed ({type(error).__name__}: x)" in str(e.value)
        assert len(server.requests) == 1 and waits == []
    server = Server(httpx.ReadError("x"))
    qloc, waits = client(server, retries=2)
    with pytest.raises(QlocError, match=r"^GET /healthz: the connection failed \(ReadError: x\)$"):
        qloc.health()  # a read retried as often as allowed, then raised (no "look before you retry": nothing written)
    assert len(server.requests) == 3 and waits == [0.5, 1.0]


def test_a_request_that_never_connected_is_always_retried():
    for error in (httpx.ConnectError("refused"), httpx.ConnectTimeout("slow")):
        server = Server(error, ok({}))
        qloc, waits = client(server)
        qloc.request("POST", "/v1/x")  # not safe to repeat, but it never reached the server
        assert len(server.requests) == 2 and waits == [0.5]
    server = Server(httpx.ConnectError("refused"))
    qloc, waits = client(server, retries=1, backoff=2.0, max_wait=3.0)
    with pytest.raises(QlocError, match=r"^POST /v1/x: cannot connect to the API \(ConnectError: refused\)$"):
        qloc.request("POST", "/v1/x")
    assert waits == [2.0]
    server = Server(httpx.ConnectError("refused"))
    qloc, waits = client(server, retries=3, backoff=2.0, max_wait=3.0)
    with pytest.raises(QlocError):
        qloc.request("GET", "/v1/x")
    assert waits == [2.0, 3.0, 3.0]  # doubling, capped


def test_request_drops_unset_values_and_sends_the_rest_as_text():
    server = Server(ok({}, 201))
    qloc, _ = client(server)
    qloc.request("POST", "/v1/x", params={"a": 1, "b": None}, data={"c": 2.5, "d": None},
                 files=[("files", ("f.png", PNG, "image/png"))], headers={"X-Extra": "1"})
    assert dict(server.last.url.params) == {"a": "1"} and form(server.last) == {"c": ["2.5"], "files": ["f.png"]}
    assert server.last.headers["X-Extra"] == "1"
    qloc.request("GET", "/v1/y", params={"b": None})
    assert server.last.url.query == b""
    server.answers = [httpx.Response(409, json={"detail": "taken"})]
    assert qloc.request("GET", "/v1/z", ok=(409,)).status_code == 409  # an expected status is answered


def test_an_array_goes_up_as_one_image():
    server = Server(ok(LOCALIZE_BODY))
    qloc, _ = client(server)
    qloc.localize(SET, np.zeros((8, 8), np.uint8))
    assert form(server.last) == {"files": ["image0.png"]}


def test_a_client_of_its_own_is_closed_one_given_is_not():
    qloc = QlocClient("http://qloc.test")
    with qloc:
        pass
    assert qloc.http.is_closed
    http = httpx.Client(base_url="http://qloc.test")
    with QlocClient(http_client=http):
        pass
    assert not http.is_closed
    http.close()


POOL = {**PAGE, "num_pool_images": 0, "pool_bytes": 0, "max_pool_images": 10, "max_pool_bytes": 100}
DEFAULT_PAGE = {"limit": "50", "offset": "0"}
CALLS = [  # (call, its answer, method, path, query, retried after a lost answer)
    (lambda q: q.health(), {"status": "ok"}, "GET", "/healthz", {}, True),
    (lambda q: q.bundles(), {"data": [], "default": "b"}, "GET", "/v1/bundles", {}, True),
    (lambda q: q.list_exemplar_sets(), PAGE, "GET", "/v1/exemplar-sets", DEFAULT_PAGE, True),
    (lambda q: q.get_exemplar_set(SET), SET_BODY, "GET", f"/v1/exemplar-sets/{SET}", {}, True),
    (lambda q: q.update_exemplar_set(SET, name="x"), SET_BODY, "PATCH", f"/v1/exemplar-sets/{SET}", {}, True),
    (lambda q: q.delete_exemplar_set(SET), None, "DELETE", f"/v1/exemplar-sets/{SET}", {}, False),
    (lambda q: q.create_exemplar_set(PNG), SET_BODY, "POST", "/v1/exemplar-sets", {}, False),
    (lambda q: q.localize(SET, PNG, nearest=True), LOCALIZE_BODY, "POST", f"/v1/exemplar-sets/{SET}/localize",
     {"checkpoint": "active", "nearest": "true"}, True),
    (lambda q: q.export(SET, PNG), [], "POST", f"/v1/exemplar-sets/{SET}/localize",
     {"checkpoint": "active", "format": "coco"}, True),
    (lambda q: q.create_adaptation(SET, PNG), JOB_BODY, "POST", f"/v1/exemplar-sets/{SET}/adaptations", {}, True),
    (lambda q: q.get_adaptation(JOB), JOB_BODY, "GET", f"/v1/adaptations/{JOB}", {}, True),
    (lambda q: q.list_adaptations(SET), PAGE, "GET", f"/v1/exemplar-sets/{SET}/adaptations", DEFAULT_PAGE, True),
    (lambda q: q.cancel_adaptation(JOB), JOB_BODY, "POST", f"/v1/adaptations/{JOB}/cancel", {}, True),
    (lambda q: q.add_pool_images(SET, PNG), POOL, "POST", f"/v1/exemplar-sets/{SET}/images", {}, False),
    (lambda q: q.list_pool_images(SET), POOL, "GET", f"/v1/exemplar-sets/{SET}/images", DEFAULT_PAGE, True),
    (lambda q: q.delete_pool_image(SET, JOB), None, "DELETE", f"/v1/exemplar-sets/{SET}/images/{JOB}", {}, True),
    (lambda q: q.clear_pool(SET), None, "DELETE", f"/v1/exemplar-sets/{SET}/images", {}, True),
    (lambda q: q.list_checkpoints(SET), PAGE, "GET", f"/v1/exemplar-sets/{SET}/checkpoints", DEFAULT_PAGE, True),
    (lambda q: q.get_checkpoint(CKPT), CKPT_BODY, "GET", f"/v1/checkpoints/{CKPT}", {}, True),
    (lambda q: q.delete_checkpoint(CKPT), None, "DELETE", f"/v1/checkpoints/{CKPT}", {}, True),
    (lambda q: q.activate_checkpoint(CKPT), SET_BODY, "POST", f"/v1/checkpoints/{CKPT}/activate", {}, True),
    (lambda q: q.request("HEAD", "/healthz"), None, "HEAD", "/healthz", {}, True),
    (lambda q: q.request("OPTIONS", "/healthz"), None, "OPTIONS", "/healthz", {}, True),
]


@pytest.mark.parametrize(("call", "body", "method", "path", "query", "retried"), CALLS,
                         ids=[f"{c[2]} {c[3].replace(SET, '{set}').replace(JOB, '{id}').replace(CKPT, '{id}')}"
                              f"{' ' + c[4]['format'] if 'format' in c[4] else ''}" for c in CALLS])
def test_every_call_its_request_and_whether_a_lost_answer_is_asked_again(call, body, method, path, query, retried):
    """A request whose answer was lost is sent again only where that is safe: reads, and writes the server makes
    idempotent (a job's key, a checkpoint's activation, a deletion: at worst a 404); a new set or pool images would
    be stored twice."""
    answer = httpx.Response(204) if body is None else ok(body)
    server = Server(httpx.ReadError("lost"), answer)
    qloc, waits = client(server)
    if retried:
        call(qloc)
        assert len(server.requests) == 2 and waits == [0.5]
    else:
        with pytest.raises(QlocError, match=r"; the server may have done it all the same: look before you retry$"):
            call(qloc)
        assert len(server.requests) == 1 and waits == []
    assert {(r.method, r.url.path) for r in server.requests} == {(method, path)}
    assert dict(server.last.url.params) == query


def test_the_clients_defaults():
    qloc = QlocClient()
    assert (qloc.retries, qloc.backoff, qloc.max_wait) == (3, 0.5, 30.0)
    assert str(qloc.http.base_url) == "http://127.0.0.1:8000" and qloc.http.timeout == httpx.Timeout(120.0)
    assert QlocClient("http://h:1", timeout=7.0).http.timeout == httpx.Timeout(7.0)
    qloc.close()
    err = QlocError(None, "no answer")
    assert (err.status, err.method, err.url, err.response) == (None, "", "", None)


def test_wait_draws_each_state_and_tenth_and_polls_its_job(capsys):
    setup = {**JOB_BODY, "status": "running", "progress": {"iteration": 0, "total": 10, "mean_reward": None,
                                                          "phase": "setup"}}
    half = {**JOB_BODY, "status": "running", "progress": {"iteration": 5, "total": 10, "mean_reward": 0.25,
                                                         "phase": "adapting"}}
    done = {**JOB_BODY, "status": "succeeded", "progress": {"iteration": 10, "total": 10, "mean_reward": 0.5}}
    server = Server(ok(JOB_BODY), ok(setup), ok(half), ok(done))
    qloc, waits = client(server)
    assert qloc.wait(JOB, timeout=100).status == "succeeded"  # well within its deadline
    assert [r.url.path for r in server.requests] == [f"/v1/adaptations/{JOB}"] * 4 and waits == [1.0] * 3
    assert capsys.readouterr().err.splitlines() == [
        f"job {JOB[:8]}: 0/10 queued", f"job {JOB[:8]}: 0/10 running (setup)",
        f"job {JOB[:8]}: 5/10 running reward 0.2500", f"job {JOB[:8]}: 10/10 succeeded reward 0.5000"]


def test_a_detail_without_a_message():
    assert describe_detail([{"type": "x"}]) == "{'type': 'x'}"
    assert describe_detail([{"loc": ["query", "k"], "type": "x"}]) == "k: {'loc': ['query', 'k'], 'type': 'x'}"
