"""The localize worker's tasks (``worker.localize``) by value, in-process: the API's ``WorkerInference`` sends each
task through a loopback ``Celery`` that runs it here, through JSON as Celery's serializer would, so that both sides of
the wire are the shipped code and the answers are compared with what local mode computes on the same inputs.

The queue itself (a real worker process on Redis, the same answers over HTTP) is
``tests/worker/test_worker_remote_inference.py``; each way a call to the queue ends is ``tests/app/
test_remote_units.py``. Here: a new set's prototype, calibration and negatives as local mode makes them (images of
other sizes than the bundle's input, a threshold other than the default, a verifier installed), each task's refusals
whole, and the process's batched backend on the worker's settings."""

from __future__ import annotations

import io
import json
import uuid
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from service_fixtures import TEST_BUNDLES, install_bundle, make_test_settings, png_bytes

from app import warmup
from app.calibration import calibrate_new_set
from app.calibration import negatives_confidence as local_negatives_confidence
from app.config import Settings
from app.inference import BundleRegistry, prototype_to_bytes
from app.remote import (
    BUNDLE_CHECK_TASK,
    LOCALIZE_TASK,
    NEGATIVES_TASK,
    PROTOTYPE_TASK,
    WorkerInference,
    decode_answer,
    encode_call,
    encode_image,
)
from app.serving import InferenceRefused, LocalInference, LocalizeCall
from app.storage import BlobStore
from models.calibration import Calibration
from models.core.platt import PlattFit
from models.inference import pil_to_tensor
from models.verifier import KindVerifier, save_verifier, verifier_path
from worker import localize as on_worker
from worker.context import WorkerContext

SAMPLES = 8  # the calibration's pasted crops and backgrounds: enough to fit, seconds less than the default


class Done:
    """A task's result that is already there (``send_task`` ran it)."""

    def __init__(self, out):  # type: ignore[no-untyped-def]
        self.out, self.id, self.state, self.info = out, str(uuid.uuid4()), "SUCCESS", None

    def get(self, timeout: float, propagate: bool):  # type: ignore[no-untyped-def]
        return self.out

    def successful(self) -> bool:
        return True

    def forget(self) -> None:
        pass


class Loopback:
    """``Celery``'s face for ``WorkerInference``: each task runs at once on this process's worker context, its payload
    and its answer through JSON."""

    TASKS = {LOCALIZE_TASK: on_worker.localize, PROTOTYPE_TASK: on_worker.prototype,
             NEGATIVES_TASK: on_worker.negatives_confidence, BUNDLE_CHECK_TASK: on_worker.check_bundle}

    def __init__(self, ctx: WorkerContext):
        self.ctx, self.last_payload = ctx, {}

    def send_task(self, name, args, **kw):  # type: ignore[no-untyped-def]
        payload = self.last_payload = json.loads(json.dumps(args[0]))
        return Done(json.loads(json.dumps(self.TASKS[name](self.ctx, payload))))


class Watch:
    backend_error = None

    def absent(self) -> None:
        return None


@pytest.fixture(scope="module")
def bundles_here(bundle_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The test bundles (copies of ``bundle_dir``'s), a verifier beside ``test-digits`` (random weights; its first
    kind is the test crops', so that a set of them gets a kind check), and a file of bundle ``broken`` that does not
    load."""
    d = tmp_path_factory.mktemp("bundles")
    for name in TEST_BUNDLES:
        install_bundle(d, bundle_dir / f"{name}.pt", name)
    torch.manual_seed(3)
    verifier = KindVerifier(1, ["0", "1", "background"]).eval()
    with torch.no_grad():
        verifier.kinds[:] = F.normalize(torch.randn(3, verifier.kinds.shape[1]), dim=-1)
        verifier.kinds[0] = verifier.nearest_kind([pil_to_tensor(c, 1, (0.0,)) for c in crops()])[0]
    save_verifier(verifier_path(d / "test-digits.pt"), verifier, {})
    (d / "broken.pt").write_bytes(b"not a bundle")
    return d


@pytest.fixture(scope="module")
def worker_ctx(bundles_here, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A worker's context, with its own batched backend: this process's (``on_worker.inference``) is left for the
    other tests as it was."""
    settings = make_test_settings(tmp_path_factory.mktemp("worker"), bundles_here, calibration_samples=SAMPLES)
    ctx = WorkerContext.create(settings)
    kept, on_worker._backends = on_worker._backends, {}
    try:
        yield ctx
    finally:
        for backend in on_worker._backends.values():
            backend.close()
        on_worker._backends = kept
        ctx.engine.dispose()


@pytest.fixture(scope="module")
def api(worker_ctx):  # type: ignore[no-untyped-def]
    s = Settings(inference="workers", result_backend="redis://unused", localize_queue="q-test",
                 default_bundle="test-digits", localize_timeout=30.0)
    wi = WorkerInference(s, Loopback(worker_ctx))  # type: ignore[arg-type]
    wi.consumers = Watch()  # type: ignore[assignment]
    return wi


@pytest.fixture(scope="module")
def local(bundles_here, tmp_path_factory):  # type: ignore[no-untyped-def]
    return LocalInference(BundleRegistry(bundles_here, "cpu"), BlobStore(tmp_path_factory.mktemp("blobs")))


def image(width: int, height: int, seed: int, mode: str = "L") -> Image.Image:
    img = Image.open(io.BytesIO(png_bytes(width, height, mode=mode, seed=seed)))
    img.load()
    return img


def crops() -> list[Image.Image]:
    return [image(20, 24, 1), image(31, 26, 2, "RGB"), image(18, 18, 3)]


def examples() -> list[tuple[Image.Image, tuple[float, float, float, float]]]:
    """Whole images of other sizes than the bundle's input (84 px) with a box in their own pixels."""
    return [(image(126, 100, 4), (30.0, 20.0, 80.0, 64.0)), (image(60, 168, 5), (4.0, 90.0, 40.0, 130.0))]


def refused(e: pytest.ExceptionInfo[InferenceRefused]) -> tuple[int, str]:
    return e.value.status_code, e.value.detail


def proto_of(local: LocalInference, name: str, imgs: list[Image.Image]) -> torch.Tensor:
    return local.bundles.get(name).localizer.prototype(imgs)


def test_a_new_sets_prototype_is_the_one_local_mode_makes_and_asks_for_no_calibration_without_a_threshold(
        api, local):
    made = api.prototype("test-other", crops(), explicit=True)
    loaded = local.bundles.get("test-other")
    proto = loaded.localizer.prototype(crops())
    assert (made.bundle, made.bundle_sha256, made.prototype_dim) == ("test-other", loaded.sha256, proto.numel())
    assert made.prototype == prototype_to_bytes(proto)
    assert (made.calibration, made.negatives, made.num_negatives) == (None, None, 0)
    assert api.prototype("test-digits", crops()[:1], explicit=False).prototype == prototype_to_bytes(
        proto_of(local, "test-digits", crops()[:1]))


def test_a_new_sets_calibration_and_negatives_are_fit_on_the_worker_as_local_mode_fits_them(api, local):
    """Labeled examples in their own pixels, negative crops, a threshold of the client's and the bundle's verifier:
    every input reaches the fit as local mode's route hands it over (``create_exemplar_set``)."""
    negatives = [image(22, 22, 6), image(16, 30, 7, "RGB")]
    made = api.prototype("test-digits", crops(), explicit=True, examples=examples(), threshold=0.7,
                         negatives=negatives)
    loaded = local.bundles.get("test-digits")
    proto = loaded.localizer.prototype(crops())
    verifier = local.bundles.verifier("test-digits")
    assert verifier is not None
    want = calibrate_new_set(loaded, proto, crops(), examples(), negatives, threshold=0.7, samples=SAMPLES,
                             verifier=verifier)
    assert made.calibration == json.loads(json.dumps(want.calibration))
    assert made.calibration["threshold"] == 0.7 and made.calibration["kind"]["kind"] == "0"
    assert (made.negatives, made.num_negatives) == (want.negatives, 2)
    # each input matters: without the examples, the negatives, the verifier, or at another size, another fit
    others = [calibrate_new_set(loaded, proto, crops(), [], negatives, threshold=0.7, samples=SAMPLES,
                                verifier=verifier),
              calibrate_new_set(loaded, proto, crops(), [(im.resize((84, 84)), b) for im, b in examples()], negatives,
                                threshold=0.7, samples=SAMPLES, verifier=verifier),
              calibrate_new_set(loaded, proto, crops(), examples(), [], threshold=0.7, samples=SAMPLES,
                                verifier=verifier),
              calibrate_new_set(loaded, proto, crops(), examples(), negatives, threshold=0.7, samples=SAMPLES),
              calibrate_new_set(loaded, proto, crops(), examples(), negatives, threshold=0.7, samples=SAMPLES + 4,
                                verifier=verifier)]
    for other in others:
        assert json.loads(json.dumps(other.calibration)) != made.calibration


def test_a_new_set_asked_for_with_a_threshold_only_is_fit_on_its_crops(api, local, worker_ctx):
    """An API of an earlier version sends a threshold without examples or negatives: the fit on the crops alone."""
    payload = {"bundle": "test-digits", "explicit": True, "threshold": 0.6,
               "crops": [encode_image(c) for c in crops()]}
    out = on_worker.prototype(worker_ctx, json.loads(json.dumps(payload)))
    loaded = local.bundles.get("test-digits")
    want = calibrate_new_set(loaded, loaded.localizer.prototype(crops()), crops(), [], [], threshold=0.6,
                             samples=SAMPLES, verifier=local.bundles.verifier("test-digits"))
    assert out["calibration"] == json.loads(json.dumps(want.calibration))
    assert (out["negatives"], out["num_negatives"]) == (None, 0)


def test_a_new_sets_bundle_is_refused_as_local_mode_refuses_it(api):
    with pytest.raises(InferenceRefused) as e:
        api.prototype("nope", crops(), explicit=True)
    unknown = "unknown bundle 'nope'; available: ['broken', 'test-digits', 'test-other']"
    assert refused(e) == (422, unknown)
    with pytest.raises(InferenceRefused) as e:
        api.prototype("nope", crops(), explicit=False, threshold=0.5)
    assert refused(e) == (503, f"default bundle unavailable: {unknown}")
    for explicit in (True, False):
        with pytest.raises(InferenceRefused) as e:
            api.prototype("broken", crops(), explicit=explicit)
        assert refused(e) == (503, "bundle 'broken' cannot be loaded")


def test_get_bundle_refuses_as_the_route_does(worker_ctx):
    assert on_worker.get_bundle(worker_ctx.bundles, "test-other", explicit=True).name == "test-other"
    with pytest.raises(InferenceRefused) as e:
        on_worker.get_bundle(worker_ctx.bundles, "nope", explicit=True)
    assert e.value.status_code == 422 and e.value.headers is None
    with pytest.raises(InferenceRefused) as e:
        on_worker.get_bundle(worker_ctx.bundles, "broken", explicit=False)
    assert refused(e) == (503, "bundle 'broken' cannot be loaded")


def a_call(local: LocalInference, name: str, **kw) -> LocalizeCall:  # type: ignore[no-untyped-def]
    proto = proto_of(local, name, crops())
    loaded = local.bundles.get(name)
    values = dict(bundle=name, bundle_sha256=loaded.sha256, prototype_dim=int(proto.numel()),
                  prototype=prototype_to_bytes(proto), checkpoint=None,
                  images=[image(126, 100, 8), image(84, 84, 9), image(60, 168, 10, "RGB")])
    return LocalizeCall(**(values | kw))


def test_negatives_confidence_on_the_worker_is_local_modes(api, local):
    """Boxes ``[n, K, 4]`` in the pixels of images of three sizes -> the confidences local mode computes with a
    set's negatives' fit (a known one: d_n / (d_p + d_n), no two boxes alike by chance)."""
    call = a_call(local, "test-digits")
    loaded = local.bundles.get("test-digits")
    negatives = loaded.localizer.embed_crops([pil_to_tensor(image(22, 22, 6 + i), 1, (0.0,)) for i in range(3)])
    raw = prototype_to_bytes(negatives.cpu())
    ratio = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0),
                        PlattFit(["log_score", "log_ratio"], [0.0, 0.0], [1.0, 1.0], [0.0, -1.0], 0.0))
    boxes = torch.tensor([[[10, 10, 60, 50], [0, 0, 126, 100]], [[5, 5, 40, 40], [20, 30, 80, 84]],
                          [[0, 20, 60, 100], [10, 100, 50, 160]]], dtype=torch.float32)
    got = api.negatives_confidence(call, raw, ratio.to_dict(), call.images, boxes)
    with torch.inference_mode():
        want = local_negatives_confidence(loaded, call.prototype, raw, ratio, call.images, boxes)
    assert got.shape == (3, 2) and torch.allclose(got, want.float(), atol=1e-6)
    assert len(set(got.flatten().tolist())) == 6
    # boxes of whole pixels as JSON integers (a client of the task's own): read as the same boxes
    payload = json.loads(json.dumps(api.celery.last_payload))
    payload["boxes"] = boxes.int().tolist()
    assert torch.allclose(torch.tensor(on_worker.negatives_confidence(api.celery.ctx, payload)["confidence"]), got,
                          atol=1e-6)
    for bad, detail in ((replace(call, bundle_sha256="0" * 64), "was replaced"),
                        (replace(call, prototype_dim=7), "dimension 7")):
        with pytest.raises(InferenceRefused) as e:
            api.negatives_confidence(bad, raw, ratio.to_dict(), call.images, boxes)
        assert e.value.status_code == 409 and detail in e.value.detail, e.value.detail
    with pytest.raises(InferenceRefused) as e:
        api.negatives_confidence(replace(call, bundle="gone"), raw, ratio.to_dict(), call.images, boxes)
    assert e.value.status_code == 503 and e.value.detail.startswith("the set's bundle unavailable: ")


def test_a_bundle_check_passes_for_the_installed_file_only(api, local):
    sha = local.bundles.get("test-digits").sha256
    dim = local.bundles.get("test-digits").bundle.prototype_dim
    assert api.check_bundle("test-digits", sha256=sha, prototype_dim=dim) is None
    assert on_worker.check_bundle(api.celery.ctx, {"bundle": "test-digits", "bundle_sha256": sha,
                                                   "prototype_dim": dim}) == {"ok": True}
    assert api.check_bundle("test-digits", sha256=None, prototype_dim=dim) is None
    for name, s, d, status, part in (("test-digits", "0" * 64, dim, 409, "was replaced"),
                                     ("test-digits", sha, dim + 1, 409, f"dimension {dim + 1}"),
                                     ("gone", None, dim, 503, "the set's bundle unavailable"),
                                     ("broken", None, dim, 503, "bundle 'broken' cannot be loaded")):
        with pytest.raises(InferenceRefused) as e:
            api.check_bundle(name, sha256=s, prototype_dim=d)
        assert e.value.status_code == status and part in e.value.detail, (name, e.value.detail)


def test_a_localize_call_on_the_worker_is_answered_as_local_mode_answers_it(api, local, worker_ctx):
    call = a_call(local, "test-other", trajectory=True, max_instances=3, extra_boxes=[(1.0, 2.0, 30.0, 40.0), None,
                                                                                      None])
    got, want = api.localize(call), local.localize(call)
    assert len(got.results) == 3 and got.nearest == want.nearest
    for a, b in zip(got.results, want.results, strict=True):
        assert a.box == pytest.approx(b.box, abs=1e-4) and a.score == pytest.approx(b.score, abs=1e-5)
        assert torch.allclose(torch.tensor(a.trajectory), torch.tensor(b.trajectory), atol=1e-4)
        assert torch.allclose(torch.tensor([i.box for i in a.instances]), torch.tensor([i.box for i in b.instances]),
                              atol=1e-4)
    out = on_worker.localize(worker_ctx, json.loads(json.dumps(encode_call(replace(call, bundle_sha256="0" * 64)))))
    assert set(out) == {"refused"} and out["refused"]["status"] == 409
    assert "was replaced" in out["refused"]["detail"]
    assert decode_answer(on_worker.localize(worker_ctx, json.loads(json.dumps(encode_call(call))))).results


def test_the_worker_runs_calls_on_one_batched_backend_per_process_on_its_settings(bundles_here, tmp_path, monkeypatch):
    """On the worker's settings, episodes compiled as the API compiles them (``app.warmup``: every bundle loaded from
    now on; none is loaded yet here, so nothing compiles)."""
    settings = make_test_settings(tmp_path, bundles_here, batch_window_ms=250, batch_max_images=5,
                                  inference_queue_images=11, localize_nearest=True, compile_episode=True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))  # the deployment's: left as set
    ctx = WorkerContext.create(settings)
    backends: list = []
    monkeypatch.setattr(on_worker, "_backends", {})  # (this process's, of the module's context, left as it is)
    try:
        assert ctx.bundles.on_load is None
        backend = on_worker.inference(ctx)
        assert isinstance(ctx.bundles.on_load, warmup.EpisodeWarmup)
        backends.append(backend)
        b = backend.batcher
        assert (b.window_s, b.max_batch, b.max_queue) == (0.25, 5, 11)
        assert backend.default_nearest is None  # the API applied its own QLOC_LOCALIZE_NEAREST
        assert backend.retry_after_s == int(on_worker.RETRY_AFTER) and backend.bundles is ctx.bundles
        assert backend.store is ctx.store
        assert on_worker.inference(ctx) is backend  # one per process
        monkeypatch.setattr(on_worker.os, "getpid", lambda: -12345)  # a forked child: its own
        child = on_worker.inference(ctx)
        backends.append(child)
        assert child is not backend and on_worker.inference(ctx) is child
    finally:
        for b in backends:
            b.close()
        ctx.engine.dispose()

