"""``app.calibration`` by value, without HTTP: the second look's bars, what a new set's calibration is fit on, and
the pixels each verdict reads -- images of any size mapped onto the input the fits were made on, transparent
uploads composited as the crops were, template matching's windows in the image's own pixels.

The API's tests (``test_app_calibration.py``) go through the routes with images of the bundle's input size, where
a box read in the wrong frame (multiplied by the image's scale instead of divided) gives the same numbers."""

from __future__ import annotations

import dataclasses
import math
import uuid
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from app import calibration as appcal
from app.calibration import (
    LOOK_THRESHOLD,
    SECOND_LOOK_BELOW,
    TEMPLATE_BAR,
    doubtful,
    doubtful_by_pixels,
    judge,
    matched_windows,
    negatives_confidence,
    negatives_to_bytes,
    second_look,
)
from app.inference import BundleRegistry, prototype_to_bytes
from models.calibration import Calibration, box_distances, features
from models.core.boxes import paired_iou
from models.core.platt import PlattFit
from models.core.templates import Templates, make_templates, match_crops
from models.inference import Instance, Localization, pil_to_tensor, preprocess
from models.verifier import KindCheck

S = 84  # the templates' input side in these tests
BLANK = Templates(torch.zeros(1, 16, 16, dtype=torch.uint8), None, S, 1, (0.0,))
"""Templates for calibrations whose NCC features the tests pass in (``ncc=``): never read."""


def score_fit(weight: float = 0.0, bias: float = 0.0) -> PlattFit:
    """The score's fit: sigmoid(weight log(score) + bias)."""
    return PlattFit(["log_score"], [0.0], [1.0], [weight], bias)


IDENTITY = Calibration(score_fit(), None, 0.5, {},
                       PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], 0.0), None, BLANK).to_dict()
"""A calibration whose confidence is sigmoid(the NCC feature given): ``logit(p)`` passed as ``ncc=`` answers ``p``
(0.0 answers exactly 0.5)."""


def logit(p: float) -> float:
    return 0.0 if p == 0.5 else math.log(p / (1 - p))


def gray(t: torch.Tensor) -> Image.Image:
    """``[1, h, w]`` in [0, 1] -> an 8-bit grayscale image."""
    return Image.fromarray((t[0] * 255).round().byte().numpy())


def scene(side: int, pattern: torch.Tensor, at: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Low-contrast noise ``[1, side, side]`` with ``pattern`` pasted at ``at`` (x, y)."""
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(1, side, side, generator=g) * 0.3
    h, w = pattern.shape[1:]
    image[:, at[1]:at[1] + h, at[0]:at[0] + w] = pattern
    return image


def ncc_calibration(templates: Templates, *, negatives_weight: float | None = None) -> Calibration:
    """A calibration whose confidence is sigmoid(20 (NCC - 0.5)) (with ``negatives_weight``: minus that many times
    the NCC with the negative templates, where the box reads them)."""
    ncc = PlattFit(["log_score", "ncc"], [0.0, 0.5], [1.0, 1.0], [0.0, 20.0], 0.0)
    with_negatives = None if negatives_weight is None else PlattFit(
        ["log_score", "ncc", "ncc_negatives"], [0.0, 0.5, 0.0], [1.0, 1.0, 1.0], [0.0, 20.0, -negatives_weight], 0.0)
    return Calibration(score_fit(), None, 0.5, {}, ncc, with_negatives, templates)


def test_an_answer_is_doubtful_strictly_below_the_second_looks_bar():
    bar = SECOND_LOOK_BELOW * LOOK_THRESHOLD
    assert bar == 0.25
    assert doubtful(math.nextafter(bar, 0.0)) and doubtful(0.0)
    assert not doubtful(bar) and not doubtful(0.9) and not doubtful(None)


def test_the_engines_second_look_carries_the_bar_the_candidates_and_the_windows_bar_only_with_templates():
    fit = Calibration(score_fit())
    plain, windows = second_look(fit, 4), second_look(fit, 6, templates=True)
    assert (plain.calibration, plain.below, plain.candidates, plain.template_bar) == (fit, 0.25, 4, None)
    assert (windows.calibration, windows.below, windows.candidates, windows.template_bar) == (
        fit, 0.25, 6, TEMPLATE_BAR)


@pytest.fixture(scope="module")
def pattern_templates() -> tuple[torch.Tensor, Templates, torch.Tensor]:
    """(an object ``[1, 20, 24]``, its templates on an 84-pixel input, a look-alike ``[1, 20, 24]``)."""
    g = torch.Generator().manual_seed(3)
    pattern = torch.rand(1, 20, 24, generator=g)
    lookalike = torch.rand(1, 20, 24, generator=g)
    t = Templates(make_templates([pattern]), make_templates([lookalike]), S, 1, (0.0,))
    return pattern, t, lookalike


@pytest.mark.parametrize("side", [S, 2 * S, 126])
def test_doubtful_by_pixels_doubts_the_boxes_off_the_object_in_images_of_any_size(pattern_templates, side):
    """Boxes in the image's pixels are read on the image resized to the templates' input: on the object the fit is
    sure (not doubtful), on noise it doubts; in an image larger than the input, a box mapped the wrong way reads
    other pixels."""
    pattern, t, _ = pattern_templates
    k = side / S
    image = scene(S, pattern, (50, 10))
    big = torch.nn.functional.interpolate(image[None], size=(side, side), mode="nearest")[0]
    on, off = (50.0, 10.0, 74.0, 30.0), (5.0, 50.0, 29.0, 70.0)
    results = [Localization(tuple(v * k for v in b), 1.0) for b in (on, off, on)]
    got = doubtful_by_pixels(ncc_calibration(t), [gray(big)] * 3, results)
    assert got == [False, True, False]


def test_doubtful_by_pixels_reads_the_negatives_where_the_calibration_has_them(pattern_templates):
    """With negative templates and their fit, a box on the look-alike is doubted even where the positives' NCC alone
    would not: the negatives' NCC is passed on for the box read."""
    pattern, t, lookalike = pattern_templates
    blend = 0.75 * pattern + 0.25 * lookalike  # like the object, more like the look-alike than noise is
    image = scene(S, blend, (10, 10))
    box = (10.0, 10.0, 34.0, 30.0)
    plain = doubtful_by_pixels(ncc_calibration(t), [gray(image)], [Localization(box, 1.0)])
    weighed = doubtful_by_pixels(ncc_calibration(t, negatives_weight=40.0), [gray(image)], [Localization(box, 1.0)])
    assert plain == [False] and weighed == [True]


def test_a_transparent_upload_is_read_composited_on_the_templates_fill(pattern_templates):
    """``judge`` reads an RGBA upload as the crops were read: composited on the templates' fill (here mid-gray), not
    on black; the confidence equals that of the same image flattened onto that gray beforehand."""
    pattern, _, _ = pattern_templates
    t = Templates(make_templates([pattern]), None, S, 1, (0.5,))
    cal = ncc_calibration(t).to_dict()
    image = scene(S, pattern, (30, 30))
    alpha = torch.zeros(1, S, S)
    alpha[:, 25:55, 25:60] = 1.0  # the object and a margin opaque, the rest transparent
    rgba = Image.merge("RGBA", [gray(image)] * 3 + [gray(alpha)])
    flat = pil_to_tensor(rgba, 1, (0.5,))
    results = [Localization((28.0, 28.0, 58.0, 54.0), 1.0)]  # larger than the object: reads transparent pixels
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None)
    [rgba_judged] = judge(results, [rgba], cal, **args)
    [flat_judged] = judge(results, [gray(flat)], cal, **args)
    [black_judged] = judge(results, [gray(pil_to_tensor(rgba, 1, (0.0,)))], cal, **args)
    assert rgba_judged.confidence == pytest.approx(flat_judged.confidence, abs=1e-6)
    assert abs(rgba_judged.confidence - black_judged.confidence) > 1e-3
    # the route's second-look check reads them the same way
    assert doubtful_by_pixels(ncc_calibration(t), [rgba], results) == doubtful_by_pixels(
        ncc_calibration(t), [gray(flat)], results)


@pytest.mark.parametrize("side", [S, 2 * S])
def test_template_windows_are_in_the_images_own_pixels(pattern_templates, side):
    """``matched_windows`` on an image larger than the templates' input (and not decoded downscaled): the window lies
    on the object in the image's pixels; a set without kept crops has no window (``None``), and a transparent
    upload is composited on the templates' fill."""
    pattern, _, _ = pattern_templates
    k = side // S
    big_pattern = torch.nn.functional.interpolate(pattern[None], scale_factor=k, mode="nearest")[0]
    image = scene(side, big_pattern, (40 * k, 12 * k))
    kept, sizes = match_crops([big_pattern])
    t = Templates(make_templates([big_pattern]), None, S, 1, (0.0,), crops=kept, crop_sizes=sizes)
    [window] = matched_windows(t, [gray(image)], [(1.0, 1.0)])
    truth = torch.tensor([[40.0 * k, 12.0 * k, 64.0 * k, 32.0 * k]])
    assert window is not None and float(paired_iou(torch.tensor([window]), truth)[0]) > 0.8
    none = Templates(make_templates([big_pattern]), None, S, 1, (0.0,))
    assert matched_windows(none, [gray(image)] * 2, [(1.0, 1.0)] * 2) == [None, None]


def test_template_windows_on_a_transparent_upload_use_the_fill(pattern_templates):
    """A transparent upload is matched composited on the templates' fill: the crop is the object on a mid-gray
    margin; the image has the object (slightly noisy) with a transparent margin, and an exact copy on an opaque black
    margin. On the fill the first matches; on black (a fill ignored) the copy would."""
    pattern, _, _ = pattern_templates
    g = torch.Generator().manual_seed(8)
    crop = torch.full((1, 32, 36), 0.5)
    crop[:, 6:26, 6:30] = pattern
    kept, sizes = match_crops([crop])
    t = Templates(make_templates([crop]), None, S, 1, (0.5,), crops=kept, crop_sizes=sizes)
    image = torch.zeros(1, S, S)
    alpha = torch.ones(1, S, S)
    image[:, 10:30, 10:34] = (pattern + 0.05 * torch.randn(1, 20, 24, generator=g)).clamp(0, 1)
    alpha[:, 4:36, 4:40] = 0.0
    alpha[:, 10:30, 10:34] = 1.0  # the object opaque, its margin transparent
    image[:, 50:70, 50:74] = pattern  # the copy, on the opaque black around it
    rgba = Image.merge("RGBA", [gray(image)] * 3 + [gray(alpha)])
    [window] = matched_windows(t, [rgba], [(1.0, 1.0)])
    truth = torch.tensor([[4.0, 4.0, 40.0, 36.0]])
    assert window is not None and float(paired_iou(torch.tensor([window]), truth)[0]) > 0.7, window
    [on_black] = matched_windows(t, [gray(pil_to_tensor(rgba, 1, (0.0,)))], [(1.0, 1.0)])
    assert on_black is not None and float(paired_iou(torch.tensor([on_black]), truth)[0]) < 0.3, on_black


@pytest.fixture(scope="module")
def loaded(bundle_dir):  # type: ignore[no-untyped-def]
    from service_fixtures import TEST_BUNDLES

    return BundleRegistry(bundle_dir, device="cpu").get(TEST_BUNDLES[0])


def test_negatives_confidence_reads_boxes_in_the_images_pixels(loaded):
    """``negatives_confidence`` on an image twice the input's side, its boxes in its own pixels, answers as on the
    image as the bundle reads it (resized to the input's side) with the boxes halved: each box is mapped onto the
    input."""
    spec = loaded.localizer.spec
    assert spec.size == S
    g = torch.Generator().manual_seed(1)
    digitish = (torch.rand(1, 28, 28, generator=g) > 0.6).float()
    big = scene(2 * S, torch.nn.functional.interpolate(digitish[None], scale_factor=2)[0], (80, 40), seed=2)
    image, _ = preprocess([gray(big)], spec)  # the large image as the bundle reads it, at the input's side
    image = image[0]
    crops = [pil_to_tensor(gray(digitish), 1, spec.fill)]
    proto = loaded.localizer.embed_crops(crops).mean(0)
    negatives = loaded.localizer.embed_crops([pil_to_tensor(gray(1 - digitish), 1, spec.fill)])
    batch, _ = preprocess([gray(image)], spec)
    boxes = torch.tensor([[[40.0, 20.0, 68.0, 48.0], [0.0, 50.0, 30.0, 84.0], [30.0, 10.0, 80.0, 60.0]]])
    d = box_distances(loaded.localizer, batch, boxes, torch.cat([proto[None], negatives]))
    x = features(d[..., 0].flatten(), d[..., 1:].min(-1).values.flatten())
    # a fit centred on these boxes' features, steep enough that their confidences spread over (0, 1)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    fit = PlattFit(["log_score", "log_ratio"][:x.shape[1]], mean.tolist(), std.tolist(), [2.0] * x.shape[1], 0.0)
    cal = Calibration(score_fit(), fit)
    args = (prototype_to_bytes(proto), negatives_to_bytes(negatives), cal)
    small = negatives_confidence(loaded, *args, [gray(image)], boxes)
    large = negatives_confidence(loaded, *args, [gray(big)], boxes * 2)
    assert small.shape == large.shape == (1, 3)
    assert float(small.max() - small.min()) > 0.2  # the boxes are told apart
    assert large[0].tolist() == pytest.approx(small[0].tolist(), abs=0.02)


def test_a_new_sets_calibration_is_fit_on_what_the_set_has(monkeypatch, loaded):
    """``calibrate_new_set`` passes on the crops and negative crops as the bundle reads them (transparent ones
    composited on its fill), its labeled examples resized to the input with their boxes mapped onto it, the
    threshold, the sample count, the seed (0 unless given) and the verifier; it keeps the negatives' embeddings."""
    captured = {}

    def fake(localizer, prototype, tensors, **kw):  # type: ignore[no-untyped-def]
        captured.update(localizer=localizer, prototype=prototype, tensors=tensors, **kw)
        return Calibration(score_fit(bias=0.25))

    monkeypatch.setattr(appcal, "calibrate_policy", fake)
    fill = (0.5,)
    spec = SimpleNamespace(channels=1, fill=fill, size=S, mean=(0.0,), std=(1.0,))
    embedded = torch.arange(6, dtype=torch.float32).view(2, 3)
    localizer = SimpleNamespace(spec=spec, default_nearest=True, embed_crops=lambda ts: embedded[:len(ts)])
    bundle = SimpleNamespace(localizer=localizer)
    crop = Image.new("LA", (10, 12), (200, 0))  # fully transparent
    negative = Image.new("LA", (8, 8), (10, 0))
    labeled = [(Image.new("L", (2 * S, S), 90), (20.0, 10.0, 60.0, 40.0)),
               (Image.new("L", (S, 3 * S), 90), (3.0, 30.0, 9.0, 90.0))]
    proto = torch.ones(3)
    verifier = object()  # the bundle's known-kinds verifier, passed on as is
    out = appcal.calibrate_new_set(bundle, proto, [crop], labeled, [negative, negative], threshold=0.3, samples=7,
                                   verifier=verifier)
    half = 128 / 255  # the fill, as 8 bits
    assert [c.shape for c in captured["tensors"]] == [(1, 12, 10)] and bool((captured["tensors"][0] == half).all())
    assert [c.shape for c in captured["negative_crops"]] == [(1, 8, 8)] * 2
    assert all(bool((c == half).all()) for c in captured["negative_crops"])
    assert captured["prototype"] is proto and captured["localizer"] is localizer and captured["nearest"] is True
    assert (captured["n"], captured["seed"], captured["threshold"]) == (7, 0, 0.3)
    assert captured["verifier"] is verifier
    assert torch.equal(captured["negative_embeddings"], embedded)
    examples = captured["labeled"]
    assert examples.images.shape == (2, 1, S, S)
    assert examples.boxes.flatten().tolist() == pytest.approx([10.0, 10.0, 30.0, 40.0, 3.0, 10.0, 9.0, 30.0])
    assert out.num_negatives == 2 and out.negatives == negatives_to_bytes(embedded)
    assert out.calibration == Calibration(score_fit(bias=0.25)).to_dict()

    # no labeled examples, no negatives: none passed on; a seed given is used
    captured.clear()
    out = appcal.calibrate_new_set(bundle, proto, [crop], [], [], threshold=0.5, samples=3, seed=5)
    assert captured["labeled"] is None and captured["negative_crops"] is None
    assert captured["negative_embeddings"] is None and captured["seed"] == 5 and captured["verifier"] is None
    assert (out.negatives, out.num_negatives) == (None, 0)


def _instances(n: int = 2) -> Localization:
    boxes = [(0.0, 0.0, 10.0, 10.0), (20.0, 20.0, 30.0, 30.0), (40.0, 40.0, 50.0, 50.0)][:n + 1]
    return Localization(boxes[0], 0.5, instances=[Instance(b, 0.5 + k) for k, b in enumerate(boxes)])


def test_without_a_calibration_every_answer_and_instance_is_found_with_no_confidence():
    results = [_instances(2), Localization((1.0, 2.0, 3.0, 4.0), 0.7)]
    out = judge(results, [Image.new("L", (S, S))] * 2, None, threshold=0.5, min_confidence=0.9, loaded=None,
                prototype=b"", negatives=None, rerank="true")
    assert [(j.box, j.confidence, j.found, j.reranked) for j in out] == [
        ((0.0, 0.0, 10.0, 10.0), None, True, False), ((1.0, 2.0, 3.0, 4.0), None, True, False)]
    assert [(i.box, i.score, i.confidence, i.found) for i in out[0].instances] == [
        ((0.0, 0.0, 10.0, 10.0), 0.5, None, True), ((20.0, 20.0, 30.0, 30.0), 1.5, None, True),
        ((40.0, 40.0, 50.0, 50.0), 2.5, None, True)]
    assert out[1].instances is None


def test_judge_leaves_the_answer_where_no_rerank_is_asked_for():
    """``rerank`` defaults to ``false``: a likelier candidate does not replace the answer."""
    logits = [logit(p) for p in (0.1, 0.1, 0.9, 0.3)]  # the answer, then its 3 instances
    [j] = judge([_instances(2)], [Image.new("L", (S, S))], IDENTITY, threshold=0.5, min_confidence=None,
                loaded=None, prototype=b"", negatives=None, ncc=(torch.tensor([logits], dtype=torch.float64), None))
    assert j.box == (0.0, 0.0, 10.0, 10.0) and not j.reranked and j.confidence == pytest.approx(0.1)
    assert [i.confidence for i in j.instances] == pytest.approx([0.1, 0.9, 0.3])


def test_a_kind_read_by_the_engine_is_the_confidence_only_for_a_calibration_with_a_kind_check():
    """``kind`` (the engine's reading of a set's check) answers only where the calibration has a check (its rows
    cut to the answer's); a calibration without one answers by its fit, whatever ``kind`` carries."""
    checked = dataclasses.replace(Calibration.from_dict(IDENTITY),
                                  kind=KindCheck([1.0, 0.0], [[0.0, 1.0]], "a", 0.99, "sha"))
    kind = torch.tensor([[0.7, 0.2, 0.1, 0.0, 0.0]], dtype=torch.float64)  # padded past the 3 boxes
    ncc = (torch.tensor([[0.0, 2.0, -2.0]], dtype=torch.float64), None)
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None, ncc=ncc, kind=kind)
    answer = [_instances(1)]  # the answer and 2 instances
    [by_kind] = judge(answer, [Image.new("L", (S, S))], checked.to_dict(), **args)
    assert [by_kind.confidence] + [i.confidence for i in by_kind.instances] == pytest.approx([0.7, 0.2, 0.1])
    [by_fit] = judge(answer, [Image.new("L", (S, S))], IDENTITY, **args)
    assert [by_fit.confidence] + [i.confidence for i in by_fit.instances] == pytest.approx(
        [0.5, 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(2.0))])


def test_an_ncc_fit_without_templates_answers_by_the_scores_fit():
    """A calibration holding an NCC fit but no templates (nothing to read NCC features with) answers by the score's
    fit, and one with templates but no NCC fit does too."""
    score = score_fit(weight=1.0)  # sigmoid(log score) = score / (1 + score)
    ncc = PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], 5.0)
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None)
    for cal in (Calibration(score, None, 0.5, {}, ncc, None, None), Calibration(score, None, 0.5, {}, None, None,
                                                                               BLANK)):
        [j] = judge([Localization((0.0, 0.0, 10.0, 10.0), 3.0)], [Image.new("L", (S, S))], cal.to_dict(), **args)
        assert j.confidence == pytest.approx(0.75)


def test_the_negatives_fit_is_read_where_the_set_the_calibration_and_a_way_to_embed_allow():
    """A set with negatives and a calibration with their fit: the boxes are scored by ``by_negatives`` (a localize
    worker: the images and every row of boxes in their pixels) where there is no local bundle; without negatives,
    without the fit, or with no way to embed the boxes, the score's fit answers."""
    score = score_fit(weight=1.0)
    neg_fit = PlattFit(["log_score", "log_ratio"], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], 0.0)
    images = [Image.new("L", (2 * S, S)), Image.new("L", (S, S))]
    results = [Localization((0.0, 0.0, 10.0, 10.0), 3.0, instances=_instances(1).instances),
               Localization((5.0, 5.0, 20.0, 20.0), 3.0, instances=_instances(1).instances)]
    calls = []

    def scorer(imgs, boxes):  # type: ignore[no-untyped-def]
        calls.append((imgs, boxes.clone()))
        return torch.tensor([[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]], dtype=torch.float64)

    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"")
    with_fit = Calibration(score, neg_fit).to_dict()
    got = judge(results, images, with_fit, negatives=b"\0" * 8, by_negatives=scorer, **args)
    assert [[j.confidence] + [i.confidence for i in j.instances] for j in got] == [
        pytest.approx([0.9, 0.8, 0.7]), pytest.approx([0.6, 0.5, 0.4])]
    [(imgs, boxes)] = calls
    assert imgs == images and boxes.tolist() == [
        [[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]],
        [[5.0, 5.0, 20.0, 20.0], [0.0, 0.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]]]
    for cal, negatives, by in ((with_fit, None, scorer), (Calibration(score).to_dict(), b"\0" * 8, scorer),
                               (with_fit, b"\0" * 8, None)):
        calls.clear()
        got = judge(results, images, cal, negatives=negatives, by_negatives=by, **args)
        assert [j.confidence for j in got] == pytest.approx([0.75, 0.75]) and calls == []


def verdict(confidences: list[float], *, template: bool = False, **kw):  # type: ignore[no-untyped-def]
    """``judge`` on one answer (box 0) whose instances have boxes 1..K (the last a template window with
    ``template``), with the confidences given: the answer's, then each instance's."""
    k = len(confidences) - 1
    boxes = [(10.0 * b, 0.0, 10.0 * b + 8.0, 8.0) for b in range(k + 1)]
    instances = [Instance(boxes[b], 1.0, template=template and b == k) for b in range(1, k + 1)]
    ncc = (torch.tensor([[logit(p) for p in confidences]], dtype=torch.float64), None)
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None, ncc=ncc) | kw
    [j] = judge([Localization(boxes[0], 1.0, instances=instances)], [Image.new("L", (S, S))], IDENTITY, **args)
    return j, boxes


def test_rerank_true_takes_the_likeliest_of_every_candidate_found_by_its_confidence():
    """``rerank=true`` looks past the first ``RERANK_CANDIDATES`` (auto does not), with one instance too; its answer
    is ``found`` by the threshold alone."""
    j, boxes = verdict([0.1, 0.2, 0.3, 0.2, 0.3, 0.6], rerank="true")
    assert j.box == boxes[5] and j.reranked and j.confidence == pytest.approx(0.6) and j.found
    j, boxes = verdict([0.1, 0.2, 0.3, 0.2, 0.3, 0.6], rerank="auto")
    assert j.box == boxes[0] and not j.reranked  # 0.3 of the first four: under LOOK_THRESHOLD
    j, boxes = verdict([0.1, 0.7], rerank="true")
    assert j.box == boxes[1] and j.found and [i.box for i in j.instances] == [boxes[1]]
    j, boxes = verdict([0.1, 0.4], rerank="true", threshold=0.45)
    assert j.box == boxes[1] and not j.found


def test_the_second_looks_bars_include_their_bounds(monkeypatch):
    """A candidate at exactly ``LOOK_THRESHOLD`` is taken; a taken candidate at exactly ``SECOND_LOOK_FOUND`` is
    ``found``; a template window at exactly ``template_bar`` is a candidate; ``min_confidence`` keeps the instances
    at exactly its value."""
    j, boxes = verdict([0.1, 0.5], rerank="auto")
    assert j.box == boxes[1] and j.reranked and not j.found  # 0.5 < SECOND_LOOK_FOUND
    monkeypatch.setattr(appcal, "SECOND_LOOK_FOUND", 0.5)
    j, _ = verdict([0.1, 0.5], rerank="auto")
    assert j.reranked and j.found
    j, boxes = verdict([0.1, 0.3, 0.5], rerank="auto", template=True, template_bar=0.5)
    assert j.box == boxes[2] and j.reranked and [i.box for i in j.instances] == [boxes[1]]
    j, boxes = verdict([0.1, 0.3, 0.5], rerank="auto", template=True, template_bar=math.nextafter(0.5, 1.0))
    assert j.box == boxes[0] and not j.reranked
    j, boxes = verdict([0.1, 0.3], rerank="auto", template=True, template_bar=0.5)  # a window alone, under its bar
    assert j.box == boxes[0] and not j.reranked and j.instances == []
    j, boxes = verdict([0.6, 0.5, 0.4, 0.7], min_confidence=0.5)
    assert [i.box for i in j.instances] == [boxes[1], boxes[3]] and j.found
    j, boxes = verdict([0.6, 0.5, 0.4, 0.7], min_confidence=math.nextafter(0.5, 1.0))
    assert [i.box for i in j.instances] == [boxes[3]]


def test_answers_of_different_instance_counts_are_judged_on_their_own_row():
    """Rows are padded to the most instances of any image: each answer reads its own row's first 1 + K."""
    results = [Localization((0.0, 0.0, 8.0, 8.0), 1.0, instances=[Instance((9.0, 0.0, 17.0, 8.0), 1.0)]),
               Localization((0.0, 9.0, 8.0, 17.0), 1.0, instances=[Instance((9.0, 9.0, 17.0, 17.0), 1.0)] * 3),
               Localization((0.0, 18.0, 8.0, 26.0), 1.0)]
    rows = [[0.6, 0.7, 0.6, 0.6], [0.2, 0.3, 0.4, 0.9], [0.55, 0.55, 0.55, 0.55]]
    ncc = (torch.tensor([[logit(p) for p in row] for row in rows], dtype=torch.float64), None)
    out = judge(results, [Image.new("L", (S, S))] * 3, IDENTITY, threshold=0.5, min_confidence=None, loaded=None,
                prototype=b"", negatives=None, ncc=ncc)
    assert [j.confidence for j in out] == pytest.approx([0.6, 0.2, 0.55])
    assert [[i.confidence for i in j.instances] for j in out[:2]] == [pytest.approx([0.7]),
                                                                      pytest.approx([0.3, 0.4, 0.9])]
    assert out[2].instances is None


def test_a_calibration_is_decoded_once_per_key():
    """``calibration_key`` names the row the calibration was read from (written once): a second verdict under the
    same key uses the first decoding; without a key each is decoded."""
    key = ("unit test", uuid.uuid4())
    low, high = Calibration(score_fit(bias=-2.0)).to_dict(), Calibration(score_fit(bias=2.0)).to_dict()
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None)
    answer = [Localization((0.0, 0.0, 8.0, 8.0), 1.0)]
    [first] = judge(answer, [Image.new("L", (S, S))], low, calibration_key=key, **args)
    [cached] = judge(answer, [Image.new("L", (S, S))], high, calibration_key=key, **args)
    [fresh] = judge(answer, [Image.new("L", (S, S))], high, **args)
    assert first.confidence == pytest.approx(cached.confidence) and not cached.found
    assert fresh.confidence == pytest.approx(1 / (1 + math.exp(-2.0))) and fresh.found
