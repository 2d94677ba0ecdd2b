"""The measures model selection and the benchmarks read (``models.evaluate``): the candidate boxes, OrdAcc,
the ranking metrics, the agent's episodes and CorLoc, and the ranking baseline, each against a computation
written out here from the embedder and the agent directly."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models.bundle import load_bundle
from models.core.metrics import corloc, spearman
from models.core.ordinal import anchors_for, ordinal_accuracy, sample_pairs
from models.evaluate import (
    evaluate_corloc,
    evaluate_ordacc,
    localize_boxes,
    ordacc_all,
    ranking,
    ranking_candidates,
    ranking_metrics,
    rect_candidates,
    training_candidates,
)
from models.experiments.cmnist import cmnist
from models.features import features_of, prototype_of, with_features
from models.inference import Localizer
from models.presets import photo_config

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def data():
    return cmnist(4, "val", 24, "patch", 0)


@pytest.fixture(scope="module")
def proto(bundle):
    with torch.no_grad():
        return prototype_of(bundle, cmnist(4, "train", 5, "patch", 1))


def _squares_within(boxes: torch.Tensor, size: int) -> bool:
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    return bool((boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= size).all() and (w > 0).all() and (h > 0).all())


def _sides_and_corners(boxes: torch.Tensor, size: int) -> tuple[list[float], list[float]]:
    """The widths of the boxes the image's right and bottom edges do not clip, and every left edge (a box clipped
    below half the minimum side, three quarters for rectangles, is dropped: the last corners are that far in)."""
    inside = (boxes[:, 2] < size) & (boxes[:, 3] < size)
    return sorted(set((boxes[inside, 2] - boxes[inside, 0]).tolist())), sorted(set(boxes[:, 0].tolist()))


def test_the_candidate_boxes_of_the_protocol(bundle):
    """The benchmarks' numbers are read on these sets (e.g. "949 boxes per image" for the ranking baseline)."""
    size, min_side = bundle.config.input.size, bundle.config.env.min_side  # 84, 28 on cMNIST
    assert (size, min_side) == (84, 28.0)
    t = training_candidates(bundle)  # squares every 84 // 21 = 4 px, from the minimum side to 0.9 x 84
    w, h = t[:, 2] - t[:, 0], t[:, 3] - t[:, 1]
    assert _squares_within(t, size) and ((w == h) | (t[:, 2] == size) | (t[:, 3] == size)).all()  # squares, or clipped
    assert len(t) == 2887 and len(t.unique(dim=0)) == len(t)
    assert _sides_and_corners(t, size) == ([float(x) for x in range(28, 76, 4)], [float(x) for x in range(0, 69, 4)])
    r = ranking_candidates(bundle)  # 14 per side: every round(84 / 14) = 6 px
    assert len(r) == 949 and _squares_within(r, size)
    assert _sides_and_corners(r, size) == ([float(x) for x in range(28, 76, 6)], [float(x) for x in range(0, 67, 6)])
    assert _sides_and_corners(ranking_candidates(bundle, per_side=7), size)[1] == [float(x) for x in range(0, 61, 12)]
    rects = rect_candidates(bundle)  # 10 geometric sides from 28 to 84, corners every max(4, 84 // 16) = 5 px
    assert len(rects) == 6536
    sides = torch.logspace(torch.log10(torch.tensor(28.0)), torch.log10(torch.tensor(84.0)), 10).round()
    inside_sides, corners = _sides_and_corners(rects, size)
    assert inside_sides == sorted(set(sides.tolist()) - {84.0}) and corners == [float(x) for x in range(0, 61, 5)]
    assert _sides_and_corners(rect_candidates(bundle, stride=7), size)[1] == [float(x) for x in range(0, 64, 7)]
    assert len(rect_candidates(bundle, sides=6)) < len(rects)
    inside = (rects[:, 2] < size) & (rects[:, 3] < size)
    rw, rh = rects[inside, 2] - rects[inside, 0], rects[inside, 3] - rects[inside, 1]
    assert (rw / rh).max() > 2.0 and (rw / rh).max() <= 2.5 and (rh / rw).max() <= 2.5  # rectangles, up to 2.5:1
    cw, ch = rects[:, 2] - rects[:, 0], rects[:, 3] - rects[:, 1]
    assert torch.minimum(cw, ch).min() >= 0.75 * min_side  # clipping keeps three quarters of the minimum side


def test_the_candidate_boxes_at_the_photo_size():
    """224 px and a 40 px minimum side: squares every 224 // 21 = 10 px, the ranking's every round(224 / 14) = 16 px
    (only the bundle's config is read)."""
    photo = SimpleNamespace(config=photo_config())
    t, r = training_candidates(photo), ranking_candidates(photo)
    assert len(t) == 5713 and len(r) == 1474
    assert _sides_and_corners(t, 224) == ([float(x) for x in range(40, 202, 10)], [float(x) for x in range(0, 201, 10)])
    assert _sides_and_corners(r, 224) == ([float(x) for x in range(40, 202, 16)], [float(x) for x in range(0, 193, 16)])


def _embed_pairs(bundle, data, cands, pairs, seed=0, generator=None):  # noqa: ANN001, ANN202
    """The ground-truth, positive and negative box embeddings of ``pairs`` pairs per image, drawn as OrdAcc draws them
    (from ``generator``, or a new one seeded ``seed``), the pairs and the generator after the draw."""
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    p = sample_pairs(data.boxes, cands, pairs, generator=gen)
    with torch.no_grad():
        feats = features_of(bundle, data.images)
        out = bundle.embedder.embed(feats, torch.cat([data.boxes[:, None], p.pos, p.neg], 1))
    return out[:, 0], out[:, 1:1 + pairs], out[:, 1 + pairs:], p, gen


def test_ordacc_against_its_definition(bundle, data):
    cands = training_candidates(bundle)
    gt, pos, neg, _, gen = _embed_pairs(bundle, data, cands, 32, seed=3)
    inst = ordinal_accuracy(gt, pos, neg)
    anchor = anchors_for("shuffle_proto", gt, 5, gen)  # drawn after the pairs, from the same generator
    grouped = ordinal_accuracy(anchor, pos, neg)
    both = ordacc_all(bundle, data, ("proto", "inst"), seed=3)
    assert both["inst"] == pytest.approx(float(inst)) and both["proto"] == pytest.approx(float(grouped))
    assert both["inst"] != pytest.approx(both["proto"])
    assert evaluate_ordacc(bundle, data, "inst", seed=3) == pytest.approx(float(inst))
    assert evaluate_ordacc(bundle, data, seed=3) == pytest.approx(float(grouped))  # "proto" by default
    # the candidates it is given, the pairs and groups it is told
    few = cands[::5]
    _, pos_f, neg_f, _, _ = _embed_pairs(bundle, data, few, 8, seed=3)
    inst_few = ordinal_accuracy(gt, pos_f, neg_f)
    assert evaluate_ordacc(bundle, data, "inst", pairs=8, seed=3, candidates=few) == pytest.approx(float(inst_few))
    gt2, _, _, _, gen2 = _embed_pairs(bundle, data, cands, 32, seed=3)
    anchor3 = anchors_for("shuffle_proto", gt2, 3, gen2)
    in_threes = ordinal_accuracy(anchor3, pos, neg)
    assert evaluate_ordacc(bundle, data, group_size=3, seed=3) == pytest.approx(float(in_threes))
    with pytest.raises(ValueError, match="anchor must be 'proto' or 'inst', got 'self'"):
        ordacc_all(bundle, data, ("self",))


def test_ordacc_reads_carried_features_and_any_batch(bundle, data):
    carried = with_features(bundle, data)
    whole = ordacc_all(bundle, data, seed=1)
    assert ordacc_all(bundle, carried, seed=1) == pytest.approx(whole)
    # each batch draws its own pairs from the one generator, in turn; every image counts
    split = ordacc_all(bundle, data, ("inst",), seed=1, batch=10)["inst"]
    gen = torch.Generator().manual_seed(1)
    parts = [_embed_pairs(bundle, data.subset(torch.arange(i, min(i + 10, len(data)))), training_candidates(bundle),
                          32, generator=gen)[:3] for i in range(0, len(data), 10)]
    gt, pos, neg = (torch.cat(t) for t in zip(*parts, strict=True))
    assert pos.shape[:2] == (24, 32)
    assert split == pytest.approx(float(ordinal_accuracy(gt, pos, neg)))


def test_ranking_metrics_against_their_definition(bundle, data, proto):
    cands = rect_candidates(bundle)
    gt, pos, neg, p, _ = _embed_pairs(bundle, data, cands, 16, seed=2)
    d_pos, d_neg = (pos - proto).norm(dim=-1), (neg - proto).norm(dim=-1)
    rho = spearman(torch.cat([d_pos, d_neg], 1).double(), torch.cat([p.pos_iou, p.neg_iou], 1).double()).mean()
    m = ranking_metrics(bundle, data, proto, seed=2, chunk=5)  # rectangles by default, in chunks of 5 images
    assert m["ordacc"] == pytest.approx(float((d_pos < d_neg).float().mean() * 100))
    inst = ordinal_accuracy(gt, pos, neg)
    assert m["ordacc_inst"] == pytest.approx(float(inst))
    assert m["spearman"] == pytest.approx(float(rho), abs=1e-6) and m["spearman"] < -0.5  # nearer, more overlap
    assert ranking_metrics(bundle, with_features(bundle, data), proto, seed=2) == pytest.approx(m)
    few = training_candidates(bundle)
    _, pos_s, neg_s, _, _ = _embed_pairs(bundle, data, few, 4, seed=2)
    squares = float(ordinal_accuracy(proto.expand(len(pos_s), -1), pos_s, neg_s))
    assert ranking_metrics(bundle, data, proto, pairs=4, seed=2, candidates=few)["ordacc"] == pytest.approx(squares)


def test_localize_boxes_are_the_localizers_episodes(bundle, data, proto):
    agent = bundle.new_agent()
    loc = Localizer(bundle, "cpu")
    with torch.no_grad():
        greedy = loc.run(data.images, proto, agent).boxes
        nearest = loc.run(data.images, proto, agent, nearest=True).boxes
        best = loc.run(data.images, proto, agent, samples=3, generator=torch.Generator().manual_seed(5)).boxes
        sampled = loc.run(data.images, proto, agent, deterministic=False,
                          generator=torch.Generator().manual_seed(5)).boxes
    out = localize_boxes(bundle, agent, data, proto)
    assert out.shape == (bundle.config.env.steps + 1, len(data), 4) and out.device.type == "cpu"
    assert torch.equal(out, greedy)
    assert torch.equal(localize_boxes(bundle, agent, data, proto, nearest=True), nearest)
    assert not torch.equal(nearest[-1], greedy[-1])
    assert torch.equal(localize_boxes(bundle, agent, data, proto, samples=3, seed=5), best)
    assert torch.equal(localize_boxes(bundle, agent, data, proto, deterministic=False, seed=5), sampled)
    assert not torch.equal(sampled, greedy)
    carried = with_features(bundle, data)
    assert torch.allclose(localize_boxes(bundle, agent, carried, proto), greedy, atol=1e-4)
    assert torch.allclose(localize_boxes(bundle, agent, carried, proto, samples=3, seed=5), best, atol=1e-4)
    assert torch.allclose(localize_boxes(bundle, agent, carried, proto, batch=5), greedy, atol=1e-4)
    assert torch.equal(localize_boxes(bundle, agent, data, proto, batch=7), greedy)
    # one prototype per image, in chunks of images: each image's own (``nearest`` answers by it), on cached
    # features and on the images
    protos = proto + proto.norm() * torch.randn(len(data), proto.shape[-1], generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        own = loc.run(data.images, protos, agent, nearest=True).boxes
    assert not torch.equal(own[-1], nearest[-1])
    assert torch.allclose(localize_boxes(bundle, agent, carried, protos, batch=5, nearest=True), own, atol=1e-4)
    assert torch.equal(localize_boxes(bundle, agent, data, protos, batch=7, nearest=True), own)
    agent.train()
    localize_boxes(bundle, agent, data, proto)
    assert not agent.training  # episodes are run in evaluation mode


def test_corloc_of_the_last_boxes(bundle, data, proto):
    agent = bundle.new_agent()
    boxes = localize_boxes(bundle, agent, data, proto, nearest=True)[-1]
    value, final = evaluate_corloc(bundle, agent, data, proto, nearest=True)
    assert torch.equal(final, boxes) and value == corloc(boxes, data.boxes)
    sampled = localize_boxes(bundle, agent, data, proto, deterministic=False, seed=4)[-1]
    seed0 = localize_boxes(bundle, agent, data, proto, deterministic=False, seed=0)[-1]
    assert torch.equal(evaluate_corloc(bundle, agent, data, proto, deterministic=False)[1], seed0)  # seed 0 by default
    assert not torch.equal(seed0, sampled)
    assert torch.equal(evaluate_corloc(bundle, agent, data, proto, deterministic=False, seed=4)[1], sampled)
    assert torch.equal(evaluate_corloc(bundle, agent, data, proto, samples=2, seed=4)[1],
                       localize_boxes(bundle, agent, data, proto, samples=2, seed=4)[-1])


def test_ranking_picks_the_candidate_nearest_the_prototype(bundle, data, proto):
    data = data.subset(torch.arange(10))
    cands = ranking_candidates(bundle)
    with torch.no_grad():
        feats = features_of(bundle, data.images)
        d = (bundle.embedder.embed(feats, cands.expand(len(data), -1, -1)) - proto).norm(dim=-1)
    expect = cands[d.argmin(1)]
    got = ranking(bundle, data, proto)
    assert torch.equal(got, expect) and got.device.type == "cpu"
    assert torch.equal(ranking(bundle, data, proto, batch=4, chunk=100), expect)
    assert torch.equal(ranking(bundle, with_features(bundle, data), proto), expect)
    assert corloc(got, data.boxes) > 50  # the shipped embedding finds the digit
    few = cands[::9]
    assert torch.equal(ranking(bundle, data, proto, candidates=few), few[d[:, ::9].argmin(1)])


class _RightmostScorer:
    """A reward that prefers boxes further right; with ``pixels``, it is given the images too."""

    def __init__(self, pixels: bool | None):
        if pixels is not None:  # None: a scorer without the attribute (reads no pixels)
            self.pixels = pixels
        self.seen, self.given = [], []

    def box_distances(self, embedder, feats, boxes, images01):  # noqa: ANN001, ANN201
        self.seen.append(images01)
        self.given.append((embedder, feats))
        return -boxes[..., 0]


@pytest.mark.parametrize("pixels", [False, True, None])
def test_ranking_by_a_scorer(bundle, data, pixels):
    """A scorer ranks the candidates: given the bundle's embedder and each batch's feature maps, and the images only
    where it says it reads pixels."""
    scorer = _RightmostScorer(pixels)
    cands = ranking_candidates(bundle)
    got = ranking(bundle, data, None, scorer=scorer, batch=10, chunk=100)
    assert torch.equal(got, cands[cands[:, 0].argmax()].expand(len(data), 4))
    per_batch = (len(cands) + 99) // 100
    assert len(scorer.seen) == 3 * per_batch  # 3 batches of images, chunks of 100 candidates
    if pixels:
        assert torch.equal(torch.cat(scorer.seen[::per_batch]), data.images)
    else:
        assert all(s is None for s in scorer.seen)
    assert all(e is bundle.embedder for e, _ in scorer.given)
    with torch.no_grad():
        assert torch.allclose(torch.cat([f for _, f in scorer.given[::per_batch]]), features_of(bundle, data.images),
                              atol=1e-5)
