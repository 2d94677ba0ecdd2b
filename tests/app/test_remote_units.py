"""``app.remote`` by value: the wire format both sides share, and how ``WorkerInference`` turns each way a call to the
localize queue can end into an answer or a refusal.

The queue itself is tested with real Celery workers on Redis (``tests/worker/test_worker_remote_inference.py``,
``test_worker_localize_watch.py``); here ``send_task``'s result and the consumer watch are stand-ins, so that every
branch (a refusal, a worker's failure, a timeout, a worker gone, an unreachable backend) is reached in microseconds
and pinned by message."""

from __future__ import annotations

import io
import json
import time
import uuid
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from celery.exceptions import TimeoutError as CeleryTimeout
from PIL import Image, UnidentifiedImageError

from app import remote
from app.config import Settings
from app.remote import (
    BACKEND_DOWN,
    LOCALIZE_TASK,
    NEGATIVES_TASK,
    PROTOTYPE_TASK,
    WorkerInference,
    decode_answer,
    decode_call,
    decode_image,
    encode_answer,
    encode_call,
    encode_image,
    encode_prototype,
    refusal,
)
from app.serving import CheckpointRef, InferenceRefused, LocalizeAnswer, LocalizeCall
from models.inference import Instance, Localization


def wire(data):  # type: ignore[no-untyped-def]
    """Through JSON, as Celery's serializer sends it."""
    return json.loads(json.dumps(data))


def pixels(img: Image.Image) -> tuple:
    return img.mode, img.size, img.tobytes(), img.getpalette()


def images() -> list[Image.Image]:
    g = torch.Generator().manual_seed(0)
    rgb = Image.frombytes("RGB", (5, 3), (torch.rand(45, generator=g) * 255).byte().numpy().tobytes())
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    keyed = palette.copy()
    keyed.info["transparency"] = 2
    rgb_keyed = rgb.copy()
    rgb_keyed.info["transparency"] = (0, 0, 0)
    return [rgb.convert("L"), rgb, rgb.convert("RGBA"), rgb.convert("LA"), palette, keyed, rgb_keyed,
            palette.convert("PA"), rgb.convert("I;16")]


def test_images_travel_as_the_same_pixels():
    """Every mode the API decodes arrives as the very pixels it sent: raw modes as themselves, palettes with their
    palette (as PNG), transparent ones (a colour key, a palette with alpha) as RGBA first, as the model reads them."""
    for img in images():
        data = wire(encode_image(img))
        got = decode_image(data)
        if img.mode == "PA" or (img.mode != "P" and "transparency" in img.info):
            assert "raw" in data and got.mode == "RGBA"
            assert pixels(got) == pixels(img.convert("RGBA"))
        elif img.mode == "P":
            assert set(data) == {"png"} and got.format == "PNG"
            assert pixels(got) == pixels(img) and got.info.get("transparency") == img.info.get("transparency")
        else:
            assert set(data) == {"mode", "size", "raw"} and data["mode"] == img.mode and data["size"] == list(img.size)
            assert pixels(got) == pixels(img)


def test_a_png_on_the_wire_is_read_as_png_only():
    buf = io.BytesIO()
    Image.new("L", (3, 3)).save(buf, "GIF")
    with pytest.raises(UnidentifiedImageError):  # a GIF where a PNG must be: not read
        decode_image({"png": remote._b64(buf.getvalue())})
    assert remote.unb64("QUJD") == b"ABC"
    with pytest.raises(ValueError):  # noqa: PT011 -- base64 is validated: junk is refused, not skipped over
        remote.unb64("QUJD!")


def full_call(**kw) -> LocalizeCall:  # type: ignore[no-untyped-def]
    values = dict(bundle="b", bundle_sha256="a" * 64, prototype_dim=3, prototype=b"\1\2\3\4" * 3,
                  checkpoint=CheckpointRef(uuid.uuid4(), "ck/x.pt", "c" * 64), images=images()[:3], trajectory=True,
                  samples=4, nearest=False, max_instances=5,
                  extra_boxes=[(1.5, 2.0, 3.0, 4.25), None, (0.0, 0.0, 1.0, 1.0)])
    return LocalizeCall(**(values | kw))


def test_a_call_travels_whole():
    call = full_call()
    got = decode_call(wire(encode_call(call)))
    assert got == call
    assert got.extra_boxes == call.extra_boxes  # (not in the call's ==)
    bare = full_call(bundle_sha256=None, checkpoint=None, trajectory=False, samples=0, nearest=None, max_instances=1,
                     extra_boxes=None)
    assert decode_call(wire(encode_call(bare))) == bare
    assert type(got.prototype_dim) is int and type(got.samples) is int and type(got.max_instances) is int
    assert all(type(v) is float for b in got.extra_boxes if b is not None for v in b)
    assert decode_call({**wire(encode_call(call)), "extra_boxes": [[1, 2, 3, 4], None]}).extra_boxes == [
        (1.0, 2.0, 3.0, 4.0), None]
    # a call from an API of the version before (no max_instances, no extra_boxes)
    old = wire(encode_call(bare))
    del old["max_instances"], old["extra_boxes"]
    assert decode_call(old) == bare


def test_an_answer_travels_whole_and_old_ones_still_read():
    answer = LocalizeAnswer([
        Localization((1.0, 2.0, 3.0, 4.0), 0.25, [(0.0, 0.0, 9.0, 9.0), (1.0, 2.0, 3.0, 4.0)],
                     [Instance((1.0, 2.0, 3.0, 4.0), 0.25), Instance((5.0, 5.0, 8.0, 8.0), 0.5, template=True)]),
        Localization((0.5, 0.5, 2.0, 2.0), 1.5)], nearest=True, refined=True)
    got = decode_answer(wire(encode_answer(answer)))
    assert got == answer
    assert all(type(b) is tuple for r in got.results for b in [r.box, *(r.trajectory or [])])
    assert [i.template for i in got.results[0].instances] == [False, True]
    plain = LocalizeAnswer([Localization((0.0, 0.0, 1.0, 1.0), 2.0)], nearest=False)
    assert decode_answer(wire(encode_answer(plain))) == plain
    old = wire(encode_answer(answer))  # a worker of an earlier version: no refined, instances without the flag
    del old["refined"]
    old["results"][0]["instances"] = [i[:2] for i in old["results"][0]["instances"]]
    del old["results"][1]["instances"]
    got = decode_answer(old)
    assert got.refined is False and [i.template for i in got.results[0].instances] == [False, False]
    assert got.results[1].instances is None


def test_refusals_and_prototypes_on_the_wire():
    e = InferenceRefused(409, "replaced", {"Retry-After": "5"})
    assert wire(refusal(e)) == {"refused": {"status": 409, "detail": "replaced", "headers": {"Retry-After": "5"}}}
    made = remote.MadePrototype("b", "a" * 64, b"\0\1" * 4, 2, {"fit": 1}, b"\3" * 8, 1)
    assert wire(encode_prototype(made)) == {"bundle": "b", "bundle_sha256": "a" * 64,
                                            "prototype": remote._b64(b"\0\1" * 4), "prototype_dim": 2,
                                            "calibration": {"fit": 1}, "negatives": remote._b64(b"\3" * 8),
                                            "num_negatives": 1}
    assert encode_prototype(remote.MadePrototype("b", "s", b"", 0))["negatives"] is None


# --- WorkerInference, with stand-ins for the queue


class Result:
    """What ``send_task`` returns: answers ``out`` (or raises ``raises``) once ``slices`` waits have timed out."""

    def __init__(self, out=None, *, ok: bool = True, raises: Exception | None = None, slices: int = 0,  # type: ignore[no-untyped-def]
                 state: str = "PENDING", info=None):
        self.out, self.ok, self.raises, self.slices = out, ok, raises, slices
        self.state, self.info, self.id = state, info, "task-1"
        self.gets: list[float] = []
        self.forgotten = 0

    def get(self, timeout: float, propagate: bool):  # type: ignore[no-untyped-def]
        assert propagate is False
        self.gets.append(timeout)
        if len(self.gets) <= self.slices:
            time.sleep(timeout)  # waited that long for nothing
            raise CeleryTimeout("slice")
        if self.raises is not None:
            raise self.raises
        return self.out

    def successful(self) -> bool:
        return self.ok

    def forget(self) -> None:
        self.forgotten += 1
        raise RuntimeError("forgetting may fail: it expires anyway")


class Watch:
    """``ConsumerWatch``'s face: who consumes the queue, whether the backend answered."""

    def __init__(self, absent: str | None = None, backend_error: str | None = None, recent=(), gone=None):  # type: ignore[no-untyped-def]
        self._absent, self.backend_error, self.recent = absent, backend_error, deque(recent)
        self._gone = gone or {}

    def absent(self) -> str | None:
        return self._absent

    def gone(self, worker: str) -> str | None:
        return self._gone(worker) if callable(self._gone) else self._gone.get(worker)


class Celery:
    def __init__(self, result: Result | None = None, send_error: Exception | None = None,
                 backend_up: bool = True):
        self.result, self.send_error, self.backend_up = result, send_error, backend_up
        self.sent: list[tuple[str, dict, dict]] = []
        self.backend = SimpleNamespace(get_task_meta=self._meta)

    def _meta(self, key: str) -> dict:
        if not self.backend_up:
            raise ConnectionError("down")
        return {}

    def send_task(self, name, args, **kw):  # type: ignore[no-untyped-def]
        if self.send_error is not None:
            raise self.send_error
        self.sent.append((name, args[0], kw))
        return self.result


def backend(celery: Celery, watch: Watch | None = None, **settings) -> WorkerInference:  # type: ignore[no-untyped-def]
    s = Settings(**({"inference": "workers", "result_backend": "redis://unused", "localize_timeout": 7.0,
                     "set_timeout": 90.0, "localize_queue": "q-test"} | settings))
    wi = WorkerInference(s, celery)  # type: ignore[arg-type]
    wi.consumers = watch or Watch()  # type: ignore[assignment]
    return wi


ANSWER = LocalizeAnswer([Localization((1.0, 2.0, 3.0, 4.0), 0.5)], nearest=True)


def test_a_call_is_sent_to_the_localize_queue_expiring_with_its_timeout_and_its_answer_read():
    res = Result(encode_answer(ANSWER))
    celery = Celery(res)
    wi = backend(celery)
    call = full_call(nearest=None)
    assert wi.localize(call) == ANSWER
    [(name, payload, kw)] = celery.sent
    assert name == LOCALIZE_TASK and decode_call(payload) == call
    assert kw == {"queue": "q-test", "expires": 7.0, "ignore_result": False}
    assert res.forgotten == 1 and res.gets == [1.0]  # one slice of the wait, then forgotten


def test_the_servers_nearest_setting_fills_a_call_that_leaves_it_unset():
    celery = Celery(Result(encode_answer(ANSWER)))
    wi = backend(celery, localize_nearest=True)
    wi.localize(full_call(nearest=None))
    wi.localize(full_call(nearest=False))
    assert [p["nearest"] for _, p, _ in celery.sent] == [True, False]
    celery = Celery(Result(encode_answer(ANSWER)))
    backend(celery).localize(full_call(nearest=None))
    assert celery.sent[0][1]["nearest"] is None  # none set: the worker's bundle decides


def refused(wi: WorkerInference, task: str = LOCALIZE_TASK) -> InferenceRefused:
    with pytest.raises(InferenceRefused) as e:
        wi._ask(task, {}, timeout=None)
    return e.value


RETRY = {"Retry-After": "5"}


def test_no_consumer_is_refused_at_once_without_sending():
    celery = Celery(Result({}))
    e = refused(backend(celery, Watch(absent="no localize worker consumes queue 'q-test'")))
    assert (e.status_code, e.detail, e.headers) == (503, "no localize worker consumes queue 'q-test'", RETRY)
    assert celery.sent == []


def test_an_unreachable_result_backend_is_refused_before_sending_unless_it_answers_again():
    celery = Celery(Result({"ok": 1}), backend_up=False)
    e = refused(backend(celery, Watch(backend_error="ConnectionError")))
    assert (e.status_code, e.detail, e.headers) == (503, BACKEND_DOWN, RETRY) and celery.sent == []
    celery = Celery(Result({"ok": 1}))  # the watch saw it down, but it answers now: sent
    assert backend(celery, Watch(backend_error="ConnectionError"))._ask("t", {"x": 1}) == {"ok": 1}
    assert celery.sent[0][:2] == ("t", {"x": 1})


def test_a_send_that_fails_says_which_part_is_down():
    e = refused(backend(Celery(send_error=OSError("broker"))))
    assert (e.status_code, e.detail, e.headers) == (503, "the localize queue is unreachable; retry later", RETRY)
    e = refused(backend(Celery(send_error=OSError("broker"), backend_up=False)))
    assert (e.status_code, e.detail) == (503, BACKEND_DOWN)


def test_a_timeout_names_the_setting_that_bounds_the_wait(monkeypatch):
    monkeypatch.setattr(remote, "WAIT_SLICE_S", 0.01)
    for task, timeout, setting in ((LOCALIZE_TASK, None, "QLOC_LOCALIZE_TIMEOUT"),
                                   (PROTOTYPE_TASK, 0.05, "QLOC_SET_TIMEOUT")):
        res = Result(slices=10_000)
        wi = backend(Celery(res), localize_timeout=0.05)
        with pytest.raises(InferenceRefused) as e:
            wi._ask(task, {}, timeout=timeout)
        assert e.value.status_code == 503 and e.value.headers == RETRY
        assert e.value.detail == (f"no localize worker answered within 0.05 s ({setting}): all busy, none consuming "
                                  "queue 'q-test', the one running it gone, or the workers answering to another "
                                  "result backend than this API's QLOC_RESULT_BACKEND; retry later")
        assert res.forgotten == 1 and len(res.gets) >= 2


def test_an_answer_that_cannot_be_read_is_the_backends_fault():
    res = Result(raises=ConnectionError("lost"))
    e = refused(backend(Celery(res)))
    assert (e.status_code, e.detail, e.headers) == (503, BACKEND_DOWN, RETRY) and res.forgotten == 1


@pytest.mark.parametrize(("out", "ok", "name"), [(ValueError("boom"), False, "ValueError"),
                                                 ([1, 2], True, "list"), (None, True, "NoneType"),
                                                 ({"a": 1}, False, "dict")])
def test_a_task_that_failed_on_the_worker_is_a_503_naming_the_error(out, ok, name):
    e = refused(backend(Celery(Result(out, ok=ok))))
    assert (e.status_code, e.detail, e.headers) == (503, f"the localize worker failed ({name}); retry later", RETRY)


def test_a_workers_refusal_is_the_apis():
    res = Result(refusal(InferenceRefused(409, "bundle replaced", None)))
    e = refused(backend(Celery(res)))
    assert (e.status_code, e.detail, e.headers) == (409, "bundle replaced", None)
    res = Result(wire(refusal(InferenceRefused(422, "unknown bundle 'x'", {"X-A": "1"}))))
    e = refused(backend(Celery(res)))
    assert (e.status_code, e.detail, e.headers) == (422, "unknown bundle 'x'", {"X-A": "1"})


def test_a_call_is_given_up_as_soon_as_no_worker_consumes_the_queue_or_its_worker_is_gone(monkeypatch):
    monkeypatch.setattr(remote, "WAIT_SLICE_S", 0.01)
    # still queued, and nobody consumes the queue any more (there was one when it was sent)
    wi = backend(Celery(res := Result(slices=3, out={"late": 1})), Watch(recent=[frozenset({"w1"})]),
                 localize_timeout=5.0)
    states = iter([None, "no localize worker consumes queue 'q-test' any more"])
    wi.consumers.absent = lambda: next(states)  # type: ignore[method-assign]
    e = refused(wi)
    assert (e.status_code, e.detail, e.headers) == (503, "no localize worker consumes queue 'q-test' any more",
                                                     RETRY)
    assert len(res.gets) == 1 and res.forgotten == 1
    # started by a worker that is gone
    res = Result(slices=3, out={"late": 1}, state="STARTED", info={"hostname": "w1"})
    wi = backend(Celery(res), Watch(recent=[frozenset({"w2"})], gone={"w1": "worker w1 is gone"}), localize_timeout=5.0)
    e = refused(wi)
    assert (e.status_code, e.detail) == (503, "worker w1 is gone") and len(res.gets) == 1
    # started by a worker still there, or with nothing to tell: waited for
    for watch, state, info in ((Watch(recent=[frozenset({"w1"})]), "STARTED", {"hostname": "w1"}),
                               (Watch(recent=[frozenset({"w1"})]), "STARTED", "not a dict"),
                               (Watch(recent=[frozenset({"w1"})]), "PENDING", None),
                               (Watch(recent=[frozenset({"w1"})]), "SUCCESS", None),
                               (Watch(gone=lambda w: f"{w} gone"), "STARTED", {"hostname": "w1"}),  # no news
                               (Watch(recent=[frozenset({"w1"})], gone=lambda w: f"{w} gone"), "STARTED", {})):
        res = Result(slices=3, out={"late": 1}, state=state, info=info)
        wi = backend(Celery(res), watch, localize_timeout=5.0)
        assert wi._ask("t", {}) == {"late": 1} and len(res.gets) == 4


def test_the_wait_is_cut_in_slices_up_to_the_deadline(monkeypatch):
    monkeypatch.setattr(remote, "WAIT_SLICE_S", 0.02)
    res = Result(slices=10_000)
    wi = backend(Celery(res))
    with pytest.raises(CeleryTimeout):
        wi._wait(res, 0.1)
    assert 2 <= len(res.gets) <= 11 and all(0.01 <= t <= 0.02 for t in res.gets)  # (a loaded machine: fewer)
    res = Result(out={"a": 1}, slices=2)
    assert wi._wait(res, 0.1) == {"a": 1} and len(res.gets) == 3


def test_a_new_sets_prototype_is_asked_with_its_calibration_inputs_and_the_longer_timeout():
    out = {"bundle": "b", "bundle_sha256": "s" * 64, "prototype": remote._b64(b"\0" * 8), "prototype_dim": 2,
           "calibration": {"fit": 2}, "negatives": remote._b64(b"\1" * 8), "num_negatives": 1}
    celery = Celery(Result(out))
    wi = backend(celery)
    crops, examples = images()[:2], [(images()[0], (0.0, 1.0, 2.0, 3.0))]
    made = wi.prototype("b", crops, explicit=True, examples=examples, threshold=0.4, negatives=images()[1:2])
    assert made == remote.MadePrototype("b", "s" * 64, b"\0" * 8, 2, {"fit": 2}, b"\1" * 8, 1)
    [(name, payload, kw)] = celery.sent
    assert name == PROTOTYPE_TASK and kw["expires"] == 90.0
    assert payload["bundle"] == "b" and payload["explicit"] is True and payload["threshold"] == 0.4
    assert [pixels(decode_image(c)) for c in payload["crops"]] == [pixels(c) for c in crops]
    assert [(pixels(decode_image(e["image"])), e["box"]) for e in payload["examples"]] == [
        (pixels(examples[0][0]), [0.0, 1.0, 2.0, 3.0])]
    assert [pixels(decode_image(c)) for c in payload["negatives"]] == [pixels(images()[1])]
    # without a threshold: the prototype only; a worker of the version before answers no calibration
    celery = Celery(Result({k: out[k] for k in ("bundle", "bundle_sha256", "prototype", "prototype_dim")}))
    made = backend(celery).prototype("b", crops, explicit=False)
    assert (made.calibration, made.negatives, made.num_negatives) == (None, None, 0)
    assert set(celery.sent[0][1]) == {"bundle", "explicit", "crops"} and celery.sent[0][1]["explicit"] is False
    wi = backend(Celery(Result(out)), localize_timeout=200.0)
    wi.prototype("b", crops, explicit=True)
    assert wi.celery.sent[0][2]["expires"] == 200.0  # the longer of the two


def test_negatives_sent_to_a_worker_that_cannot_take_them_are_refused():
    old = {"bundle": "b", "bundle_sha256": "s", "prototype": remote._b64(b"\0" * 8), "prototype_dim": 2,
           "calibration": {"fit": 2}}
    with pytest.raises(InferenceRefused) as e:
        backend(Celery(Result(old))).prototype("b", images()[:1], explicit=True, threshold=0.5,
                                                negatives=images()[:1])
    assert (e.value.status_code, e.value.headers) == (503, RETRY)
    assert e.value.detail == ("the localize worker is of an earlier version that cannot take negative_files; retry "
                              "when it is upgraded")
    made = backend(Celery(Result(old))).prototype("b", images()[:1], explicit=True, threshold=0.5, negatives=[])
    assert made.calibration == {"fit": 2}


def test_negatives_confidence_and_bundle_checks_on_a_worker():
    celery = Celery(Result({"confidence": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]}))
    wi = backend(celery)
    call = full_call()
    boxes = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    conf = wi.negatives_confidence(call, b"\5" * 12, {"fit": 3}, images()[:2], boxes)
    assert conf.shape == (2, 3) and conf.dtype == torch.float32
    assert conf.flatten().tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    [(name, payload, _)] = celery.sent
    assert name == NEGATIVES_TASK
    assert payload == {"bundle": "b", "bundle_sha256": "a" * 64, "prototype_dim": 3,
                       "prototype": remote._b64(call.prototype), "negatives": remote._b64(b"\5" * 12),
                       "calibration": {"fit": 3}, "images": [encode_image(im) for im in images()[:2]],
                       "boxes": boxes.tolist()}
    celery = Celery(Result({}))
    assert backend(celery).check_bundle("b", sha256="s", prototype_dim=4) is None
    assert celery.sent[0][:2] == (remote.BUNDLE_CHECK_TASK, {"bundle": "b", "bundle_sha256": "s", "prototype_dim": 4})
    with pytest.raises(InferenceRefused) as e:
        backend(Celery(Result(refusal(InferenceRefused(409, "replaced"))))).check_bundle("b", sha256="s",
                                                                                          prototype_dim=4)
    assert e.value.status_code == 409


def test_workers_mode_needs_a_result_backend_and_watches_its_queue():
    settings = Settings(inference="workers", result_backend="redis://unused", localize_queue="q-w",
                        localize_worker_check_s=3.0)
    with pytest.raises(ValueError) as e:  # (Settings refuses it too: a backend made from settings changed later)
        WorkerInference(settings.model_copy(update={"result_backend": None}), Celery())  # type: ignore[arg-type]
    assert str(e.value) == "WorkerInference needs a result backend (QLOC_RESULT_BACKEND)"
    celery = Celery()
    watch = WorkerInference(settings, celery).consumers  # type: ignore[arg-type]
    assert (watch.celery, watch.queue, watch.interval_s) == (celery, "q-w", 3.0)
    err = remote.answer_refusal(InferenceRefused(503, "busy", RETRY))
    assert (err.status_code, err.detail, err.headers) == (503, "busy", RETRY)


def test_the_apps_worker_backend_is_found_on_its_state():
    import asyncio

    wi = backend(Celery())
    with_remote = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(remote=wi)))
    local = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()))
    assert remote.get_remote(with_remote) is wi and remote.get_remote(local) is None  # type: ignore[arg-type]
    assert asyncio.run(remote.remote_dep(with_remote)) is wi  # type: ignore[arg-type]
    assert asyncio.run(remote.remote_dep(local)) is None  # type: ignore[arg-type]
