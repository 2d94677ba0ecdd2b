"""Local refinement of an answer (``models.refine``): the neighbours it tries, that it never moves away from the
prototype, that it finds a known box again, and that a bundle that refines answers its greedy runs with it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.bundle import load_bundle
from models.core.boxes import paired_iou
from models.experiments.cmnist import cmnist
from models.features import features_of
from models.inference import Localizer
from models.refine import RefineConfig, neighbours, refine

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def digits():
    return cmnist(4, "val", 12, "patch", 3)


def test_neighbours_shift_and_scale_the_box_and_stay_in_the_image():
    boxes = torch.tensor([[20.0, 30.0, 50.0, 70.0], [0.0, 0.0, 30.0, 30.0], [60.0, 50.0, 84.0, 84.0]])
    c = neighbours(boxes, (84.0, 84.0), 28.0, 0.1, 0.1, 3)
    assert c.shape == (3, 27, 4)
    assert torch.equal(c[0, 13], boxes[0])  # the middle candidate is the box itself
    w, h = c[..., 2] - c[..., 0], c[..., 3] - c[..., 1]
    assert (c[..., :2] >= 0).all() and (c[..., 2:] <= 84.0 + 1e-4).all()
    assert (w >= 28.0 - 1e-4).all() and (h >= 28.0 - 1e-4).all()
    # box 0 (30 x 40): centres move by 0 or +-3 px in x, 0 or +-4 px in y; sides by 0.9, 1, 1.1
    cx, cy = (c[0, :, 0] + c[0, :, 2]) / 2, (c[0, :, 1] + c[0, :, 3]) / 2
    assert sorted(set(torch.round(cx - 35, decimals=3).tolist())) == [-3.0, 0.0, 3.0]
    assert sorted(set(torch.round(cy - 50, decimals=3).tolist())) == [-4.0, 0.0, 4.0]
    assert sorted(set(torch.round(w[0], decimals=3).tolist())) == [28.0, 30.0, 33.0]  # 27 lifted to 28
    with pytest.raises(ValueError):
        RefineConfig(grid=2)
    with pytest.raises(ValueError):
        RefineConfig(shift=0.0)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("grid", 0, "odd grid"), ("grid", 2, "odd grid"), ("grid", 4, "odd grid"), ("rounds", -1, "rounds >= 0"),
    ("aspect_rounds", -1, "aspect_rounds >= 0"), ("shift", 0.0, "shift"), ("shift", 1.0, "shift"),
    ("shift", 1.5, "shift"), ("scale", 0.0, "scale"), ("scale", 1.0, "scale"), ("scale", 1.5, "scale"),
    ("decay", 0.0, "decay"), ("decay", 1.5, "decay"), ("aspect", 0.0, "aspect"), ("aspect", 1.0, "aspect"),
    ("aspect", 1.5, "aspect")])
def test_a_config_out_of_range_is_refused_with_what_it_got(field, value, says):
    with pytest.raises(ValueError, match=says) as e:
        RefineConfig(**{field: value})
    assert str(value) in str(e.value)  # the message says what it got


def test_the_edges_of_each_range_are_accepted():
    """One candidate (``grid=1``: the box alone), no rounds, steps just under 1 and a decay of 1 (no shrinking)."""
    for cfg in (RefineConfig(grid=1), RefineConfig(rounds=0), RefineConfig(decay=1.0),
                RefineConfig(shift=0.99, scale=0.99, aspect=0.99, aspect_rounds=1), RefineConfig(grid=5)):
        assert cfg.grid % 2 == 1


def test_neighbours_are_ordered_by_x_then_y_then_size_and_centred_on_the_box_for_a_wider_grid():
    """``grid=5``: shifts and scales ``k`` in ``-2 .. 2``, the candidates ordered by the x shift, then the y shift,
    then the size (each increasing), the middle one the box."""
    box = torch.tensor([[30.0, 30.0, 50.0, 50.0]])
    c = neighbours(box, (100.0, 100.0), 5.0, 0.1, 0.1, 5)[0]  # [125, 4]
    assert c.shape == (125, 4) and torch.equal(c[62], box[0])
    cx, cy, w = (c[:, 0] + c[:, 2]) / 2, (c[:, 1] + c[:, 3]) / 2, c[:, 2] - c[:, 0]
    k = torch.arange(5.0) - 2
    grid_x, grid_y, grid_s = torch.meshgrid(40 + 2 * k, 40 + 2 * k, 20 * (1 + 0.1 * k), indexing="ij")
    assert torch.allclose(cx, grid_x.flatten()) and torch.allclose(cy, grid_y.flatten())
    assert torch.allclose(w, grid_s.flatten()) and torch.allclose(c[:, 3] - c[:, 1], grid_s.flatten())


def test_neighbours_of_boxes_at_the_edges_keep_the_box_and_never_leave_a_wide_image():
    """A box touching the left and top edges is its own middle candidate (nothing pushes it in); a box as wide as
    the image is not scaled past it; on a 100 x 60 image the boxes use the whole width and stay within the height."""
    at_edge = torch.tensor([[0.0, 0.0, 30.0, 30.0]])
    c = neighbours(at_edge, (84.0, 84.0), 10.0, 0.2, 0.2, 3)[0]
    assert torch.equal(c[13], at_edge[0]) and c[:, 0].min() == 0 and c[:, 1].min() == 0
    whole = torch.tensor([[0.0, 0.0, 84.0, 84.0]])
    c = neighbours(whole, (84.0, 84.0), 10.0, 0.2, 0.2, 3)[0]
    assert (c[:, :2] >= 0).all() and (c[:, 2:] <= 84.0 + 1e-4).all()
    assert torch.allclose((c[:, 2] - c[:, 0]).max(), torch.tensor(84.0))  # scaled up, then held at the image's side
    wide = torch.tensor([[60.0, 20.0, 90.0, 50.0]])  # 30 x 30 on a 100 x 60 image
    c = neighbours(wide, (100.0, 60.0), 10.0, 0.3, 0.2, 3)[0]
    assert torch.equal(c[13], wide[0])
    assert (c[:, 2] <= 100.0 + 1e-4).all() and (c[:, 3] <= 60.0 + 1e-4).all() and (c[:, :2] >= 0).all()
    assert c[:, 2].max() > 95.0  # the width is the image's 100, not its height
    tall = torch.tensor([[0.0, 0.0, 50.0, 60.0]])  # as tall as the image: scaled up, its height is held at 60
    c = neighbours(tall, (100.0, 60.0), 10.0, 0.1, 0.2, 3)[0]
    assert torch.allclose((c[:, 3] - c[:, 1]).max(), torch.tensor(60.0)) and (c[:, 1] >= 0).all()


def test_shape_rounds_change_width_and_height_in_opposite_ways():
    """``aspect`` > 0: the third axis keeps the area and changes the shape (widths times ``(1 + aspect)^k``,
    heights divided by it); a round with the shape step runs only after the size rounds."""
    box = torch.tensor([[20.0, 20.0, 60.0, 60.0]])
    c = neighbours(box, (84.0, 84.0), 10.0, 0.1, 0.1, 3, aspect=0.25)
    w, h = c[0, :, 2] - c[0, :, 0], c[0, :, 3] - c[0, :, 1]
    assert torch.equal(c[0, 13], box[0])
    assert sorted(set(torch.round(w, decimals=3).tolist())) == [32.0, 40.0, 50.0]
    assert torch.allclose(w * h, torch.full_like(w, 1600.0))
    with pytest.raises(ValueError):
        RefineConfig(aspect_rounds=-1)
    with pytest.raises(ValueError):
        RefineConfig(aspect=0.0)


def test_shape_rounds_find_a_narrow_box_a_square_cannot(bundle, digits):
    """A prototype made from a narrow box: the size rounds alone keep the start's square shape; the shape rounds
    after them reach boxes nearer the prototype, most narrower than they are tall (the embedding of a bundle that
    never saw such boxes orders them loosely: no exact shape is asked for)."""
    feats = features_of(bundle, digits.images)
    emb = bundle.embedder
    narrow = digits.boxes.clone()
    cx = (narrow[:, 0] + narrow[:, 2]) / 2
    narrow[:, 0], narrow[:, 2] = cx - 9.0, cx + 9.0  # 18 px wide, as tall as the digit's box (28)
    protos = emb.embed(feats, narrow[:, None])[:, 0]
    start = digits.boxes
    d0 = (emb.embed(feats, start[:, None])[:, 0] - protos).norm(dim=-1)
    square, d_square = refine(emb, feats, protos, start, d0, (84.0, 84.0), 14.0)
    shaped, d_shaped = refine(emb, feats, protos, start, d0, (84.0, 84.0), 14.0, RefineConfig(aspect_rounds=4))
    sw, sh = square[:, 2] - square[:, 0], square[:, 3] - square[:, 1]
    assert torch.allclose(sw, sh, atol=1e-3)  # the size rounds keep the shape
    assert (d_shaped <= d_square).all() and (d_shaped < d_square).float().mean() >= 0.5
    aspect = (shaped[:, 2] - shaped[:, 0]) / (shaped[:, 3] - shaped[:, 1])
    assert float(aspect.median()) < 0.9, aspect
    # with no size rounds the first round already changes the shape
    first, _ = refine(emb, feats, protos, start, d0, (84.0, 84.0), 14.0, RefineConfig(rounds=0, aspect_rounds=1))
    fw, fh = first[:, 2] - first[:, 0], first[:, 3] - first[:, 1]
    assert float((fw / fh).median()) < 0.95, fw / fh


def test_refine_never_moves_away_from_the_prototype_and_finds_a_known_box_again(bundle, digits):
    feats = features_of(bundle, digits.images)
    emb = bundle.embedder
    truth = digits.boxes
    protos = emb.embed(feats, truth[:, None])[:, 0]  # each image's prototype: its own true box's embedding
    off = torch.tensor([4.0, -3.0, 7.0, 2.0])  # a start a few pixels off (shifted and larger)
    start = (truth + off).clamp(0, 84)
    d0 = (emb.embed(feats, start[:, None])[:, 0] - protos).norm(dim=-1)
    boxes, d = refine(emb, feats, protos, start, d0, (84.0, 84.0), 28.0)
    assert (d <= d0).all()
    assert torch.allclose(d, (emb.embed(feats, boxes[:, None])[:, 0] - protos).norm(dim=-1), atol=1e-4)
    assert paired_iou(boxes, truth).mean() > paired_iou(start, truth).mean() + 0.05
    same, d_same = refine(emb, feats, protos, start, d0, (84.0, 84.0), 28.0, RefineConfig(rounds=0))
    assert torch.equal(same, start) and torch.equal(d_same, d0)
    # already at the minimum (the true box, distance 0): nothing moves
    at, _ = refine(emb, feats, protos, truth, torch.zeros(len(truth)), (84.0, 84.0), 28.0)
    assert torch.equal(at, truth)


def test_a_bundle_that_refines_answers_greedy_runs_with_the_refined_box(bundle, digits):
    plain, refining = Localizer(bundle, "cpu"), Localizer(replace(bundle, refine=True), "cpu")
    proto = plain.prototype([digits.images[i][:, int(b[1]):int(b[3]), int(b[0]):int(b[2])]
                             for i, b in enumerate(digits.boxes[:5])])
    agent = plain.agent()
    a, b = plain.run(digits.images, proto, agent), refining.run(digits.images, proto, agent)
    assert torch.equal(a.boxes[:-1], b.boxes[:-1]) and torch.equal(a.actions, b.actions)  # the same walk
    assert (b.distances[-1] <= a.distances[-1] + 1e-6).all()
    assert not torch.equal(a.boxes[-1], b.boxes[-1])  # some answers moved
    # the answer is ``refine`` started from the walk's last box, with its distance; the rest of the walk as it was
    want, want_d = refine(bundle.embedder, features_of(bundle, digits.images), proto, a.boxes[-1], a.distances[-1],
                          (84.0, 84.0), bundle.config.env.min_side)
    assert torch.allclose(b.boxes[-1], want, atol=1e-4) and torch.allclose(b.distances[-1], want_d, atol=1e-5)
    assert b.distances.shape == a.distances.shape and not torch.equal(b.distances[-1], a.distances[-1])
    assert torch.allclose(b.distances[:-1], a.distances[:-1], equal_nan=True)  # (a greedy walk's are NaN but the last)
    one = torch.cat([refining.run(digits.images[i:i + 1], proto, agent).boxes[-1] for i in range(len(digits))])
    assert torch.allclose(one, b.boxes[-1], atol=1e-4)  # batched = one by one
    best = refining.run(digits.images, proto, agent, samples=3)
    assert (best.distances[-1] <= plain.run(digits.images, proto, agent, samples=3).distances[-1] + 1e-6).all()
    sampled = [loc.run(digits.images, proto, agent, deterministic=False, generator=torch.Generator().manual_seed(1))
               for loc in (plain, refining)]
    assert torch.equal(sampled[0].boxes, sampled[1].boxes)  # sampled episodes (adaptation's) are not refined
    out = refining.localize([digits.images[0]], proto, trajectory=True)[0]
    assert list(out.box) == pytest.approx(out.trajectory[-1]) and out.box == pytest.approx(b.boxes[-1, 0].tolist())
