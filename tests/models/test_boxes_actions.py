import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.ops import nms

from models.core import actions as actions_module
from models.core.actions import MNIST_ACTIONS, PHOTO_ACTIONS, apply_actions
from models.core.boxes import (
    candidate_boxes,
    check_boxes,
    clip_boxes,
    paired_intersection,
    paired_iou,
    pairwise_iou,
    square_candidates,
    top_k_per_image,
)


def slow_iou(a, b):
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union


def random_boxes(n, size=84.0, gen=None):
    xy = torch.rand(n, 2, generator=gen) * (size - 10)
    wh = 1 + torch.rand(n, 2, generator=gen) * (size - xy - 1)
    return torch.cat([xy, xy + wh], 1)


def test_iou_matches_slow_reference():
    g = torch.Generator().manual_seed(0)
    a, b = random_boxes(30, gen=g), random_boxes(20, gen=g)
    fast = pairwise_iou(a, b)
    for i in range(len(a)):
        for j in range(len(b)):
            assert abs(fast[i, j].item() - slow_iou(a[i].tolist(), b[j].tolist())) < 1e-5
    assert torch.allclose(paired_iou(a[:20], b), fast[torch.arange(20), torch.arange(20)])
    assert torch.allclose(pairwise_iou(a, a).diagonal(), torch.ones(30))


def test_iou_known_values():
    a = torch.tensor([[0.0, 0, 10, 10]])
    assert paired_iou(a, torch.tensor([[5.0, 0, 15, 10]])).item() == pytest.approx(50 / 150)
    assert paired_iou(a, torch.tensor([[20.0, 20, 30, 30]])).item() == 0.0


def test_clip_and_check():
    b = clip_boxes(torch.tensor([[-5.0, -1, 90, 50]]), 84, 84)
    assert b.tolist() == [[0.0, 0.0, 84.0, 50.0]]
    check_boxes(b, 84, 84)
    for bad in ([[5.0, 5, 5, 9]], [[0.0, 0, 90, 9]]):
        try:
            check_boxes(torch.tensor(bad), 84, 84)
        except ValueError:
            continue
        raise AssertionError(f"{bad} should be refused")


def test_square_candidates_cover_range():
    c = square_candidates(84, 28, 76, 4, 4)
    check_boxes(c, 84, 84)
    wh = c[:, 2:] - c[:, :2]
    assert wh.min() >= 14 and wh.max() <= 76
    assert len(torch.unique(c, dim=0)) == len(c)


box_st = st.tuples(st.floats(0, 80), st.floats(0, 80), st.floats(1, 84), st.floats(1, 84)).map(
    lambda t: (t[0], t[1], min(84.0, t[0] + t[2]), min(84.0, t[1] + t[3]))).filter(
    lambda b: b[2] - b[0] >= 1 and b[3] - b[1] >= 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(box_st, min_size=1, max_size=8), st.integers(0, PHOTO_ACTIONS - 1), st.integers(0, 12))
def test_every_action_keeps_boxes_valid(boxes, action, repeat):
    b = torch.tensor(boxes, dtype=torch.float32)
    min_side = 28.0
    for _ in range(repeat + 1):
        before = b
        b = apply_actions(b, torch.full((len(b),), action), 84, 84, 0.2, min_side)
        check_boxes(b, 84, 84)
        wh, wh0 = b[:, 2:] - b[:, :2], before[:, 2:] - before[:, :2]
        # A side never falls below the minimum, unless it already was (then it never shrinks).
        assert bool((wh >= torch.minimum(wh0, torch.full_like(wh0, min_side)) - 1e-3).all())


def test_action_semantics():
    b = torch.tensor([[10.0, 10, 60, 60]])

    def act(a):
        return apply_actions(b, torch.tensor([a]), 84, 84, 0.2, 28)[0].tolist()
    assert act(0) == [10, 10, 50, 50]
    assert act(3) == [20, 20, 60, 60]
    assert act(4) == [15, 15, 55, 55]
    assert act(5) == [10, 10, 60, 60]
    assert act(6) == [0, 10, 50, 60]   # 10 px left, snapped at the border
    assert act(7) == [20, 10, 70, 60]
    assert act(9) == [10, 20, 60, 70]
    assert act(7 + 0) != act(6)
    small = torch.tensor([[0.0, 0, 30, 30]])
    assert apply_actions(small, torch.tensor([0]), 84, 84, 0.2, 28)[0].tolist() == [0, 0, 28, 28]


def test_batched_actions_equal_per_sample_loop():
    g = torch.Generator().manual_seed(1)
    boxes = random_boxes(64, gen=g)
    actions = torch.randint(0, PHOTO_ACTIONS, (64,), generator=g)
    batched = apply_actions(boxes, actions, 84, 84, 0.2, 28)
    for i in range(64):
        single = apply_actions(boxes[i:i + 1], actions[i:i + 1], 84, 84, 0.2, 28)
        assert torch.equal(batched[i], single[0])
    assert MNIST_ACTIONS == 10


def test_intersection_of_half_precision_boxes_is_computed_in_float32():
    # 999 x 999 = 998,001 is past float16's largest value (65,504): the area must not be taken in the boxes' dtype
    a = torch.tensor([[0.0, 0, 1000, 1000]], dtype=torch.float16)
    b = torch.tensor([[1.0, 1, 1500, 1500]], dtype=torch.float16)
    inter = paired_intersection(a, b)
    assert inter.dtype == torch.float32 and inter.item() == 999 * 999
    assert paired_iou(a, b).item() == pytest.approx(999 * 999 / (1000 * 1000 + 1499 * 1499 - 999 * 999))
    wide = torch.tensor([[0.0, 0, 3, 2]], dtype=torch.float64)
    assert paired_intersection(wide, wide).dtype == torch.float64  # float64 kept as it is


def test_candidate_boxes_by_value_on_a_small_grid():
    # sides 16 and 32 (every 16 px from 16 to 32), squares, corners every 16 px on a 48-px image; clipped boxes
    # under 0.5 x 16 = 8 px dropped, the rest deduplicated
    c = candidate_boxes(48, 16, 32, side_step=16, stride=16)
    assert c.dtype == torch.float32
    want = set()
    for s in (16, 32):
        for y in (0, 16, 32):
            for x in (0, 16, 32):
                x2, y2 = min(x + s, 48), min(y + s, 48)
                if x2 - x >= 8 and y2 - y >= 8:
                    want.add((float(x), float(y), float(x2), float(y2)))
    assert {tuple(b) for b in c.tolist()} == want and len(c) == len(want)


def test_candidate_boxes_geometric_sides_default_stride_and_aspect():
    # sides=3 from 16 to the image's 64 px: 16, 32, 64 (geometric); the default stride max(4, 64 // 16) = 4
    c = candidate_boxes(64, 16, sides=3, min_fraction=1.0)
    corner = c[(c[:, 0] == 0) & (c[:, 1] == 0)]  # the boxes at the top-left corner, none clipped
    assert corner.tolist() == [[0.0, 0.0, 16.0, 16.0], [0.0, 0.0, 32.0, 32.0], [0.0, 0.0, 64.0, 64.0]]  # squares
    assert sorted(set(c[:, 0].tolist())) == [float(x) for x in range(0, 64 - 16 + 1, 4)]  # every corner x, stride 4
    assert candidate_boxes(84, 28, 28, side_step=4, min_fraction=1.0)[:, 0].unique().tolist() == [
        float(x) for x in range(0, 84 - 28 + 1, 5)]  # 84 // 16 = 5
    tall = candidate_boxes(64, 16, 32, side_step=16, stride=64, max_aspect=2.0)
    assert {tuple(b) for b in tall.tolist()} == {(0.0, 0.0, 16.0, 16.0), (0.0, 0.0, 16.0, 32.0),
                                                 (0.0, 0.0, 32.0, 16.0), (0.0, 0.0, 32.0, 32.0)}
    with pytest.raises(ValueError, match="^give exactly one of side_step"):
        candidate_boxes(64, 16, side_step=4, sides=3)
    with pytest.raises(ValueError, match="^give exactly one of side_step"):
        candidate_boxes(64, 16)


def test_top_k_per_image_equals_nms_image_by_image():
    g = torch.Generator().manual_seed(4)
    b, k, per = 4, 3, 12
    boxes = random_boxes(b * per, gen=g)
    scores = torch.rand(b * per, generator=g)
    image = torch.arange(b).repeat_interleave(per)[torch.randperm(b * per, generator=g)]  # images mixed
    image[image == 2] = 1  # image 2 has no candidate at all
    boxes[image == 3] = torch.tensor([10.0, 10, 40, 40])  # image 3: one box repeated: one survivor
    idx, valid = top_k_per_image(boxes, scores, image, b, k, 0.5)
    assert idx.shape == valid.shape == (b, k) and idx.dtype == torch.long and valid.dtype == torch.bool
    for i in range(b):
        mine = (image == i).nonzero().flatten()
        want = mine[nms(boxes[mine], scores[mine], 0.5)][:k].tolist()
        n = len(want)
        assert idx[i, :n].tolist() == want and valid[i].tolist() == [True] * n + [False] * (k - n)
        assert idx[i, n:].tolist() == [0] * (k - n)
    assert valid.sum(1).tolist() == [3, 3, 0, 1]


def test_action_tables_are_built_per_image_size_and_never_more_than_64():
    kept = dict(actions_module._TABLES)  # put back after: a compiled episode of this process is guarded on them
    actions_module._TABLES.clear()
    try:
        box = torch.tensor([[10.0, 10, 60, 60]])
        sizes = []
        for side in range(70, 170):  # 100 image sizes: the cache starts over at 64
            moved = apply_actions(box, torch.tensor([7]), side, side, 0.2, 28)
            assert moved.tolist() == [[min(20.0, side - 50.0), 10.0, min(70.0, float(side)), 60.0]]
            sizes.append(len(actions_module._TABLES))
            assert len(actions_module._TABLES) <= 64
        assert max(sizes) == 64
    finally:
        actions_module._TABLES.clear()
        actions_module._TABLES.update(kept)
