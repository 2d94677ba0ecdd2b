"""``app.main`` by value, below HTTP: the body limits' middleware on a recording ASGI app, what the error handlers
show of an invalid value, the app's wiring from its settings and its life. Through HTTP: ``test_app_upload_limits.py``
(uvicorn), ``test_app_strict.py``."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_fixtures import make_test_settings
from starlette.datastructures import Headers, UploadFile
from starlette.middleware import Middleware

from app.main import INPUT_SHOWN, BodyLimitMiddleware, BodyTooLarge, _encodable, _error, _shown, create_app
from app.metrics import RequestMetricsMiddleware
from app.remote import WorkerInference
from app.serving import BatchedInference

MULTIPART = "request body larger than 100 bytes"


def other_words(limit: int) -> str:
    return (f"a body that is not multipart/form-data (JSON, say) larger than {limit} bytes (the server's "
            "QLOC_MAX_JSON_BYTES)")


def exchange(middleware: BodyLimitMiddleware, headers: dict[str, str], chunks: list[bytes] | None = None,
             scope_type: str = "http") -> tuple[list[bytes] | None, list[dict[str, Any]]]:
    """One request through ``middleware`` -> (the body the app read, ``None`` where the app was not called; what
    was sent back). The app reads every message its ``receive`` gives until the last chunk, then answers 200."""
    chunks = chunks or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []
    read: list[bytes] | None = None

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: dict[str, Any], receive_, send_) -> None:  # type: ignore[no-untyped-def]
        nonlocal read
        read = []
        while True:
            m = await receive_()
            read.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_({"type": "http.response.body", "body": b"ok"})

    middleware.app = app
    scope = {"type": scope_type, "method": "POST", "path": "/x", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(middleware(scope, receive, send))
    return read, sent


def answered(sent: list[dict[str, Any]]) -> tuple[int, str, str]:
    start, body = sent
    return start["status"], Headers(raw=start["headers"])["content-type"], json.loads(body["body"])["detail"]


def limits(max_body_size: int = 100, max_other_size: int | None = 10) -> BodyLimitMiddleware:
    return BodyLimitMiddleware(None, max_body_size, max_other_size)  # type: ignore[arg-type]


def test_a_declared_length_over_the_limit_is_a_json_413_before_the_body_is_read():
    form = {"content-type": "multipart/form-data; boundary=b"}
    read, sent = exchange(limits(), {**form, "content-length": "101"})
    assert read is None and answered(sent) == (413, "application/json", MULTIPART)
    read, sent = exchange(limits(), {"content-type": "Multipart/Form-Data; boundary=b", "content-length": "101"})
    assert read is None and answered(sent)[2] == MULTIPART  # the type in any case
    read, sent = exchange(limits(), {**form, "content-length": "100"}, [b"x" * 100])  # at the limit: read
    assert read == [b"x" * 100] and sent[0]["status"] == 200
    for body in ({"content-type": "application/json"}, {}):  # any other body (or none named): its own limit
        read, sent = exchange(limits(), {**body, "content-length": "11"})
        assert read is None and answered(sent) == (413, "application/json", other_words(10))
        read, sent = exchange(limits(), {**body, "content-length": "10"}, [b"x" * 10])
        assert read == [b"x" * 10] and sent[0]["status"] == 200
    # a length that is no number is left to the server; the body is still counted
    read, sent = exchange(limits(), {**form, "content-length": "-5"}, [b"x" * 50])
    assert read == [b"x" * 50] and sent[0]["status"] == 200


def test_the_other_limit_is_never_above_the_multipart_one_and_defaults_to_it():
    for other, expected in ((None, 100), (500, 100), (10, 10), (100, 100)):
        m = limits(100, other)
        assert m.other == (expected, other_words(expected)) and m.multipart == (100, MULTIPART)
        read, sent = exchange(m, {"content-type": "application/json", "content-length": str(expected + 1)})
        assert read is None and answered(sent)[2] == other_words(expected)


def test_a_body_growing_past_the_limit_raises_as_its_chunks_arrive_and_only_then():
    form = {"content-type": "multipart/form-data; boundary=b"}
    read, sent = exchange(limits(), form, [b"x" * 40, b"x" * 40, b"x" * 20])  # 100 in all: at the limit
    assert read == [b"x" * 40, b"x" * 40, b"x" * 20] and sent[0]["status"] == 200
    with pytest.raises(BodyTooLarge) as e:
        exchange(limits(), form, [b"x" * 40, b"x" * 40, b"x" * 21])
    assert (e.value.status_code, e.value.detail) == (413, MULTIPART)
    with pytest.raises(BodyTooLarge) as e:
        exchange(limits(), {"content-type": "application/json"}, [b"x" * 6, b"x" * 5])
    assert (e.value.status_code, e.value.detail) == (413, other_words(10))


def test_what_is_not_an_http_request_passes_untouched():
    read, sent = exchange(limits(), {"content-length": "1000"}, [b"x" * 1000], scope_type="websocket")
    assert read == [b"x" * 1000] and sent[0]["status"] == 200


def test_a_long_value_is_shown_cut_with_its_length_and_a_file_by_its_name_and_size():
    assert INPUT_SHOWN == 200
    assert _shown("k" * 200) == "k" * 200 and _shown(b"k" * 200) == b"k" * 200 and _shown(7) == 7
    assert _shown("k" * 201) == "k" * 200 + "... (201 characters)"
    assert _shown(b"k" * 201) == str(b"k" * 200) + "... (201 bytes)"
    assert _shown(UploadFile(io.BytesIO(b"abc"), filename="a.png", size=3)) == "a file (a.png, 3 bytes)"
    assert _shown(UploadFile(io.BytesIO(b""), size=0)) == "a file (no filename, 0 bytes)"


def test_an_error_says_what_to_send_for_a_file_in_a_text_field_and_text_in_a_file_field():
    plain = {"type": "int_parsing", "loc": ["query", "samples"], "msg": "not an int"}
    assert _error(plain) is plain  # no input: as it was
    assert _error({**plain, "input": "k" * 201}) == {**plain, "input": "k" * 200 + "... (201 characters)"}
    upload = UploadFile(io.BytesIO(b"[]"), filename="boxes.json", size=2)
    err = _error({"type": "string_type", "loc": ["body", "boxes"], "msg": "Input should be a valid string",
                  "input": upload})
    assert err["input"] == "a file (boxes.json, 2 bytes)"
    assert err["msg"] == ("boxes is a text field, not a file: send its value (curl -F 'boxes=<file' sends a file's "
                          "text as the value; -F 'boxes=@file' sends the file)")
    err = _error({"type": "string_type", "loc": ["body", "labels", 2], "msg": "m", "input": upload})
    assert err["msg"].startswith("labels is a text field, not a file: ")  # a list field: its name, not the index
    err = _error({"type": "string_type", "loc": ["query", "boxes"], "msg": "m", "input": upload})
    assert err["msg"] == "m"  # not a form field: the message as it was
    assert _error({"type": "t", "input": upload}) == {"type": "t", "input": "a file (boxes.json, 2 bytes)"}  # no loc
    files = ("files takes files, not text: attach one (curl -F 'files=@image.png'); a part sent without a filename "
             "(or with an empty one) is read as text: give each file a filename")
    err = _error({"type": "value_error", "loc": ["body", "files", 0], "msg": "Value error, Expected UploadFile, "
                  "received: <class 'str'>", "input": "\x89PNG" + "x" * 300})
    assert err["msg"] == files and err["input"] == "text of 304 characters (not shown)"
    err = _error({"type": "value_error", "loc": ["body", "files"], "msg": "Expected UploadFile", "input": 5})
    assert err["msg"] == files and err["input"] == 5  # not text: shown as it is
    err = _error({"type": "value_error", "loc": ["body"], "msg": "Expected UploadFile", "input": "x"})
    assert err == {"type": "value_error", "loc": ["body"], "msg": "Expected UploadFile", "input": "x"}  # no field


def test_what_json_cannot_hold_is_echoed_as_text():
    value = {"threshold": float("nan"), "up": float("inf"), "down": float("-inf"), "k": ["\ud800", 1.5, [2, "a"]],
             "\udfff": None, "n": 3}
    assert _encodable(value) == {"threshold": "nan", "up": "inf", "down": "-inf", "k": ["\\ud800", 1.5, [2, "a"]],
                                 "\\udfff": None, "n": 3}
    json.dumps(_encodable(value), allow_nan=False).encode("utf-8")  # valid JSON, encodable
    assert _encodable("é") == "é" and _encodable(True) is True


@pytest.fixture
def wired(monkeypatch):  # type: ignore[no-untyped-def]
    """``create_app``'s calls into torch and the allocator recorded, on a machine of 8 usable cores."""
    import app.main as main

    seen: dict[str, list[Any]] = {"threads": [], "tuned": [], "warmup": []}
    monkeypatch.setattr(main.torch, "set_num_threads", seen["threads"].append)
    monkeypatch.setattr(main, "usable_cores", lambda: 8)
    monkeypatch.setattr(main, "tune_malloc", lambda: seen["tuned"].append(True))
    monkeypatch.setattr(main.warmup, "install", lambda bundles, settings, observe: seen["warmup"].append(
        (bundles, settings, observe)) or "warm")
    return seen


def test_the_app_is_wired_from_its_settings(tmp_path, bundle_dir, wired, monkeypatch):
    s = make_test_settings(tmp_path, bundle_dir, batch_window_ms=3, batch_gather_ms=2, batch_max_images=7,
                           inference_queue_images=9, route_threads=5, localize_nearest=True, api_workers=2,
                           tune_malloc=True, max_json_bytes=4096)
    app = create_app(s)
    assert wired["threads"] == [2] and type(wired["threads"][0]) is int  # 8 cores // (2 x 2 processes)
    assert wired["tuned"] == [True]
    assert app.state.settings is s and app.state.warmup == "warm"
    [(bundles, settings, observe)] = wired["warmup"]
    assert bundles is app.state.bundles and settings is s and observe == app.state.metrics.episode_compiled
    assert app.state.bundles.bundle_dir == bundle_dir and app.state.bundles.device.type == "cpu"
    assert app.state.bundles.fast_episode is False  # the settings' compile_episode
    assert app.state.store.root == s.storage_dir
    assert str(app.state.engine.url) == s.database_url and app.state.session_factory.kw["bind"] is app.state.engine
    inference = app.state.inference
    assert isinstance(inference, BatchedInference) and app.state.remote is None
    assert inference.bundles is app.state.bundles and inference.store is app.state.store
    assert inference.default_nearest is True
    b = inference.batcher
    assert (b.window_s, b.gather_s, b.max_batch, b.max_queue) == (0.003, 0.002, 7, 9)
    assert b.observe == app.state.metrics.engine_batch_began
    turns = app.state.route_turns
    assert [turns.acquire(blocking=False) for _ in range(6)] == [True] * 5 + [False]
    [outer, inner] = app.user_middleware
    assert isinstance(outer, Middleware) and outer.cls is RequestMetricsMiddleware
    assert inner.cls is BodyLimitMiddleware
    assert inner.kwargs == {"max_body_size": s.max_request_bytes, "max_other_size": 4096} and s.max_request_bytes > 4096
    assert outer.kwargs["get_metrics"]() is app.state.metrics
    assert not app.router.redirect_slashes and app.docs_url is None and app.redoc_url is None
    assert (app.title, app.version) == ("qloc", "1.0.0") and app.description == (
        "Query object localization: register exemplar crops, localize the object in images, adapt the localization "
        "policy to your images without labels.")

    app.state.engine.dispose()

    wired["threads"].clear()
    wired["tuned"].clear()
    for update in ({"api_workers": None, "tune_malloc": False}, {"inference_threads": 3}):
        create_app(s.model_copy(update=update)).state.engine.dispose()
    assert wired["threads"] == [4, 3]  # one process: half the cores; or as told
    assert wired["tuned"] == [True]  # the second only: the first has QLOC_TUNE_MALLOC off
    wired["threads"].clear()
    monkeypatch.setattr("app.main.usable_cores", lambda: 1)
    create_app(s).state.engine.dispose()
    assert wired["threads"] == [1]  # never 0
    assert all(type(n) is int for n in wired["threads"])  # torch takes no float


def test_in_workers_mode_the_api_loads_no_model_and_takes_no_threads(tmp_path, bundle_dir, wired):
    s = make_test_settings(tmp_path, bundle_dir, inference="workers", device="cuda", localize_nearest=False,
                           result_backend=f"db+sqlite:///{tmp_path}/results.db")
    app = create_app(s)
    assert isinstance(app.state.inference, WorkerInference) and app.state.remote is app.state.inference
    assert app.state.remote.celery is app.state.queue.celery and app.state.remote.default_nearest is False
    assert app.state.bundles.device.type == "cpu"  # QLOC_DEVICE=cuda needs no GPU here: the workers have it
    assert app.state.warmup is None and wired["warmup"] == [] and wired["threads"] == []
    app.state.engine.dispose()


def test_the_apps_life_loads_the_default_bundle_first_and_closes_the_engine_and_the_database_last(
        tmp_path, bundle_dir, wired, caplog):
    s = make_test_settings(tmp_path, bundle_dir)
    app = create_app(s)
    order: list[str] = []
    close, dispose = app.state.inference.close, app.state.engine.dispose
    app.state.inference.close = lambda: (order.append("engine closed"), close())[1]
    app.state.engine.dispose = lambda: (order.append("database closed"), dispose())[1]
    assert not app.state.bundles.is_loaded(s.default_bundle)
    with TestClient(app):
        assert app.state.bundles.is_loaded(s.default_bundle) and order == []  # before the first request
    assert order == ["engine closed", "database closed"]

    missing = create_app(s.model_copy(update={"default_bundle": "missing"}))
    with caplog.at_level("WARNING", logger="app.main"), TestClient(missing) as c:  # it starts; /readyz says why
        assert c.get("/healthz").status_code == 200 and missing.state.bundles.loaded() == []
    assert "default bundle 'missing' not loaded: " in caplog.text


def test_in_workers_mode_the_apps_life_watches_the_localize_queue_and_loads_no_bundle(tmp_path, bundle_dir, wired):
    s = make_test_settings(tmp_path, bundle_dir, inference="workers", result_backend=f"db+sqlite:///{tmp_path}/r.db")
    app = create_app(s)
    watch: list[str] = []
    app.state.remote.consumers.start = lambda: watch.append("start")
    app.state.remote.consumers.stop = lambda: watch.append("stop")
    with TestClient(app):
        assert watch == ["start"]
    assert watch == ["start", "stop"] and app.state.bundles.loaded() == []
