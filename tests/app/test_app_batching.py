"""Batching across requests (``app.batching.Batcher``, ``app.serving.BatchedInference``) and the bound on
waiting inference work (503 + ``Retry-After``).

Concurrency is real (threads, the real engine thread, real HTTP through the app); the engine is held with
an ``Event`` where a test needs calls to pile up, so no assertion depends on timing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from service_fixtures import files, png_bytes

from app.batching import Batcher, BatcherClosed, QueueFull
from app.inference import BundleRegistry, prototype_to_bytes
from app.main import create_app
from app.serving import BatchedInference, LocalInference, LocalizeCall
from app.storage import BlobStore


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (a state reached by other threads); fail after ``timeout``: a hang, not a timing check."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


class HeldEngine:
    """A ``run`` for ``Batcher`` that records its batches and blocks the first one until ``release``."""

    def __init__(self, hold_first: bool = True):
        self.batches: list[tuple[object, list]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, key, items):
        self.batches.append((key, list(items)))
        self.started.set()
        self.release.wait(30)
        return [f"{key}:{x}" for x in items]


# --- Batcher


def test_calls_that_arrive_while_a_batch_runs_run_together_by_key_in_order():
    run = HeldEngine()
    b = Batcher(run, max_batch=8, max_queue=100)
    first = b.submit("a", 0)
    assert run.started.wait(30)  # the engine was idle: the first call ran at once, alone
    later = [b.submit("a", 1), b.submit("b", 2), b.submit("a", 3, size=2), b.submit("b", 4)]
    assert b.waiting == 5
    run.release.set()
    assert [f.result(30) for f in [first, *later]] == ["a:0", "a:1", "b:2", "a:3", "b:4"]
    assert [(k, items) for k, items in run.batches] == [("a", [0]), ("a", [1, 3]), ("b", [2, 4])]
    assert (b.stats.batches, b.stats.items, b.stats.size, b.stats.largest) == (3, 5, 6, 3)
    assert b.waiting == 0
    b.close()


def test_a_batch_stops_at_max_batch_and_the_rest_runs_next():
    run = HeldEngine()
    b = Batcher(run, max_batch=3, max_queue=100)
    b.submit("k", "x")
    assert run.started.wait(30)
    fs = [b.submit("k", i, size=s) for i, s in enumerate([2, 2, 1, 5])]
    run.release.set()
    for f in fs:
        f.result(30)
    # first come, first served: 2 fits, the next 2 would pass 3, the 1 fits; the 5 (over max_batch) runs whole
    assert [items for _, items in run.batches[1:]] == [[0, 2], [1], [3]]
    b.close()


def test_a_full_waiting_room_refuses_at_once_and_takes_calls_again_once_drained():
    run = HeldEngine()
    b = Batcher(run, max_batch=64, max_queue=4)
    running = b.submit("k", "running", size=50)  # larger than the room: taken since nothing waits
    assert run.started.wait(30)
    waiting = [b.submit("k", 1, size=3), b.submit("k", 2, size=1)]
    assert b.waiting == 4
    with pytest.raises(QueueFull, match="4 waiting, at most 4"):
        b.submit("k", 3)
    with pytest.raises(QueueFull):
        b.submit("other", 3)
    assert b.stats.refused == 2
    run.release.set()
    assert running.result(30) == "k:running" and [f.result(30) for f in waiting] == ["k:1", "k:2"]
    assert b.submit("k", 4, size=4).result(30) == "k:4"
    b.close()


def test_a_failing_batch_fails_its_callers_only_and_the_engine_goes_on():
    def run(key, items):
        if key == "boom":
            raise RuntimeError("model exploded")
        return [ValueError(f"bad {x}") if x < 0 else x * 10 for x in items]

    b = Batcher(run)
    with pytest.raises(RuntimeError, match="model exploded"):
        b("boom", 1)
    bad, good = b.submit("k", -1), b.submit("k", 2)
    with pytest.raises(ValueError, match="bad -1"):
        bad.result(30)
    assert good.result(30) == 20
    assert b("k", 3) == 30
    b.close()


def test_run_must_answer_one_result_per_item():
    b = Batcher(lambda key, items: [])
    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        b("k", 0)
    b.close()


def test_close_answers_what_waits_then_refuses():
    run = HeldEngine()
    b = Batcher(run)
    first = b.submit("k", 1)
    assert run.started.wait(30)
    second = b.submit("k", 2)
    closer = threading.Thread(target=b.close)
    closer.start()
    wait_until(lambda: b._closed, "close")
    with pytest.raises(BatcherClosed):
        b.submit("k", 3)
    run.release.set()
    closer.join(30)
    assert (first.result(30), second.result(30)) == ("k:1", "k:2")
    assert not b._thread.is_alive()


def test_a_window_holds_an_idle_engines_first_call_until_the_batch_is_full():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, window_s=60.0, max_batch=2)  # a full batch goes at once, whatever the window
    f1 = b.submit("k", 1)
    f2 = b.submit("k", 2)
    assert (f1.result(30), f2.result(30)) == ("k:1", "k:2")
    assert [items for _, items in run.batches] == [[1, 2]]
    b.close()


def test_an_idle_engine_holds_its_batch_for_calls_on_their_way_and_a_lone_call_runs_at_once():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, gather_s=60.0, max_batch=8)
    assert b.submit("k", 0).result(30) == "k:0"  # nothing on its way: at once, whatever gather_s
    on_its_way = b.expect()
    first = b.submit("k", 1)
    time.sleep(0.05)  # the engine is idle and awake: without the expectation it would take call 1 now
    assert b.waiting == 1 and b.coming == 1
    second = b.submit("k", 2, expected=on_its_way)  # it arrives: the engine goes, both in one batch
    assert (first.result(30), second.result(30)) == ("k:1", "k:2")
    assert b.coming == 0 and [items for _, items in run.batches] == [[0], [1, 2]]
    with b.expect():  # one that never comes (its request failed): its end lets the engine go
        third = b.submit("k", 3)
        time.sleep(0.05)
        assert b.waiting == 1
    assert third.result(30) == "k:3" and b.coming == 0
    b.close()


def test_calls_on_their_way_hold_the_batch_no_longer_than_gather_s_after_the_oldest():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, gather_s=0.05)
    on_its_way = b.expect()  # never submitted
    f = b.submit("k", 1)
    assert f.result(30) == "k:1" and b.coming == 1  # ran after gather_s, not after 30 s
    on_its_way.done()
    on_its_way.done()  # once
    assert b.coming == 0
    b.close()


def test_each_batch_is_observed_as_it_begins_and_a_failing_observer_stops_nothing():
    seen = []

    def observe(size, waits):
        seen.append((size, len(waits), all(w >= 0 for w in waits)))
        raise RuntimeError("the metrics are down")

    run = HeldEngine()
    b = Batcher(run, max_batch=8, max_queue=100, observe=observe)
    first = b.submit("a", 0)
    assert run.started.wait(30)
    later = [b.submit("a", 1, size=2), b.submit("a", 2)]
    run.release.set()
    assert [f.result(30) for f in [first, *later]] == ["a:0", "a:1", "a:2"]
    assert seen == [(1, 1, True), (3, 2, True)]  # sizes in images, one wait per call
    b.close()


def test_settings_are_checked():
    with pytest.raises(ValueError):
        Batcher(lambda k, i: i, max_batch=0)
    with pytest.raises(ValueError):
        Batcher(lambda k, i: i, window_s=-1)
    with pytest.raises(ValueError):
        Batcher(lambda k, i: i, gather_s=-1)


def test_batcher_bounds_of_one_are_valid_and_zero_is_refused_with_the_reason():
    one = Batcher(lambda k, items: items, max_batch=1, max_queue=1)  # one call at a time, one waiting
    assert one("k", 5) == 5
    one.close()
    for bad in (dict(max_batch=0), dict(max_queue=0), dict(window_s=-0.1), dict(gather_s=-0.1)):
        with pytest.raises(ValueError, match=r"^window_s and gather_s must be >= 0, max_batch and max_queue >= 1$"):
            Batcher(lambda k, items: items, **bad)


def test_batcher_defaults_run_a_lone_call_at_once_in_batches_of_64_with_256_waiting():
    """The defaults the module documents: no window and no gather hold (a lone call runs at once), 64 items a batch,
    256 waiting, the engine thread named ``qloc-batcher``."""
    b = Batcher(HeldEngine(hold_first=False))
    assert (b.window_s, b.gather_s, b.max_batch, b.max_queue, b.name) == (0.0, 0.0, 64, 256, "qloc-batcher")
    assert b("k", 1) == "k:1" and b._thread.name == "qloc-batcher"
    b.close()


def test_batcher_engine_thread_bears_its_name_and_does_not_keep_the_process_alive():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, name="qloc-test-engine")
    assert b("k", 1, size=3) == "k:1" and b.stats.size == 3  # the call's size is the item's
    assert b("k", 2) == "k:2" and b.stats.size == 4  # 1 by default
    assert b._thread.name == "qloc-test-engine" and b._thread.daemon
    b.close()
    with pytest.raises(BatcherClosed, match="qloc-test-engine is closed"):
        b.submit("k", 3)


def test_batcher_counts_every_call_on_its_way():
    b = Batcher(lambda k, items: items)
    first, second = b.expect(), b.expect()
    assert b.coming == 2
    first.done()
    assert b.coming == 1
    second.done()
    assert b.coming == 0
    b.close()


def test_batcher_close_waits_for_the_engine_up_to_its_timeout_and_a_fresh_one_closes_at_once():
    Batcher(lambda k, items: items).close()  # never started: no engine to wait for
    run = HeldEngine()
    b = Batcher(run)
    f = b.submit("k", 1)
    assert run.started.wait(30)
    t0 = time.monotonic()
    b.close(timeout=0.2)  # the engine is held: close gives up waiting after its timeout
    assert 0.15 <= time.monotonic() - t0 < 20 and b._thread.is_alive()
    run.release.set()
    assert f.result(30) == "k:1"
    b._thread.join(30)
    def slow_run(key, items):
        time.sleep(0.3)
        return [f"{key}:{x}" for x in items]

    slow = Batcher(slow_run)
    g = slow.submit("k", 2)
    slow.close()  # waits for the engine: the call is answered when close returns
    assert g.done() and g.result() == "k:2" and not slow._thread.is_alive()


def test_batcher_window_holds_a_lone_call_at_least_that_long():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, window_s=0.3, max_batch=8)
    t0 = time.monotonic()
    assert b.submit("k", 1).result(30) == "k:1"
    assert time.monotonic() - t0 >= 0.25  # held for company (a slow machine only holds it longer)
    b.close()


def test_batcher_gather_holds_the_first_call_for_one_on_its_way_until_it_arrives():
    run = HeldEngine(hold_first=False)
    b = Batcher(run, gather_s=1.0, max_batch=8)  # 1 s: a hold of a second or less holds too
    on_its_way = b.expect()
    first = b.submit("k", 1)
    time.sleep(0.1)
    assert not run.batches  # still held for the call on its way
    second = b.submit("k", 2, expected=on_its_way)
    assert (first.result(30), second.result(30)) == ("k:1", "k:2")
    assert [items for _, items in run.batches] == [[1, 2]]
    b.close()


def test_batcher_goes_on_after_a_batch_whose_calls_were_all_cancelled():
    run = HeldEngine()
    b = Batcher(run, max_batch=8)
    first = b.submit("a", 1)
    assert run.started.wait(30)
    gone = b.submit("b", 2)  # its own batch, next
    later = b.submit("c", 3)
    assert gone.cancel()
    run.release.set()
    assert first.result(30) == "a:1" and later.result(30) == "c:3"
    assert [k for k, _ in run.batches] == ["a", "c"]  # the cancelled call never ran
    b.close()


def test_batcher_observes_each_calls_wait_in_seconds():
    seen = []
    run = HeldEngine()
    b = Batcher(run, observe=lambda size, waits: seen.append(waits))
    first = b.submit("k", 1)
    assert run.started.wait(30)
    second = b.submit("k", 2)
    time.sleep(0.1)
    run.release.set()
    assert (first.result(30), second.result(30)) == ("k:1", "k:2")
    assert 0 <= seen[0][0] < 10 and 0.09 <= seen[1][0] < 10  # the second waited for the first batch
    b.close()


# --- BatchedInference


class HeldInference(BatchedInference):
    """The real backend, its engine held on its first batch until ``release``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started, self.release = threading.Event(), threading.Event()
        self.batch_calls: list[int] = []

    def run_batch(self, key, calls):
        self.batch_calls.append(len(calls))
        self.started.set()
        self.release.wait(30)
        return super().run_batch(key, calls)


def make_call(loaded, seed, n=2, **options):
    crops = [pil_image(png_bytes(28, 28, seed=seed + 100))]
    proto = loaded.localizer.prototype(crops)
    ims = [pil_image(png_bytes(84 + 10 * (i % 2), 84, seed=seed * 10 + i)) for i in range(n)]
    return LocalizeCall(bundle=loaded.name, bundle_sha256=loaded.sha256, prototype_dim=int(proto.numel()),
                        prototype=prototype_to_bytes(proto), checkpoint=None, images=ims, **options)


def pil_image(data):
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def toy_verifier(monkeypatch, spec, template_seed):
    """A small known-kinds verifier (random weights, kinds "a" and "b") served as every bundle's, and templates of
    three random crops on the bundle's input -> (verifier, templates)."""
    import torch

    from app.inference import BundleRegistry
    from models.core.templates import Templates
    from models.verifier import KindVerifier

    torch.manual_seed(0)
    v = KindVerifier(1, ["a", "b", "background"]).freeze()
    v.sha256 = "engine test"
    monkeypatch.setattr(BundleRegistry, "verifier", lambda self, name: v)
    g = torch.Generator().manual_seed(template_seed)
    t = Templates((torch.rand(3, 1, 16, 16, generator=g) * 255).round() / 255, None, spec.size, spec.channels,
                  tuple(spec.fill))
    return v, t


def toy_check(seed, sha="engine test"):
    """A set's check of kind "a" against ``toy_verifier`` (``sha``: the verifier file it was made with)."""
    import torch

    from models.verifier import KindCheck

    r = torch.nn.functional.normalize(torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return KindCheck(r[0].tolist(), r[1:].tolist(), "a", 0.99, sha)


def looked_as_alone(local, call, answer, doubtful):
    """``answer`` (``call`` with a second look) has the boxes of ``call`` run alone, and on its ``doubtful`` images
    the candidates a ``max_instances=RERANK_CANDIDATES`` call of its own finds."""
    import dataclasses

    from app.calibration import RERANK_CANDIDATES

    alone = local.localize(dataclasses.replace(call, second_look=None, max_instances=RERANK_CANDIDATES))
    for got, want, d in zip(answer.results, alone.results, doubtful, strict=True):
        assert got.box == pytest.approx(want.box, abs=1e-3)
        if d:
            assert [x for i in got.instances for x in i.box] == pytest.approx(
                [x for i in want.instances for x in i.box], abs=1e-3)


def queued_behind_a_held_batch(held, loaded, calls):
    """``calls`` submitted from threads of their own while the engine holds a first batch, so that they wait together;
    then the engine released -> their answers."""
    with ThreadPoolExecutor(len(calls) + 1) as pool:
        blocker = pool.submit(held.localize, make_call(loaded, 99, n=1))
        assert held.started.wait(30)
        futures = [pool.submit(held.localize, c) for c in calls]
        wait_until(lambda: held.batcher.waiting == sum(len(c.images) for c in calls), "the calls to queue")
        held.release.set()
        answers = [f.result(60) for f in futures]
        blocker.result(60)
    return answers


@pytest.fixture
def backends(settings):
    bundles = BundleRegistry(settings.bundle_dir, "cpu")
    store = BlobStore(settings.storage_dir)
    held = HeldInference(bundles, store, max_batch_images=64, max_queue_images=64)
    yield bundles, LocalInference(bundles, store), held
    held.release.set()
    held.close()


def test_concurrent_calls_of_different_sets_run_as_one_forward_and_answer_as_run_one_by_one(backends, settings):
    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    calls = [make_call(loaded, s, n=1 + s % 3, trajectory=s % 2 == 0) for s in range(6)]
    answers = queued_behind_a_held_batch(held, loaded, calls)
    assert held.batch_calls == [1, len(calls)]  # the six calls (three prototypes' worth of sets): one forward
    for call, answer in zip(calls, answers, strict=True):
        alone = local.localize(call)
        assert answer.nearest == alone.nearest
        assert len(answer.results) == len(call.images)
        for b, a in zip(answer.results, alone.results, strict=True):
            assert b.box == pytest.approx(a.box, abs=1e-3) and b.score == pytest.approx(a.score, rel=1e-4)
            assert (b.trajectory is None) == (not call.trajectory)
            if call.trajectory:
                assert b.trajectory == [pytest.approx(t, abs=1e-3) for t in a.trajectory]


def test_calls_that_differ_in_computation_do_not_share_a_forward(backends, settings):
    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    calls = [make_call(loaded, 1), make_call(loaded, 2, nearest=True), make_call(loaded, 3, samples=2),
             make_call(loaded, 4, samples=2), make_call(loaded, 5)]
    answers = queued_behind_a_held_batch(held, loaded, calls)
    # greedy last-box calls 1 and 5 together; nearest alone; each best-of-N search alone (its random stream)
    assert sorted(held.batch_calls) == [1, 1, 1, 1, 2]
    for call, answer in zip(calls, answers, strict=True):
        alone = local.localize(call)
        assert [r.box for r in answer.results] == [pytest.approx(r.box, abs=1e-3) for r in alone.results]
        assert answer.nearest == alone.nearest


def test_the_agent_is_built_once_per_bundle_file_and_checkpoint(backends, settings):
    bundles, local, _ = backends
    loaded = bundles.get(settings.default_bundle)
    assert local.served(loaded, None) is local.served(loaded, None)
    assert not local.served(loaded, None).agent.training


# --- through HTTP


@pytest.fixture
def held_api(settings):
    s = settings.model_copy(update={"inference_queue_images": 3, "max_files_per_request": 4})
    app = create_app(s)
    with TestClient(app) as c:
        held = HeldInference(app.state.bundles, app.state.store, max_queue_images=3)
        app.state.inference = held
        yield c, held
        held.release.set()
        held.close()


def test_a_full_inference_queue_answers_503_with_retry_after_at_once(held_api):
    c, held = held_api
    set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(c.post, url, files=files(png_bytes(seed=1)))
        assert held.started.wait(30)
        queued = pool.submit(c.post, url, files=files(png_bytes(seed=2), png_bytes(seed=3)))
        wait_until(lambda: held.batcher.waiting == 2, "the second request to queue")
        # 2 images wait; 2 more would pass the bound of 3: refused now, while the engine is still held
        r = c.post(url, files=files(png_bytes(seed=4), png_bytes(seed=5)))
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "busy" in r.json()["detail"] and "retry" in r.json()["detail"]
        assert not held.release.is_set()
        one = pool.submit(c.post, url, files=files(png_bytes(seed=6)))  # 1 more fits: it waits its turn
        wait_until(lambda: held.batcher.waiting == 3, "the third request to queue")
        held.release.set()
        assert [f.result(60).status_code for f in (running, queued, one)] == [200, 200, 200]
    assert [len(x["results"]) for x in (queued.result().json(), one.result().json())] == [2, 1]
    assert held.batch_calls == [1, 2]  # the two waiting requests ran as one forward
    r = c.post(url, files=files(png_bytes(seed=4), png_bytes(seed=5)))  # drained: taken again
    assert r.status_code == 200


def test_a_request_is_on_its_way_to_the_engine_until_it_submits_and_a_refused_one_leaves_nothing(held_api,
                                                                                                 monkeypatch):
    from app.routes import localize

    c, held = held_api
    seen = []
    real_read = localize.read_images

    def read_images(*args, **kwargs):  # decoding: the request has not reached the engine yet
        seen.append(held.batcher.coming)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(localize, "read_images", read_images)
    set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
    url = f"/v1/exemplar-sets/{set_id}/localize"
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(c.post, url, files=files(png_bytes(seed=1)))
        assert held.started.wait(30)
        assert seen == [1] and held.batcher.coming == 0  # submitted: it waits for its answer, no longer on its way
        assert c.post(f"/v1/exemplar-sets/{'0' * 32}/localize", files=files(png_bytes())).status_code == 404
        assert c.post(url, files=[("files", ("x.png", b"not an image", "image/png"))]).status_code == 415
        queued = pool.submit(c.post, url, files=files(png_bytes(seed=2), png_bytes(seed=3)))
        wait_until(lambda: held.batcher.waiting == 2, "the second request to queue")
        assert c.post(url, files=files(png_bytes(seed=4), png_bytes(seed=5))).status_code == 503  # refused: full
        assert held.batcher.coming == 0
        held.release.set()
        assert [f.result(60).status_code for f in (running, queued)] == [200, 200]
    assert held.batcher.coming == 0 and seen == [1, 1, 1, 1]


def test_the_app_batches_by_default_and_stops_its_engine_on_shutdown(settings):
    app = create_app(settings)
    with TestClient(app) as c:
        assert isinstance(app.state.inference, BatchedInference)
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        url = f"/v1/exemplar-sets/{set_id}/localize"
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda i: c.post(url, files=files(png_bytes(seed=i))), range(16)))
        assert [r.status_code for r in rs] == [200] * 16
        for i, r in enumerate(rs[:3]):  # batched or alone: the same answers
            alone = c.post(url, files=files(png_bytes(seed=i))).json()["results"][0]
            got = r.json()["results"][0]
            assert got["box"] == pytest.approx(alone["box"], abs=1e-3)
            assert got["score"] == pytest.approx(alone["score"], rel=1e-4)
        engine = app.state.inference.batcher._thread
        assert engine.is_alive() and app.state.inference.batcher.stats.items == 19
    assert not engine.is_alive()


def test_localize_takes_turns_for_its_own_work_not_while_it_waits_for_the_model(settings, monkeypatch):
    """QLOC_ROUTE_THREADS=1: the requests' verdicts never run at once, yet requests waiting for a held engine
    do not keep the next one from its turn (they queue for the model together, and run as one batch)."""
    from app.routes import localize

    active, most = [0], [0]
    lock = threading.Lock()
    real_judge = localize.judge

    def judge(*args, **kwargs):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.02)  # a wide window for another thread to enter, were turns not taken
        try:
            return real_judge(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(localize, "judge", judge)
    app = create_app(settings.model_copy(update={"route_threads": 1}))
    with TestClient(app) as c:
        held = HeldInference(app.state.bundles, app.state.store)
        app.state.inference = held
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        url = f"/v1/exemplar-sets/{set_id}/localize"
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(c.post, url, files=files(png_bytes(seed=1)))
            assert held.started.wait(30)
            rest = [pool.submit(c.post, url, files=files(png_bytes(seed=s))) for s in range(2, 7)]
            wait_until(lambda: held.batcher.waiting == 5, "the other requests to reach the model")
            held.release.set()
            assert [f.result(60).status_code for f in [first, *rest]] == [200] * 6
        held.close()
    assert held.batch_calls == [1, 5] and most[0] == 1


# --- API processes (scripts/run api)


def test_the_api_runs_one_process_per_core_by_default_and_fewer_for_a_model_on_cuda(monkeypatch):
    from app import config
    from app.config import Settings, api_processes

    monkeypatch.setattr(config, "usable_cores", lambda: 2)
    assert api_processes(Settings(device="cpu")) == 2  # the default: one per core
    assert api_processes(Settings(device="cpu", api_workers=3)) == 3  # as told
    assert api_processes(Settings(device="cuda")) == 2  # a GPU context per process, as many as the cores allow
    workers = Settings(device="cuda", inference="workers", result_backend="redis://127.0.0.1:6379/1")
    assert api_processes(workers) == 2  # the model runs on the localize workers
    monkeypatch.setattr(config, "usable_cores", lambda: 64)
    assert api_processes(Settings(device="cpu")) == config.AUTO_API_PROCESSES
    assert api_processes(Settings(device="cuda")) == config.GPU_API_PROCESSES < config.AUTO_API_PROCESSES


def test_the_run_script_asks_how_many_api_processes_to_start_and_whether_to_log_each_request():
    import os
    import subprocess
    import sys

    from service_fixtures import REPO

    from app.config import Settings, api_processes

    def ask(*names, **env):
        env = {k: v for k, v in os.environ.items() if k not in ("QLOC_API_WORKERS", "QLOC_ACCESS_LOG")} | env
        r = subprocess.run([sys.executable, "-m", "app.config", *names], cwd=REPO, capture_output=True, text=True,
                           env=env, timeout=60)
        return r.returncode, r.stdout.strip() or r.stderr

    assert ask("api-processes", QLOC_API_WORKERS="3") == (0, "3")
    assert ask("api-processes", QLOC_API_WORKERS="0", QLOC_DEVICE="cpu") == (
        0, str(api_processes(Settings(device="cpu"))))
    assert ask("api-processes", "access-log", QLOC_API_WORKERS="2") == (0, "2 --no-access-log")  # off by default
    assert ask("access-log", QLOC_ACCESS_LOG="true") == (0, "--access-log")
    code, err = ask("api-processes", "access-log", QLOC_ACCESS_LOG="loud")
    assert code != 0 and "access_log" in err  # a bad value stops scripts/run api, naming the setting
    assert ask("workers")[0] != 0


def test_the_engines_batches_and_waits_are_in_the_metrics(settings):
    app = create_app(settings)
    with TestClient(app) as c:
        set_id = c.post("/v1/exemplar-sets", files=files(png_bytes(28, 28))).json()["id"]
        url = f"/v1/exemplar-sets/{set_id}/localize"
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda i: c.post(url, files=files(*[png_bytes(seed=i)] * (1 + i % 2))), range(12)))
        assert [r.status_code for r in rs] == [200] * 12
        stats = app.state.inference.batcher.stats
        text = c.get("/metrics").text
    assert stats.items == 12 and stats.size == 18
    assert f"qloc_engine_batch_images_count {float(stats.batches)}" in text
    assert "qloc_engine_batch_images_sum 18.0" in text
    assert "qloc_engine_wait_seconds_count 12.0" in text


def test_the_engine_reads_each_sets_ncc_features_with_the_batch_as_the_verdict_would_read_them(backends, settings,
                                                                                               monkeypatch):
    """Calls carrying their calibration's templates get each answer's NCC features from the engine, one pass per
    set of templates across the batch's calls; the verdict on them equals the verdict that reads them itself."""
    import torch

    from app.calibration import judge
    from models.calibration import Calibration
    from models.core.platt import PlattFit
    from models.core.templates import Templates

    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    spec = loaded.localizer.spec
    g = torch.Generator().manual_seed(0)

    def grid(n: int) -> torch.Tensor:  # on the 8-bit grid templates are stored on: a stored copy reads the same
        return (torch.rand(n, spec.channels, 16, 16, generator=g) * 255).round() / 255

    def templates(negatives: bool, size: int = spec.size) -> Templates:
        return Templates(grid(3), grid(2) if negatives else None, size, spec.channels, tuple(spec.fill))

    a, b, other_size = templates(True), templates(False), templates(True, spec.size + 8)
    calls = [make_call(loaded, 1, n=2, templates=a, max_instances=3), make_call(loaded, 2, n=1, templates=b,
                                                                                 max_instances=3),
             make_call(loaded, 3, n=3, templates=a, max_instances=3), make_call(loaded, 4, n=1, max_instances=3),
             make_call(loaded, 5, n=1, templates=other_size, max_instances=3)]
    answers = queued_behind_a_held_batch(held, loaded, calls)
    assert held.batch_calls == [1, len(calls)]
    assert answers[3].ncc is None  # no templates
    assert answers[4].ncc is None  # templates read on another input size: the route reads them itself
    fit = PlattFit(["log_score", "ncc", "ncc_negatives"], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.3, 2.0, -1.5], 0.1)
    for call, answer in zip(calls[:3], answers[:3], strict=True):
        pos, neg = answer.ncc
        assert pos.shape[0] == len(call.images) and (neg is None) == (call.templates.negatives is None)
        assert any(r.instances for r in answer.results)
        calibration = Calibration(PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0), None, 0.5, {},
                                  PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.3, 2.0], 0.1),
                                  fit if neg is not None else None, call.templates).to_dict()
        options = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=call.prototype, negatives=None,
                       rerank="false")
        read_here = judge(answer.results, call.images, calibration, **options)
        engine = judge(answer.results, call.images, calibration, **options, ncc=answer.ncc)
        assert [j.confidence for j in engine] != [j.confidence for j in judge(
            answer.results, call.images, calibration, **options, ncc=(pos + 0.1, neg))]  # the features count
        assert [j.confidence for j in engine] == pytest.approx([j.confidence for j in read_here], abs=1e-9)
        for e, h in zip(engine, read_here, strict=True):
            assert [i.confidence for i in e.instances] == pytest.approx([i.confidence for i in h.instances],
                                                                        abs=1e-9)
    # where the model runs on a GPU, the engine leaves the CPU work to the request threads
    assert held.prepare(calls[0])[1].templates is calls[0].templates
    monkeypatch.setattr(loaded.localizer, "device", torch.device("cuda"))
    assert held.prepare(calls[0])[1].templates is None


def test_second_looks_of_concurrent_calls_are_taken_in_one_forward_for_the_doubtful_answers_only(backends, settings):
    """Calls with a ``SecondLook`` (``rerank=auto``) of two sets, one call of the first set without it and one without
    templates, queued together: one forward; each looking call's doubtful answers (their confidence, from the
    engine's features, under ``below``), and only those, carry the candidates a ``max_instances=4`` call finds for
    them alone; every call's features are those the verdict would read itself."""
    import dataclasses

    import torch

    from app.calibration import RERANK_CANDIDATES, judge
    from app.serving import SecondLook
    from models.calibration import Calibration
    from models.core.platt import PlattFit
    from models.core.templates import Templates

    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    spec = loaded.localizer.spec
    g = torch.Generator().manual_seed(1)

    def templates(negatives: bool) -> Templates:
        def grid(n: int) -> torch.Tensor:
            return (torch.rand(n, spec.channels, 16, 16, generator=g) * 255).round() / 255
        return Templates(grid(3), grid(2) if negatives else None, spec.size, spec.channels, tuple(spec.fill))

    def calibration(t: Templates) -> Calibration:
        score = PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0)
        ncc = PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.1, 6.0], 0.0)
        neg = PlattFit(["log_score", "ncc", "ncc_negatives"], [0.0] * 3, [1.0] * 3, [0.1, 6.0, -2.0], 0.0)
        return Calibration(score, None, 0.5, {}, ncc, neg if t.negatives is not None else None, t)

    ta, tb = templates(True), templates(False)
    ca, cb = calibration(ta), calibration(tb)
    plain = [make_call(loaded, 11, n=4, templates=ta), make_call(loaded, 12, n=3, templates=tb)]

    def confidences(call, answer, cal) -> list[float]:
        return [j.confidence for j in judge(answer.results, call.images, cal.to_dict(), threshold=0.5,
                                            min_confidence=None, loaded=None, prototype=call.prototype,
                                            negatives=None, ncc=answer.ncc)]

    # each looking set's bar: between its answers' confidences, so that some are doubtful and some not
    bars = []
    for call, cal in zip(plain, (ca, cb), strict=True):
        conf = sorted(confidences(call, local.localize(call), cal))
        assert conf[0] < conf[-1]
        bars.append((conf[0] + conf[1]) / 2 if len(conf) > 2 else (conf[0] + conf[-1]) / 2)
    looking = [dataclasses.replace(c, second_look=SecondLook(cal, bar, RERANK_CANDIDATES))
               for c, cal, bar in zip(plain, (ca, cb), bars, strict=True)]
    calls = [looking[0], looking[1], make_call(loaded, 11, n=2, templates=ta), make_call(loaded, 13, n=1)]
    answers = queued_behind_a_held_batch(held, loaded, calls)
    assert held.batch_calls == [1, len(calls)]
    assert [a.looked for a in answers] == [True, True, False, False]
    assert answers[3].ncc is None and all(r.instances is None for a in answers[2:] for r in a.results)
    for call, answer, cal, bar in zip(calls[:2], answers[:2], (ca, cb), bars, strict=True):
        conf = confidences(call, answer, cal)
        doubtful = [c < bar for c in conf]
        assert [r.instances is not None for r in answer.results] == doubtful and any(doubtful)
        looked_as_alone(local, call, answer, doubtful)
    for call, answer in zip(calls[:3], answers[:3], strict=True):  # the features are those read here
        cal = (ca if call.templates is ta else cb).to_dict()
        options = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=call.prototype, negatives=None,
                       rerank="false")
        engine = judge(answer.results, call.images, cal, **options, ncc=answer.ncc)
        read_here = judge(answer.results, call.images, cal, **options)
        assert [j.confidence for j in engine] == pytest.approx([j.confidence for j in read_here], abs=1e-9)
        for e, h in zip(engine, read_here, strict=True):
            assert (e.instances is None) == (h.instances is None)
            if e.instances is not None:
                assert [i.confidence for i in e.instances] == pytest.approx([i.confidence for i in h.instances],
                                                                            abs=1e-9)


def test_the_engine_reads_each_sets_kind_check_with_the_batch_as_the_verdict_would(backends, settings, monkeypatch):
    """Calls carrying a known-kinds check (``models.verifier``) get its probabilities from the engine, one verifier
    pass over every such call's boxes; the verdict on them equals the one that reads them itself. A check made with
    another verifier file is left to the route (which then serves the calibrated fit)."""
    import dataclasses

    from app.calibration import judge
    from models.calibration import Calibration
    from models.core.platt import PlattFit

    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    v, t = toy_verifier(monkeypatch, loaded.localizer.spec, 0)
    check = toy_check

    checks = [check(1), check(2), check(3, "another file")]
    calls = [make_call(loaded, 1, n=2, templates=t, kind=checks[0], max_instances=3),
             make_call(loaded, 2, n=1, templates=t, kind=checks[1], max_instances=3),
             make_call(loaded, 3, n=1, templates=t, kind=checks[2], max_instances=3),
             make_call(loaded, 4, n=1, templates=t, max_instances=3)]
    answers = queued_behind_a_held_batch(held, loaded, calls)
    assert held.batch_calls == [1, len(calls)]
    assert answers[2].kind is None and answers[3].kind is None
    for call, answer in zip(calls[:2], answers[:2], strict=True):
        assert answer.kind.shape[0] == len(call.images)
        calibration = Calibration(PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0), None, 0.5, {},
                                  PlattFit(["ncc"], [0.0], [1.0], [2.0], 0.1), None, call.templates, call.kind)
        options = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=call.prototype, negatives=None,
                       rerank="false", ncc=answer.ncc)
        engine = judge(answer.results, call.images, calibration.to_dict(), **options, kind=answer.kind, verifier=v)
        read_here = judge(answer.results, call.images, calibration.to_dict(), **options, verifier=v)
        fit_only = judge(answer.results, call.images, calibration.to_dict(), **options)  # no verifier: the fit
        assert [j.confidence for j in engine] == pytest.approx([j.confidence for j in read_here], abs=1e-9)
        assert [j.confidence for j in engine] != pytest.approx([j.confidence for j in fit_only], abs=1e-6)
        for e, h in zip(engine, read_here, strict=True):
            assert [i.confidence for i in e.instances] == pytest.approx([i.confidence for i in h.instances], abs=1e-9)
    other = dataclasses.replace(calls[2], kind=None)
    assert local.localize(other).kind is None


def test_the_engines_second_look_on_a_set_with_a_kind_check_needs_the_check_and_the_ncc_fit_to_doubt(
        backends, settings, monkeypatch):
    """A set of a kind the bundle's verifier knows is answered with the check's probabilities as confidences; the
    engine's second look takes an answer only where the check doubts it *and* the calibration's NCC fit does
    (``app.calibration.doubtful_by_pixels``: the check also doubts answers on images without the object): with an NCC
    fit that doubts everything, the doubtful answers are those under the bar by the check, each with the candidates
    a ``max_instances=4`` call finds for it; with one sure of everything, none. The probabilities the engine passes
    on (answers read once, then only the instances) equal those the verdict reads itself; no NCC features are
    passed on for such calls (the verdict does not read them)."""
    import dataclasses

    from app.calibration import RERANK_CANDIDATES, judge
    from app.serving import SecondLook
    from models.calibration import Calibration
    from models.core.platt import PlattFit

    bundles, local, held = backends
    loaded = bundles.get(settings.default_bundle)
    v, t = toy_verifier(monkeypatch, loaded.localizer.spec, 2)
    check = toy_check(5)

    def calibration(bias: float) -> Calibration:  # an NCC fit of the same confidence for every answer
        return Calibration(PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0), None, 0.5, {},
                           PlattFit(["ncc"], [0.0], [1.0], [0.0], bias), None, t, check)

    unsure, sure = calibration(-10.0), calibration(10.0)
    plain = make_call(loaded, 21, n=6, templates=t, kind=check)

    def verdicts(call, answer, **kw):
        return judge(answer.results, call.images, unsure.to_dict(), threshold=0.5, min_confidence=None, loaded=None,
                     prototype=call.prototype, negatives=None, rerank="false", verifier=v, **kw)

    conf = sorted(j.confidence for j in verdicts(plain, local.localize(plain)))
    assert conf[0] < conf[-1]
    bar = (conf[2] + conf[3]) / 2  # three doubtful by the check
    for cal, n_doubtful in ((unsure, 3), (sure, 0)):
        looking = dataclasses.replace(plain, second_look=SecondLook(cal, bar, RERANK_CANDIDATES))
        calls = [looking, make_call(loaded, 22, n=2, templates=t, kind=check, max_instances=1)]
        if cal is unsure:  # with another call, in one batch
            answers = queued_behind_a_held_batch(held, loaded, calls)
            assert held.batch_calls == [1, len(calls)]
        else:
            answers = [local.localize(c) for c in calls]
        answer = answers[0]
        assert answer.looked and answer.ncc is None and answers[1].ncc is None  # none passed on for the check's calls
        by_check = [j.confidence for j in verdicts(looking, answer)]
        doubtful = [c < bar and cal is unsure for c in by_check]
        assert sum(doubtful) == n_doubtful and [r.instances is not None for r in answer.results] == doubtful
        looked_as_alone(local, looking, answer, doubtful)
        engine = verdicts(looking, answer, kind=answer.kind)
        assert [j.confidence for j in engine] == pytest.approx(by_check, abs=1e-9)
        for e, h in zip(engine, verdicts(looking, answer), strict=True):
            assert (e.instances is None) == (h.instances is None)
            if e.instances is not None:
                assert [i.confidence for i in e.instances] == pytest.approx([i.confidence for i in h.instances],
                                                                            abs=1e-9)
