"""``app.serving`` by value: each way a set's bundle or checkpoint cannot be served, as the client reads it (status
and whole message), and what ``LocalInference.prepare`` resolves for a call -- the ``nearest`` that applies, which
calls may share a forward pass, and what the engine reads with the batch.

The batching itself, through threads and HTTP, is ``test_app_batching.py``'s."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from app import serving
from app.batching import BatcherClosed, QueueFull
from app.calibration import matched_windows
from app.inference import BundleMismatch, BundleRegistry, UnknownBundle, prototype_to_bytes
from app.serving import CheckpointRef, InferenceRefused, LocalInference, LocalizeCall, policy_state, resolve_bundle
from app.storage import BlobStore
from models.bundle import PolicyMismatch, Reward
from models.calibration import Calibration
from models.core.platt import PlattFit
from models.core.templates import Templates, make_templates, match_crops


class Registry:
    """``BundleRegistry``'s face for ``resolve_bundle`` / ``policy_state``: ``get`` raises ``error`` or answers a
    bundle of ``dim``; ``cached_policy`` records its keys."""

    def __init__(self, error: Exception | None = None, dim: int = 4):
        self.error, self.dim = error, dim
        self.asked: list[tuple[str, str | None]] = []
        self.keys: list = []

    def get(self, name: str, *, expect_sha256: str | None = None):  # type: ignore[no-untyped-def]
        self.asked.append((name, expect_sha256))
        if self.error is not None:
            raise self.error
        return SimpleNamespace(bundle=SimpleNamespace(prototype_dim=self.dim), sha256="0123456789abcdef" * 4)

    def cached_policy(self, key, load):  # type: ignore[no-untyped-def]
        self.keys.append(key)
        return load()


def test_a_refusal_reads_as_its_detail():
    e = InferenceRefused(409, "replaced", {"Retry-After": "1"})
    assert (str(e), e.status_code, e.detail, e.headers) == ("replaced", 409, "replaced", {"Retry-After": "1"})
    assert InferenceRefused(503, "busy").headers is None


def refusal(fn, *args, **kw) -> InferenceRefused:  # type: ignore[no-untyped-def]
    with pytest.raises(InferenceRefused) as e:
        fn(*args, **kw)
    return e.value


def test_a_sets_bundle_is_checked_and_each_failure_is_a_clear_refusal():
    reg = Registry()
    loaded = resolve_bundle(reg, "digits", sha256="s" * 64, prototype_dim=4)  # type: ignore[arg-type]
    assert loaded.bundle.prototype_dim == 4 and reg.asked == [("digits", "s" * 64)]
    assert resolve_bundle(Registry(dim=9), "digits", sha256=None, prototype_dim=None)  # type: ignore[arg-type]

    e = refusal(resolve_bundle, Registry(BundleMismatch("replaced: re-create the set")), "d", sha256="s",
                prototype_dim=4)
    assert (e.status_code, e.detail, e.headers) == (409, "replaced: re-create the set", None)
    e = refusal(resolve_bundle, Registry(UnknownBundle("'d' is not installed")), "d", sha256=None, prototype_dim=4)
    assert (e.status_code, e.detail) == (503, "the set's bundle unavailable: 'd' is not installed")
    for error in (OSError("disk"), ValueError("not a bundle"), RuntimeError("torch")):
        e = refusal(resolve_bundle, Registry(error), "d", sha256=None, prototype_dim=4)
        assert (e.status_code, e.detail) == (503, "bundle 'd' cannot be loaded")
    with pytest.raises(KeyError):  # anything else is a bug, not the client's: not dressed as a refusal
        resolve_bundle(Registry(KeyError("x")), "d", sha256=None, prototype_dim=4)  # type: ignore[arg-type]

    e = refusal(resolve_bundle, Registry(dim=8), "digits", sha256=None, prototype_dim=4)
    assert (e.status_code, e.detail) == (409, (
        "bundle 'digits' (sha256 0123456789ab) makes prototypes of dimension 8, but this exemplar set's prototype "
        "has dimension 4: it was made by another bundle file of that name. Re-create the exemplar set from its "
        "crops."))


class Store:
    def __init__(self, exists: bool):
        self._exists = exists
        self.asked: list[str] = []

    def exists(self, key: str) -> bool:
        self.asked.append(key)
        return self._exists


def test_a_checkpoints_policy_is_read_once_per_bundle_file_and_each_failure_is_a_clear_refusal(monkeypatch):
    ckpt = CheckpointRef(uuid.uuid4(), "ck/a.pt", "c" * 64)
    loaded = Registry().get("d")
    reads = []

    def read(store, *, blob, sha256, bundle, source):  # type: ignore[no-untyped-def]
        reads.append((store, blob, sha256, bundle, source))
        return {"w": torch.ones(1)}, "reward"

    monkeypatch.setattr(serving, "read_served_checkpoint", read)
    reg, store = Registry(), Store(True)
    assert policy_state(reg, store, None, loaded) == (None, None) and reg.keys == [] and reads == []  # type: ignore[arg-type]
    state, reward = policy_state(reg, store, ckpt, loaded)  # type: ignore[arg-type]
    assert reward == "reward" and torch.equal(state["w"], torch.ones(1))
    assert reg.keys == [(ckpt.id, loaded.sha256)]
    assert reads == [(store, "ck/a.pt", "c" * 64, loaded.bundle, f"checkpoint {ckpt.id}")]

    def failing(error):  # type: ignore[no-untyped-def]
        def read_(*a, **k):  # type: ignore[no-untyped-def]
            raise error
        return read_

    monkeypatch.setattr(serving, "read_served_checkpoint", failing(PolicyMismatch("written for bundle 'x'")))
    e = refusal(policy_state, Registry(), store, ckpt, loaded)
    assert (e.status_code, e.detail) == (409, "written for bundle 'x'; localize with checkpoint=base, or re-create "
                                              "the exemplar set from its crops")
    monkeypatch.setattr(serving, "read_served_checkpoint", failing(FileNotFoundError("ck/a.pt")))
    gone = Store(False)
    e = refusal(policy_state, Registry(), gone, ckpt, loaded)
    assert (e.status_code, e.detail) == (404, f"checkpoint {ckpt.id} not found: it was deleted")
    assert gone.asked == ["ck/a.pt"]
    e = refusal(policy_state, Registry(), Store(True), ckpt, loaded)  # the file is there, a part of it is not
    assert (e.status_code, e.detail) == (503, f"checkpoint {ckpt.id} cannot be read")
    for error in (OSError("io"), ValueError("digest")):
        monkeypatch.setattr(serving, "read_served_checkpoint", failing(error))
        e = refusal(policy_state, Registry(), store, ckpt, loaded)
        assert (e.status_code, e.detail) == (503, f"checkpoint {ckpt.id} cannot be read")


@pytest.fixture(scope="module")
def local(bundle_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    bundles = BundleRegistry(bundle_dir, device="cpu")
    return LocalInference(bundles, BlobStore(tmp_path_factory.mktemp("blobs")))


def make_call(local: LocalInference, **kw) -> LocalizeCall:  # type: ignore[no-untyped-def]
    from service_fixtures import TEST_BUNDLES

    loaded = local.bundles.get(TEST_BUNDLES[0])
    values = dict(bundle=TEST_BUNDLES[0], bundle_sha256=loaded.sha256, prototype_dim=loaded.bundle.prototype_dim,
                  prototype=prototype_to_bytes(torch.ones(loaded.bundle.prototype_dim)), checkpoint=None,
                  images=[Image.new("L", (168, 84), 30), Image.new("L", (84, 42), 200)])
    return LocalizeCall(**(values | kw))


def test_what_serves_a_checkpoint_is_built_once_per_bundle_file_and_checkpoint(local, monkeypatch):
    built = []

    def state(bundles, store, ckpt, loaded):  # type: ignore[no-untyped-def]
        built.append(None if ckpt is None else ckpt.id)
        return None, None

    monkeypatch.setattr(serving, "policy_state", state)
    backend = LocalInference(local.bundles, local.store)
    loaded = local.bundles.get(make_call(local).bundle)
    a, b = (CheckpointRef(uuid.uuid4(), f"ck/{i}", "c" * 64) for i in range(2))
    assert backend.served(loaded, a) is backend.served(loaded, a)
    assert backend.served(loaded, b) is not backend.served(loaded, a)
    assert backend.served(loaded, None) is backend.served(loaded, None) is not backend.served(loaded, a)
    assert built == [a.id, b.id, None]
    base = backend.served(loaded, None)
    assert base.localizer is loaded.localizer and base.prototype is None and not base.agent.training


def input_templates(local: LocalInference) -> Templates:
    """Blank templates made on the test bundle's input (size, channels, fill): what the engine reads with the batch."""
    spec = local.bundles.get(make_call(local).bundle).localizer.spec
    return Templates(torch.zeros(1, 1, 16, 16, dtype=torch.uint8), None, spec.size, spec.channels, tuple(spec.fill))


def noise_images(seed: int, n: int) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray((torch.rand(84, 84, generator=g) * 255).byte().numpy()) for _ in range(n)]


def test_the_nearest_option_resolves_call_first_then_server_then_bundle(local):
    spec_default = local.bundles.get(make_call(local).bundle).localizer.default_nearest
    for call_nearest, server, expected in ((True, False, True), (False, True, False), (None, True, True),
                                           (None, False, False), (None, None, spec_default)):
        backend = LocalInference(local.bundles, local.store, default_nearest=server)
        key, prepared = backend.prepare(make_call(local, nearest=call_nearest))
        assert prepared.nearest is expected and key[2] is expected


def test_calls_share_a_forward_only_with_the_same_bundle_file_checkpoint_options_and_no_search(local):
    call = make_call(local)
    key, prepared = local.prepare(call)
    loaded = local.bundles.get(call.bundle)
    assert key == (loaded.sha256, None, prepared.nearest, 0, 1)
    assert local.prepare(dataclasses.replace(call, images=call.images[:1], prototype=prototype_to_bytes(
        torch.zeros(loaded.bundle.prototype_dim))))[0] == key  # other images and prototype: the same forward
    assert local.prepare(dataclasses.replace(call, max_instances=3))[0] != key
    assert local.prepare(dataclasses.replace(call, nearest=not prepared.nearest))[0] != key
    searching = dataclasses.replace(call, samples=4)
    assert local.prepare(searching)[0] != local.prepare(searching)[0]  # a best-of-N search runs alone
    # what is prepared: the images on the input, their scales, the set's prototype
    assert prepared.batch.shape == (2, 1, 84, 84) and prepared.scales.tolist() == [[2.0, 1.0], [1.0, 0.5]]
    assert torch.equal(prepared.prototype, torch.ones(loaded.bundle.prototype_dim))
    assert (prepared.trajectory, prepared.samples, prepared.max_instances) == (False, 0, 1)
    assert prepared.match_scales.tolist() == [[2.0, 1.0], [1.0, 0.5]]


def test_the_engine_reads_templates_only_where_they_were_made_on_its_input(local):
    call = make_call(local)
    spec = local.bundles.get(call.bundle).localizer.spec
    same = input_templates(local)
    look = serving.SecondLook(None, 0.25, 4)  # type: ignore[arg-type]
    _, prepared = local.prepare(dataclasses.replace(call, templates=same, second_look=look))
    assert prepared.templates is same and prepared.second_look is look
    _, prepared = local.prepare(dataclasses.replace(call, templates=same, second_look=look, max_instances=2))
    assert prepared.templates is same and prepared.second_look is None  # several instances: no second look
    for other in (dataclasses.replace(same, size=spec.size + 1), dataclasses.replace(same, channels=3),
                  dataclasses.replace(same, fill=(0.5,))):
        _, prepared = local.prepare(dataclasses.replace(call, templates=other, second_look=look))
        assert prepared.templates is None and prepared.second_look is None
    _, prepared = local.prepare(dataclasses.replace(call, second_look=look))  # no templates: no look
    assert prepared.second_look is None


def test_extra_boxes_and_decoded_scales_reach_the_engine_in_input_pixels(local):
    call = make_call(local, max_instances=2, extra_boxes=[(20.0, 10.0, 60.0, 50.0), None],
                     decoded_scales=[(2.0, 2.0), (1.0, 3.0)])
    _, prepared = local.prepare(call)
    assert prepared.extra[0].tolist() == [10.0, 10.0, 30.0, 50.0]
    assert bool(torch.isnan(prepared.extra[1]).all())
    assert prepared.match_scales.tolist() == [[4.0, 2.0], [1.0, 1.5]]
    _, prepared = local.prepare(dataclasses.replace(call, max_instances=1))
    assert prepared.extra is None  # one answer per image: no candidates to add to
    with pytest.raises(ValueError, match="extra_boxes: 1 for 2 images"):
        local.prepare(dataclasses.replace(call, extra_boxes=[(0.0, 0.0, 1.0, 1.0)]))


def test_a_kind_check_is_read_by_the_engine_only_with_the_verifier_it_was_made_with(local, monkeypatch):
    call = make_call(local)
    same = input_templates(local)
    verifier = object()
    check = SimpleNamespace(made_with=lambda v: v is verifier)
    names = []
    monkeypatch.setattr(BundleRegistry, "verifier", lambda self, name: names.append(name) or verifier)
    _, prepared = local.prepare(dataclasses.replace(call, templates=same, kind=check))
    assert prepared.kind == (verifier, check) and names == [call.bundle]
    other = SimpleNamespace(made_with=lambda v: False)
    assert local.prepare(dataclasses.replace(call, templates=same, kind=other))[1].kind is None
    assert local.prepare(dataclasses.replace(call, kind=check))[1].kind is None  # not on the templates' input


def test_a_busy_or_closing_engine_refuses_with_retry_after(local):
    backend = serving.BatchedInference(local.bundles, local.store, max_queue_images=3, retry_after_s=7)
    try:
        def full(*a, **k):  # type: ignore[no-untyped-def]
            raise QueueFull()

        backend.batcher.submit = full  # type: ignore[method-assign]
        e = refusal(backend.localize, make_call(local))
        assert (e.status_code, e.headers) == (503, {"Retry-After": "7"})
        assert e.detail == ("localize is busy: 0 images are waiting for the model, at most 3 may "
                            "(QLOC_INFERENCE_QUEUE_IMAGES); retry after 7 s")

        def closed(*a, **k):  # type: ignore[no-untyped-def]
            raise BatcherClosed()

        backend.batcher.submit = closed  # type: ignore[method-assign]
        e = refusal(backend.localize, make_call(local))
        assert (e.status_code, e.detail, e.headers) == (503, "the server is shutting down; retry",
                                                        {"Retry-After": "7"})
    finally:
        backend.close()


def test_a_backend_without_a_waiting_room_needs_no_notice_of_calls_on_their_way(local):
    with serving.on_its_way(local) as expected:  # LocalInference: nothing to hold back
        assert expected is None
    held = []

    class Expecting:
        def expect(self):  # type: ignore[no-untyped-def]
            @contextmanager
            def cm():  # type: ignore[no-untyped-def]
                held.append("in")
                yield "token"
                held.append("out")
            return cm()

    with serving.on_its_way(Expecting()) as expected:  # type: ignore[arg-type]
        assert expected == "token" and held == ["in"]
    assert held == ["in", "out"]


def test_a_best_of_n_search_never_shares_a_forward(local):
    _, searching = local.prepare(make_call(local, samples=1))
    _, greedy = local.prepare(make_call(local))
    for calls in ([searching, greedy], [greedy, searching]):
        with pytest.raises(ValueError) as e:
            serving.run_prepared(calls)
        assert str(e.value) == "a best-of-N search (samples > 0) runs alone"
    [answer] = serving.run_prepared([searching])  # alone: answered
    assert len(answer.results) == 2


def test_the_engines_template_windows_are_the_routes_and_extra_boxes_are_scored_as_candidates(local):
    """``rerank=templates`` in the engine (one answer per image, a second look with a window bar): each doubtful
    image gets template matching's window as a candidate (``Instance.template``), the one the route finds for itself
    (``app.calibration.matched_windows``), crops sized by the image's full / decoded scale -- in calls batched
    together, each with its own scales. With several instances asked for, the route's windows travel as
    ``extra_boxes`` and come back as each image's last, template candidate."""
    spec = local.bundles.get(make_call(local).bundle).localizer.spec
    g = torch.Generator().manual_seed(4)
    pattern = torch.rand(1, 20, 24, generator=g)

    def image(x: int, y: int, scale: float = 1.0) -> Image.Image:
        """The object at (x, y) of an image decoded at ``1 / scale`` of its full size (the crop was cut full-size)."""
        t = torch.rand(1, 84, 84, generator=g) * 0.3
        p = torch.nn.functional.interpolate(pattern[None], scale_factor=1 / scale, mode="bilinear")[0]
        t[:, y:y + p.shape[1], x:x + p.shape[2]] = p
        return Image.fromarray((t[0] * 255).round().byte().numpy())

    kept, sizes = match_crops([pattern])
    t = Templates(make_templates([pattern]), None, spec.size, spec.channels, tuple(spec.fill), crops=kept,
                  crop_sizes=sizes)
    unsure = Calibration(PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0), None, 0.5, {},
                         PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], -10.0), None, t)
    look = serving.SecondLook(unsure, 0.25, 4, 0.8)
    calls = [make_call(local, images=[image(50, 10), image(5, 40)], templates=t, second_look=look),
             make_call(local, images=[image(30, 60, 2.0)], templates=t, second_look=look, decoded_scales=[(2.0, 2.0)])]
    answers = serving.run_prepared([local.prepare(c)[1] for c in calls])
    half = [i.box for i in answers[1].results[0].instances if i.template]
    assert half and half[0][2] - half[0][0] == pytest.approx(12, abs=1.5)  # the crop at its decoded size
    for call, answer in zip(calls, answers, strict=True):
        assert answer.looked
        expected = matched_windows(t, call.images, call.decoded_scales or [(1.0, 1.0)] * len(call.images))
        windows = [[i.box for i in r.instances if i.template] for r in answer.results]
        assert [len(w) for w in windows] == [1] * len(call.images)
        for [got], want in zip(windows, expected, strict=True):
            assert list(got) == pytest.approx(list(want), abs=1e-3)
    # several instances: the route's windows as extra boxes, scored last
    extra = matched_windows(t, calls[0].images, [(1.0, 1.0)] * 2)
    [answer] = serving.run_prepared([local.prepare(make_call(local, images=calls[0].images, max_instances=3,
                                                             extra_boxes=[extra[0], None]))[1]])
    first, second = answer.results
    assert first.instances[-1].template and list(first.instances[-1].box) == pytest.approx(list(extra[0]), abs=1e-3)
    assert not any(i.template for i in second.instances)


def test_a_prepared_call_is_answered_as_the_localizer_answers_it_with_its_options(local):
    """``run_prepared`` on one call answers what ``Localizer.localize_batch`` answers for its batch with the call's
    options: ``nearest`` against the bundle's default, a best-of-N search (the same random stream), several
    instances, trajectories kept or dropped."""
    images = noise_images(2, 3)
    loaded = local.bundles.get(make_call(local).bundle)
    default = loaded.localizer.default_nearest
    for options in (dict(nearest=not default), dict(nearest=default), dict(samples=8), dict(max_instances=3),
                    dict(trajectory=True)):
        _, prepared = local.prepare(make_call(local, images=images, **options))
        torch.manual_seed(11)
        [answer] = serving.run_prepared([prepared])
        torch.manual_seed(11)
        direct = prepared.localizer.localize_batch(
            prepared.batch, prepared.scales, prepared.prototype, prepared.agent, samples=prepared.samples,
            nearest=prepared.nearest, max_instances=prepared.max_instances, trajectory=True)
        assert answer.nearest is prepared.nearest
        for got, want in zip(answer.results, direct, strict=True):
            assert list(got.box) == pytest.approx(list(want.box), abs=1e-4), options
            assert (got.trajectory is not None) == bool(options.get("trajectory"))
            if got.trajectory is not None:
                assert len(got.trajectory) == len(want.trajectory)
            assert (got.instances is None) == (want.instances is None)
            if got.instances is not None:
                assert [list(i.box) for i in got.instances] == [pytest.approx(list(i.box), abs=1e-4)
                                                               for i in want.instances]
    # the two nearest settings answer differently somewhere (else the first case shows nothing)
    boxes = {n: [r.box for r in serving.run_prepared([local.prepare(make_call(local, images=images, nearest=n))[1]])[0]
                 .results] for n in (True, False)}
    assert boxes[True] != boxes[False]


def test_calls_batched_together_each_get_their_own_images_answers_and_trajectories_only_if_asked(local):
    images = noise_images(6, 3)
    with_path = make_call(local, images=images[:2], trajectory=True, max_instances=2)
    without = make_call(local, images=images[2:], max_instances=2)
    (k1, p1), (k2, p2) = local.prepare(with_path), local.prepare(without)
    assert k1 == k2  # trajectories are read off the same episodes: one forward
    a1, a2 = serving.run_prepared([p1, p2])
    assert len(a1.results) == 2 and len(a2.results) == 1
    assert all(r.trajectory for r in a1.results) and a2.results[0].trajectory is None
    [alone] = serving.run_prepared([p2])[0].results
    assert list(a2.results[0].box) == pytest.approx(list(alone.box), abs=1e-4)
    assert [list(i.box) for i in a2.results[0].instances] == [pytest.approx(list(i.box), abs=1e-4)
                                                             for i in alone.instances]  # kept with the path dropped
    # a call's extra boxes (rerank=templates' windows) are its own: the other call of the batch gets none
    window = (10.0, 10.0, 40.0, 40.0)
    _, p3 = local.prepare(dataclasses.replace(without, extra_boxes=[window]))
    b1, b3 = serving.run_prepared([p1, p3])
    assert not any(i.template for r in b1.results for i in r.instances)
    assert b3.results[0].instances[-1].template
    assert list(b3.results[0].instances[-1].box) == pytest.approx(list(window), abs=1e-3)


def test_a_checkpoint_carrying_a_repaired_reward_is_served_with_its_head_and_prototype(local, monkeypatch):
    """``served``: a checkpoint's agent state on the bundle's agent, and where the checkpoint carries a repaired
    reward (``models.bundle.Reward``), the localizer of that head and the reward's prototype, which ``prepare``
    uses in place of the set's; calls of two checkpoints never share a forward."""
    loaded = local.bundles.get(make_call(local).bundle)
    head = {k: v.clone() + 0.5 for k, v in loaded.bundle.embedder.head.state_dict().items()}
    dim = loaded.bundle.prototype_dim
    reward = Reward(head, torch.full((dim,), 2.0, dtype=torch.float64), refine=True)
    state = {k: v.clone() * 0 for k, v in loaded.localizer.agent(None).state_dict().items()}
    asked = []

    def policy(bundles, store, ckpt, loaded_):  # type: ignore[no-untyped-def]
        asked.append((bundles, store, ckpt, loaded_))
        return (state, reward) if ckpt.blob == "repaired" else (state, None)

    monkeypatch.setattr(serving, "policy_state", policy)
    backend = LocalInference(local.bundles, local.store)
    repaired = CheckpointRef(uuid.uuid4(), "repaired", "c" * 64)
    plain = CheckpointRef(uuid.uuid4(), "plain", "c" * 64)
    served = backend.served(loaded, repaired)
    assert asked == [(local.bundles, local.store, repaired, loaded)]
    assert served.localizer is not loaded.localizer
    for k, v in served.localizer.bundle.embedder.head.state_dict().items():
        assert torch.equal(v, head[k])
    assert served.prototype.dtype == torch.float32 and torch.equal(served.prototype, torch.full((dim,), 2.0))
    assert all(bool((p == 0).all()) for p in served.agent.state_dict().values())
    other = backend.served(loaded, plain)
    assert other.localizer is loaded.localizer and other.prototype is None
    assert all(bool((p == 0).all()) for p in other.agent.state_dict().values())

    call = make_call(local, checkpoint=repaired)
    key, prepared = backend.prepare(call)
    assert torch.equal(prepared.prototype, torch.full((dim,), 2.0)) and prepared.localizer is served.localizer
    plain_key, plain_prepared = backend.prepare(dataclasses.replace(call, checkpoint=plain))
    assert torch.equal(plain_prepared.prototype, torch.ones(dim))  # the set's own
    assert key[1] == repaired.id and plain_key[1] == plain.id and key != plain_key
    # answers on a reward that refines say so
    assert serving.run_prepared([prepared])[0].refined and not serving.run_prepared([plain_prepared])[0].refined


def test_prepare_checks_the_sets_bundle_file_and_prototype_and_a_one_sample_search_runs_alone(local):
    call = make_call(local)
    e = refusal(local.prepare, dataclasses.replace(call, bundle_sha256="f" * 64))
    assert e.status_code == 409
    e = refusal(local.prepare, dataclasses.replace(call, prototype_dim=call.prototype_dim + 1))
    assert e.status_code == 409 and "has dimension" in e.detail
    one = dataclasses.replace(call, samples=1)
    assert local.prepare(one)[0] != local.prepare(one)[0]


def test_the_batched_backends_defaults_hold_no_call_back(local):
    """The localize worker leaves the gather and the window at their defaults: a call runs at once."""
    backend = serving.BatchedInference(local.bundles, local.store)
    try:
        b = backend.batcher
        assert (b.window_s, b.gather_s, b.max_batch, b.max_queue, backend.retry_after_s) == (0.0, 0.0, 64, 256, 1)
        assert backend.default_nearest is None and backend._served.size == 32
    finally:
        backend.close()


def test_the_batched_backend_runs_on_its_settings(local):
    observed = []
    backend = serving.BatchedInference(local.bundles, local.store, default_nearest=True, window_s=0.002,
                                       max_batch_images=5, max_queue_images=9, retry_after_s=3,
                                       observe=lambda n, waits: observed.append(n), gather_s=0.004)
    try:
        b = backend.batcher
        assert (b.window_s, b.max_batch, b.max_queue, b.gather_s, b.name) == (0.002, 5, 9, 0.004, "qloc-localize")
        assert backend.store is local.store and backend.default_nearest is True and backend.retry_after_s == 3
        answer = backend.localize(make_call(local))
        assert answer.nearest is True and len(answer.results) == 2 and observed == [2]
    finally:
        backend.close()
