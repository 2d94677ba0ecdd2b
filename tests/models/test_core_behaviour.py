"""Behaviour tests of the pure tensor modules against hand-computed values.

Every expected number below is written out (or follows from one line of arithmetic in the test), never
from a re-implementation of the code under test, so that each test fails when the behaviour changes.
The images are deliberately not square (width 100, height 80) and the boxes not square (w != h), so
that a swapped width/height or x/y shows.
"""

import math
import re

import pytest
import torch

from models.core.actions import ACTION_NAMES, MNIST_ACTIONS, PHOTO_ACTIONS, apply_actions
from models.core.boxes import (
    box_area,
    check_boxes,
    clip_boxes,
    full_image_boxes,
    paired_iou,
    pairwise_iou,
    square_candidates,
)
from models.core.ordinal import (
    ANCHORS,
    BoxPairs,
    anchors_for,
    group_prototypes,
    ordinal_accuracy,
    sample_pairs,
    triplet_loss,
)
from models.core.reinforce import PolicyLoss, discounted_returns, reinforce_loss

W, H = 100, 80  # a non-square image


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def act(box, action, width=W, height=H, **kw):
    """One box, one action -> the new box as a list."""
    out = apply_actions(t([box]), torch.tensor([action]), width, height, **kw)
    assert out.shape == (1, 4)
    return out[0].tolist()


def close(got, expected, tol=1e-4):
    """``got`` equals ``expected`` (a number or a nested list) within ``tol``, with the same nesting."""
    if isinstance(expected, list | tuple):
        return (isinstance(got, list | tuple) and len(got) == len(expected)
                and all(close(g, e, tol) for g, e in zip(got, expected, strict=True)))
    return not isinstance(got, list | tuple) and got == pytest.approx(expected, abs=tol)


# --------------------------------------------------------------------------- actions


def test_action_names_and_counts():
    assert MNIST_ACTIONS == 10 and PHOTO_ACTIONS == 14
    assert len(ACTION_NAMES) == 14
    assert ACTION_NAMES[:MNIST_ACTIONS] == ("shrink_tl", "shrink_tr", "shrink_bl", "shrink_br", "shrink_center",
                                            "stay", "left", "right", "up", "down")
    assert ACTION_NAMES[MNIST_ACTIONS:] == ("taller", "wider", "narrower", "shorter")


# Box (20, 10, 70, 50): w = 50, h = 40, centre (45, 30), in a 100 x 80 image.
# Defaults: alpha = 0.2 -> shrunk 40 x 32, moves of 10 px (x) / 8 px (y); resize = 0.2 -> grown 60 / 48,
# cut 40 / 32; min_side = 28 does not bind.
DEFAULT_TABLE = {
    0: [20, 10, 60, 42],    # shrink keeping top-left
    1: [30, 10, 70, 42],    # keeping top-right
    2: [20, 18, 60, 50],    # keeping bottom-left
    3: [30, 18, 70, 50],    # keeping bottom-right
    4: [25, 14, 65, 46],    # toward the centre
    5: [20, 10, 70, 50],    # stay
    6: [10, 10, 60, 50],    # left 10
    7: [30, 10, 80, 50],    # right 10
    8: [20, 2, 70, 42],     # up 8 (y decreases)
    9: [20, 18, 70, 58],    # down 8
    10: [20, 6, 70, 54],    # taller: h 40 -> 48 about the centre
    11: [15, 10, 75, 50],   # wider: w 50 -> 60 about the centre
    12: [25, 10, 65, 50],   # narrower: w 50 -> 40
    13: [20, 14, 70, 46],   # shorter: h 40 -> 32
}


@pytest.mark.parametrize("action", range(14))
def test_each_action_default_parameters(action):
    assert close(act([20, 10, 70, 50], action), DEFAULT_TABLE[action])


def test_all_actions_batched_on_one_box():
    boxes = t([[20, 10, 70, 50]] * 14)
    out = apply_actions(boxes, torch.arange(14), W, H)
    assert out.shape == (14, 4)
    assert close(out.tolist(), [DEFAULT_TABLE[a] for a in range(14)])
    # the input is not modified
    assert boxes.tolist() == [[20, 10, 70, 50]] * 14


def test_batch_rows_keep_their_own_box_and_action():
    boxes = t([[20, 10, 70, 50], [5, 10, 55, 50], [10, 10, 40, 60], [20, 36, 70, 76]])
    out = apply_actions(boxes, torch.tensor([8, 6, 3, 9]), W, H)
    assert close(out.tolist(), [[20, 2, 70, 42], [0, 10, 50, 50], [12, 20, 40, 60], [20, 40, 70, 80]])


def test_up_moves_up_and_down_moves_down():
    box = [20, 30, 70, 50]  # h = 20 -> 4 px
    assert close(act(box, 8), [20, 26, 70, 46])
    assert close(act(box, 9), [20, 34, 70, 54])
    assert close(act(box, 6), [10, 30, 60, 50])
    assert close(act(box, 7), [30, 30, 80, 50])


def test_taller_and_wider_are_not_swapped():
    box = [20, 10, 70, 50]
    taller, wider = act(box, 10), act(box, 11)
    assert close(taller[3] - taller[1], 48) and close(taller[2] - taller[0], 50)
    assert close(wider[2] - wider[0], 60) and close(wider[3] - wider[1], 40)
    narrower, shorter = act(box, 12), act(box, 13)
    assert close(narrower[2] - narrower[0], 40) and close(narrower[3] - narrower[1], 40)
    assert close(shorter[3] - shorter[1], 32) and close(shorter[2] - shorter[0], 50)


# alpha = 0.1 -> shrunk 45 x 36, moves 5 / 4; resize = 0.5 -> grown 75 / 60, cut 25 / 20; min_side 10.
CUSTOM_TABLE = {
    0: [20, 10, 65, 46],
    1: [25, 10, 70, 46],
    2: [20, 14, 65, 50],
    3: [25, 14, 70, 50],
    4: [22.5, 12, 67.5, 48],
    5: [20, 10, 70, 50],
    6: [15, 10, 65, 50],
    7: [25, 10, 75, 50],
    8: [20, 6, 70, 46],
    9: [20, 14, 70, 54],
    10: [20, 0, 70, 60],
    11: [7.5, 10, 82.5, 50],
    12: [32.5, 10, 57.5, 50],
    13: [20, 20, 70, 40],
}


@pytest.mark.parametrize("action", range(14))
def test_each_action_custom_alpha_resize_min_side(action):
    got = act([20, 10, 70, 50], action, alpha=0.1, resize=0.5, min_side=10.0)
    assert close(got, CUSTOM_TABLE[action])


def test_defaults_are_alpha_02_min_side_28_resize_02():
    boxes = t([[20, 10, 70, 50], [10, 10, 40, 60], [10, 10, 60, 40]] * 14)
    actions = torch.arange(14).repeat_interleave(3)
    assert torch.equal(apply_actions(boxes, actions, W, H),
                       apply_actions(boxes, actions, W, H, alpha=0.2, min_side=28.0, resize=0.2))


def test_shrinks_stop_at_min_side_in_x():
    # w = 30: 0.8 * 30 = 24 < 28 -> 28; h = 50 -> 40.
    box = [10, 10, 40, 60]
    assert close(act(box, 0), [10, 10, 38, 50])
    assert close(act(box, 1), [12, 10, 40, 50])
    assert close(act(box, 2), [10, 20, 38, 60])
    assert close(act(box, 3), [12, 20, 40, 60])
    assert close(act(box, 4), [11, 15, 39, 55])
    assert close(act(box, 12), [11, 10, 39, 60])   # narrower: 28, not 24
    assert close(act(box, 13), [10, 15, 40, 55])   # shorter: 40


def test_shrinks_stop_at_min_side_in_y():
    # h = 30: 24 < 28 -> 28; w = 50 -> 40.
    box = [10, 10, 60, 40]
    assert close(act(box, 0), [10, 10, 50, 38])
    assert close(act(box, 1), [20, 10, 60, 38])
    assert close(act(box, 2), [10, 12, 50, 40])
    assert close(act(box, 3), [20, 12, 60, 40])
    assert close(act(box, 4), [15, 11, 55, 39])
    assert close(act(box, 12), [15, 10, 55, 40])   # narrower: 40
    assert close(act(box, 13), [10, 11, 60, 39])   # shorter: 28, not 24


def test_min_side_floor_with_other_values():
    box = [10, 10, 60, 40]  # w 50, h 30
    # min_side 45: w -> 45 (not 40), h (already below) stays 30
    assert close(act(box, 0, min_side=45.0), [10, 10, 55, 40])
    assert close(act(box, 12, min_side=45.0), [12.5, 10, 57.5, 40])
    assert close(act(box, 13, min_side=45.0), [10, 10, 60, 40])
    # min_side 0: plain 20 % cuts
    assert close(act(box, 3, min_side=0.0), [20, 16, 60, 40])


def test_sides_already_below_min_side_never_shrink():
    box = [10, 10, 30, 25]  # 20 x 15, both below 28
    for a in (0, 1, 2, 3, 4, 12, 13):
        assert close(act(box, a), box), a


def test_moves_snap_at_each_border():
    assert close(act([5, 10, 55, 50], 6), [0, 10, 50, 50])      # left: x1 = -5 -> 0
    assert close(act([45, 10, 95, 50], 7), [50, 10, 100, 50])   # right: x2 = 105 -> width 100
    assert close(act([20, 4, 70, 44], 8), [20, 0, 70, 40])      # up: y1 = -4 -> 0
    assert close(act([20, 36, 70, 76], 9), [20, 40, 70, 80])    # down: y2 = 84 -> height 80
    # already at the border: nothing moves
    assert close(act([0, 10, 50, 50], 6), [0, 10, 50, 50])
    assert close(act([50, 10, 100, 50], 7), [50, 10, 100, 50])
    assert close(act([20, 0, 70, 40], 8), [20, 0, 70, 40])
    assert close(act([20, 40, 70, 80], 9), [20, 40, 70, 80])


def test_moves_snap_with_custom_alpha():
    # alpha 0.5 on a 40 x 20 box: moves of 20 / 10
    assert close(act([10, 30, 50, 50], 6, alpha=0.5), [0, 30, 40, 50])
    assert close(act([50, 30, 90, 50], 7, alpha=0.5), [60, 30, 100, 50])
    assert close(act([10, 5, 50, 25], 8, alpha=0.5), [10, 0, 50, 20])
    assert close(act([10, 55, 50, 75], 9, alpha=0.5), [10, 60, 50, 80])


def test_grow_actions_snap_inside_the_image():
    assert close(act([10, 0, 40, 40], 10), [10, 0, 40, 48])      # taller at the top: y1 -4 -> 0
    assert close(act([10, 40, 40, 80], 10), [10, 32, 40, 80])    # taller at the bottom: moved up
    assert close(act([0, 10, 50, 50], 11), [0, 10, 60, 50])      # wider at the left: x1 -5 -> 0
    assert close(act([50, 10, 100, 50], 11), [40, 10, 100, 50])  # wider at the right: moved left


def test_grow_actions_are_capped_at_the_image_size():
    assert close(act([10, 5, 40, 75], 10), [10, 0, 40, 80])      # h 70 -> 84 capped at height 80
    assert close(act([5, 10, 95, 50], 11), [0, 10, 100, 50])     # w 90 -> 108 capped at width 100
    assert close(act([0, 0, 100, 80], 10), [0, 0, 100, 80])
    assert close(act([0, 0, 100, 80], 11), [0, 0, 100, 80])
    # a tall box in a wide image: wider is capped by the width, taller by the height
    assert close(act([5, 10, 95, 70], 11, width=100, height=200), [0, 10, 100, 70])
    assert close(act([10, 10, 90, 70], 10, width=200, height=70), [10, 0, 90, 70])


def test_actions_on_a_tall_image():
    # width 60, height 120: the same move rules with the axes the other way round
    assert close(act([30, 100, 58, 118], 7, width=60, height=120), [32, 100, 60, 118])
    assert close(act([30, 100, 58, 118], 9, width=60, height=120), [30, 102, 58, 120])
    assert close(act([30, 100, 58, 118], 10, width=60, height=120), [30, 98.2, 58, 119.8])


def test_shrink_center_at_the_corner():
    assert close(act([0, 0, 50, 40], 4), [5, 4, 45, 36])
    assert close(act([50, 40, 100, 80], 4), [55, 44, 95, 76])


# --------------------------------------------------------------------------- boxes


def test_box_area_values_and_dtypes():
    a = box_area(t([[0, 0, 4, 2], [1, 2, 4, 7]]))
    assert a.tolist() == [8.0, 15.0] and a.dtype == torch.float32
    ints = box_area(torch.tensor([[0, 0, 3, 4]]))  # int64 in, float out
    assert ints.dtype == torch.float32 and ints.tolist() == [12.0]
    half = box_area(torch.tensor([[0, 0, 3, 4]], dtype=torch.float16))
    assert half.dtype == torch.float32 and half.tolist() == [12.0]
    dbl = box_area(torch.tensor([[0, 0, 0.5, 0.25]], dtype=torch.float64))
    assert dbl.dtype == torch.float64 and dbl.tolist() == [0.125]


def test_box_area_degenerate_boxes_clamp_to_zero():
    # each side clamps on its own: two negative sides must not make a positive area
    a = box_area(t([[5, 5, 2, 1], [5, 5, 2, 9], [5, 5, 9, 1], [3, 3, 3, 8]]))
    assert a.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_box_area_keeps_leading_dims():
    a = box_area(t([[[0, 0, 1, 1], [0, 0, 2, 3]]]))
    assert a.shape == (1, 2) and a.tolist() == [[1.0, 6.0]]


def test_paired_iou_known_values():
    a = t([[0, 0, 4, 2], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 2, 2]])
    b = t([[2, 1, 6, 5], [5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 2, 2]])
    # inter 2 x 1 = 2, union 8 + 16 - 2 = 22; 50 / 150; disjoint; identical
    assert close(paired_iou(a, b).tolist(), [2 / 22, 50 / 150, 0.0, 1.0], 1e-6)
    # symmetric
    assert close(paired_iou(b, a).tolist(), [2 / 22, 50 / 150, 0.0, 1.0], 1e-6)
    # touching edges: zero
    assert paired_iou(t([0, 0, 5, 5]), t([5, 0, 9, 5])).item() == 0.0
    # one inside the other: 4 / 100
    assert close(paired_iou(t([0, 0, 10, 10]), t([3, 3, 5, 5])).item(), 0.04, 1e-7)


def test_paired_iou_broadcasts_and_dtypes():
    a = t([[0, 0, 4, 2]])
    b = t([[[2, 1, 6, 5]], [[0, 0, 4, 2]]])  # [2, 1, 4]
    out = paired_iou(a, b)
    assert out.shape == (2, 1) and close(out.tolist(), [[2 / 22], [1.0]], 1e-6)
    assert paired_iou(a.double(), b.double()).dtype == torch.float64
    ints = paired_iou(torch.tensor([0, 0, 4, 2]), torch.tensor([2, 1, 6, 5]))
    assert ints.dtype == torch.float32 and close(ints.item(), 2 / 22, 1e-6)


def test_paired_iou_keeps_float64_precision():
    a = torch.tensor([0, 0, 1 + 1e-10, 1], dtype=torch.float64)  # 1 + 1e-10 is 1 in float32
    b = torch.tensor([0, 0, 1, 1], dtype=torch.float64)
    assert paired_iou(a, a.clone()).item() == 1.0
    assert paired_iou(b, b.clone()).item() == 1.0
    assert paired_iou(a, b).item() == pytest.approx(1 / (1 + 1e-10), abs=1e-14)
    assert paired_iou(a, b).item() < 1.0 and paired_iou(b, a).item() < 1.0


def test_paired_iou_small_and_empty_boxes():
    tiny = t([0, 0, 0.5, 0.5])  # union 0.25 < 1: must still be 1
    assert close(paired_iou(tiny, tiny).item(), 1.0, 1e-6)
    empty = t([3, 3, 3, 3])  # zero union: 0, not nan
    assert paired_iou(empty, empty).item() == 0.0


def test_pairwise_iou_matrix():
    a = t([[0, 0, 4, 2], [0, 0, 10, 10]])
    b = t([[2, 1, 6, 5], [5, 0, 15, 10], [0, 0, 4, 2]])
    m = pairwise_iou(a, b)
    assert m.shape == (2, 3)
    # [0, 0, 10, 10] vs [2, 1, 6, 5]: 16 / 100; vs [0, 0, 4, 2]: 8 / 100
    # [0, 0, 4, 2] vs [5, 0, 15, 10]: disjoint
    assert close(m.tolist(), [[2 / 22, 0.0, 1.0], [0.16, 0.5 / 1.5, 0.08]], 1e-6)


def test_clip_boxes_to_a_non_square_image():
    b = clip_boxes(t([[-5, -6, 120, 90], [10, -3, 50, 85], [20, 10, 70, 50], [-1, 90, 110, 95]]), W, H)
    assert b.tolist() == [[0, 0, 100, 80], [10, 0, 50, 80], [20, 10, 70, 50], [0, 80, 100, 80]]
    # leading dims kept, x against width and y against height
    b3 = clip_boxes(t([[[90, 90, 95, 95]]]), 92, 91)
    assert b3.shape == (1, 1, 4) and b3.tolist() == [[[90, 90, 92, 91]]]


def test_check_boxes_accepts_and_returns_the_same_tensor():
    b = t([[0, 0, 100, 80], [20, 10, 70, 50], [0, 0, 99, 1]])
    assert check_boxes(b, W, H) is b
    assert check_boxes(b) is b
    # x may go up to the width (100 > height 80)
    check_boxes(t([[10, 10, 95, 20]]), W, H)


@pytest.mark.parametrize("shape", [(2, 3), (2, 5), (4,) * 3 + (3,)])
def test_check_boxes_last_dim(shape):
    msg = f"boxes must have a last dimension of 4 (x1, y1, x2, y2), got shape {shape}"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        check_boxes(torch.ones(shape))


@pytest.mark.parametrize("box", [[5, 0, 5, 10], [6, 0, 5, 10], [0, 5, 10, 5], [0, 6, 10, 5]])
def test_check_boxes_refuses_empty_or_flipped(box):
    with pytest.raises(ValueError, match=r"^boxes must satisfy x1 < x2 and y1 < y2 \(format x1, y1, x2, y2\)$"):
        check_boxes(t([[0, 0, 1, 1], box]))  # one bad box among good ones is enough


@pytest.mark.parametrize("box", [
    [-0.001, 10, 50, 50],  # left
    [10, -0.001, 50, 50],  # top
    [10, 10, 100.001, 50],  # right
    [10, 10, 50, 80.001],  # bottom
    [10, 10, 50, 85],  # bottom, still inside the width
])
def test_check_boxes_each_image_edge(box):
    with pytest.raises(ValueError, match="^boxes must lie inside the 100x80 image$"):
        check_boxes(t([[20, 10, 70, 50], box]), W, H)


def test_check_boxes_eps_tolerance():
    check_boxes(t([[-0.00005, -0.00005, 100.00005, 80.00005]]), W, H)
    check_boxes(t([[-0.00009, 0, 50, 50]]), W, H)
    # the tolerance 1e-4 is inclusive (float64, so that the values are exact)
    eps = 1e-4
    edge = torch.tensor([[-eps, -eps, W + eps, H + eps]], dtype=torch.float64)
    check_boxes(edge, W, H)
    for i, d in enumerate((-1e-6, -1e-6, 1e-6, 1e-6)):
        past = edge.clone()
        past[0, i] += d
        with pytest.raises(ValueError, match="inside"):
            check_boxes(past, W, H)


def test_check_boxes_needs_width_and_height_for_the_inside_check():
    outside = t([[-10, -10, 500, 500]])
    check_boxes(outside)
    check_boxes(outside, width=W)
    check_boxes(outside, height=H)
    with pytest.raises(ValueError):
        check_boxes(outside, W, H)


def test_square_candidates_tiny_exact():
    c = square_candidates(8, 4, 6, side_step=2, stride=4)
    assert c.dtype == torch.float32
    assert sorted(c.tolist()) == [
        [0, 0, 4, 4], [0, 0, 6, 6], [0, 4, 4, 8], [0, 4, 6, 8],
        [4, 0, 8, 4], [4, 0, 8, 6], [4, 4, 8, 8],
    ]


def test_square_candidates_keeps_clipped_boxes_of_half_min_side():
    # starts 0, 4, 8; the squares at 8 are clipped to [8, 10]: 2 = min_side / 2, kept
    c = square_candidates(10, 4, 4, side_step=1, stride=4)
    iv = [[0, 4], [4, 8], [8, 10]]
    assert sorted(c.tolist()) == sorted([[x[0], y[0], x[1], y[1]] for x in iv for y in iv])


def test_square_candidates_drops_clipped_boxes_below_half_min_side():
    # stride 3: starts 0, 3, 6, 9; the squares at 9 are clipped to [9, 10] (1 < 2): dropped
    c = square_candidates(10, 4, 4, side_step=1, stride=3)
    iv = [[0, 4], [3, 7], [6, 10]]
    assert sorted(c.tolist()) == sorted([[x[0], y[0], x[1], y[1]] for x in iv for y in iv])


def test_square_candidates_defaults_and_dedup():
    # defaults side_step = stride = 4: sides 4, 8 on starts 0, 4, 8 in a 12 x 12 image;
    # side 8 at 8 is clipped to [8, 12], the same as side 4 at 8: 9 + 9 - 1 = 17 boxes
    c = square_candidates(12, 4, 8)
    assert c.shape == (17, 4)
    assert torch.equal(c, square_candidates(12, 4, 8, side_step=4, stride=4))
    assert [8.0, 8.0, 12.0, 12.0] in c.tolist() and [0.0, 4.0, 8.0, 12.0] in c.tolist()
    assert len({tuple(r) for r in c.tolist()}) == 17


def test_full_image_boxes():
    b = full_image_boxes(3, W, H)
    assert b.shape == (3, 4) and b.dtype == torch.float32
    assert b.tolist() == [[0, 0, 100, 80]] * 3
    b[0, 0] = 7  # independent rows (a real copy, not an expanded view)
    assert b.tolist() == [[7, 0, 100, 80], [0, 0, 100, 80], [0, 0, 100, 80]]
    assert full_image_boxes(1, 12.5, 30).tolist() == [[0, 0, 12.5, 30]]
    assert full_image_boxes(2, W, H, device="cpu").device.type == "cpu"
    meta = full_image_boxes(2, W, H, device="meta")  # the device is honoured (meta: no memory, no GPU)
    assert meta.device.type == "meta" and meta.shape == (2, 4)


# --------------------------------------------------------------------------- ordinal: sample_pairs

GT = t([[0, 0, 10, 10]])
# IoU with GT, bin (bins = 10): 0.0999 -> 0 | 0.1 -> 1 | 0.1999 -> 1 | 0.2 -> 2 | 0.85 -> 8 | 1.0 -> 9 (last bin)
EDGE = {
    "a": [0, 0, 10, 0.999],
    "b": [0, 0, 10, 1],
    "f": [0, 0, 10, 1.999],
    "d": [0, 0, 10, 2],
    "h": [0, 0, 10, 8.5],
    "e": [0, 0, 10, 10],
}
EDGE_IOU = {"a": 0.0999, "b": 0.1, "f": 0.1999, "d": 0.2, "h": 0.85, "e": 1.0}


def names_of(boxes):
    inv = {tuple(v): k for k, v in EDGE.items()}
    return [inv[tuple(round(x, 4) for x in row)] for row in boxes.tolist()]


def test_sample_pairs_bin_edges_decide_which_pairs_exist():
    cands = t(list(EDGE.values()))
    p = sample_pairs(GT, cands, 400, bins=10, generator=torch.Generator().manual_seed(0))
    assert isinstance(p, BoxPairs)
    assert p.pos.shape == (1, 400, 4) and p.neg.shape == (1, 400, 4)
    assert p.pos_iou.shape == (1, 400) and p.neg_iou.shape == (1, 400)
    pos, neg = names_of(p.pos[0]), names_of(p.neg[0])
    seen = {(x, y) for x, y in zip(pos, neg, strict=True)}
    # every (pos, neg) pair of boxes in two different bins, ordered by IoU; never b with f (both bin 1)
    order = ["a", "b", "f", "d", "h", "e"]  # increasing IoU
    expected = {(order[j], order[i]) for i in range(6) for j in range(i + 1, 6)} - {("f", "b")}
    assert seen == expected
    for x, y, pi, ni in zip(pos, neg, p.pos_iou[0].tolist(), p.neg_iou[0].tolist(), strict=True):
        assert close(pi, EDGE_IOU[x], 1e-6) and close(ni, EDGE_IOU[y], 1e-6)
        assert pi > ni


def test_sample_pairs_exactly_at_a_bin_edge():
    # IoU 0.0999 and 0.1 lie in bins 0 and 1: the only pair is (0.1, 0.0999)
    p = sample_pairs(GT, t([EDGE["b"], EDGE["a"]]), 5, generator=torch.Generator().manual_seed(1))
    assert names_of(p.pos[0]) == ["b"] * 5 and names_of(p.neg[0]) == ["a"] * 5
    # IoU 0.2 and 0.1999 too (bins 2 and 1)
    p = sample_pairs(GT, t([EDGE["f"], EDGE["d"]]), 5, generator=torch.Generator().manual_seed(1))
    assert names_of(p.pos[0]) == ["d"] * 5 and names_of(p.neg[0]) == ["f"] * 5
    # IoU 1.0 goes to the last bin (9), not to a bin of its own; 0.85 is bin 8
    p = sample_pairs(GT, t([EDGE["e"], EDGE["h"]]), 3, generator=torch.Generator().manual_seed(1))
    assert names_of(p.pos[0]) == ["e"] * 3 and names_of(p.neg[0]) == ["h"] * 3
    assert close(p.pos_iou.tolist(), [[1.0] * 3]) and close(p.neg_iou.tolist(), [[0.85] * 3], 1e-6)


def test_sample_pairs_fewer_bins():
    # bins = 4 (width 0.25): 0.0999, 0.1, 0.1999, 0.2 are all in bin 0 -> too few bins
    cands = t([EDGE["a"], EDGE["b"], EDGE["f"], EDGE["d"]])
    with pytest.raises(ValueError, match="^every image needs candidates in at least two IoU bins$"):
        sample_pairs(GT, cands, 3, bins=4)
    # bins = 5 (width 0.2): 0.2 starts bin 1
    p = sample_pairs(GT, cands, 50, bins=5, generator=torch.Generator().manual_seed(0))
    assert set(names_of(p.pos[0])) == {"d"} and set(names_of(p.neg[0])) == {"a", "b", "f"}
    # 1.0 and 0.85 share the last bin with bins = 5
    with pytest.raises(ValueError, match="^every image needs candidates in at least two IoU bins$"):
        sample_pairs(GT, t([EDGE["e"], EDGE["h"]]), 3, bins=5)


@pytest.mark.parametrize("names", [["b", "f"], ["a"], ["e", "e"]])
def test_sample_pairs_refuses_a_single_bin(names):
    with pytest.raises(ValueError, match="^every image needs candidates in at least two IoU bins$"):
        sample_pairs(GT, t([EDGE[n] for n in names]), 4, generator=torch.Generator().manual_seed(0))


def test_sample_pairs_refuses_when_any_image_has_a_single_bin():
    gt = t([[0, 0, 10, 10], [50, 50, 60, 60]])  # the second image overlaps no candidate: all in bin 0
    with pytest.raises(ValueError, match="^every image needs candidates in at least two IoU bins$"):
        sample_pairs(gt, t([EDGE["a"], EDGE["b"]]), 4, generator=torch.Generator().manual_seed(0))


def test_sample_pairs_several_images_and_seeded():
    gt = t([[0, 0, 10, 10], [0, 0, 10, 2]])
    cands = t(list(EDGE.values()))
    p = sample_pairs(gt, cands, 30, generator=torch.Generator().manual_seed(3))
    q = sample_pairs(gt, cands, 30, generator=torch.Generator().manual_seed(3))
    for x, y in zip(p, q, strict=True):
        assert torch.equal(x, y)
    assert p.pos.shape == (2, 30, 4)
    assert bool((p.pos_iou > p.neg_iou).all())
    assert torch.allclose(paired_iou(p.pos, gt[:, None]), p.pos_iou)
    assert torch.allclose(paired_iou(p.neg, gt[:, None]), p.neg_iou)
    # the second ground truth is the box "d" (IoU 1 with itself)
    assert close(paired_iou(t(EDGE["d"]), gt[1]).item(), 1.0)
    assert names_of(p.pos[1]).count("d") > 0 and "d" not in names_of(p.neg[1])


def test_sample_pairs_draws_the_bins_evenly():
    # 1 box in bin 0, 9 in bin 5, 1 in bin 9: group-based sampling draws bins, not boxes
    cands = [[0, 0, 10, 0.5]] + [[0, 0, 10, 5 + 0.1 * i] for i in range(9)] + [[0, 0, 10, 10]]
    p = sample_pairs(GT, t(cands), 600, generator=torch.Generator().manual_seed(0))
    bins_pos = (p.pos_iou[0] * 10).floor().clamp(max=9)  # IoU 1 is in the last bin
    bins_neg = (p.neg_iou[0] * 10).floor()
    n_low = int((bins_neg == 0).sum())
    n_top = int((bins_pos == 9).sum())
    n_mid = int((bins_pos == 5).sum() + (bins_neg == 5).sum())
    # each bin is in 2 of the 3 bin pairs: 2/3 of 600 draws each, though bin 5 holds 9 of the 11 boxes
    assert 330 < n_low < 470 and 330 < n_top < 470 and 330 < n_mid < 470


# --------------------------------------------------------------------------- ordinal: anchors, losses

# 6 images, D = 2: column 0 is 2**i, column 1 is -i
EMB = torch.tensor([[2.0 ** i, -float(i)] for i in range(6)], dtype=torch.float64)


def seeded(s=0):
    return torch.Generator().manual_seed(s)


def test_seeded_permutation_used_below():
    # group_prototypes puts perm[j] in group j % groups; these are the permutations for seed 0
    assert torch.randperm(6, generator=seeded()).tolist() == [2, 5, 3, 0, 1, 4]
    assert torch.randperm(7, generator=seeded()).tolist() == [4, 0, 5, 3, 2, 6, 1]


def test_group_prototypes_two_groups_exact_means():
    # groups of 3 -> 2 groups: {1, 2, 3} and {0, 4, 5}
    g0, g1 = [14 / 3, -2.0], [49 / 3, -3.0]
    proto = group_prototypes(EMB, 3, shuffle=False, generator=seeded())
    assert proto.dtype == torch.float64 and proto.shape == (6, 2)
    assert close(proto.tolist(), [g1, g0, g0, g0, g1, g1], 1e-9)
    shuffled = group_prototypes(EMB, 3, shuffle=True, generator=seeded())
    assert close(shuffled.tolist(), [g0, g1, g1, g1, g0, g0], 1e-9)


def test_group_prototypes_three_groups_next_group():
    # groups of 2 -> 3 groups: G0 = {0, 2}, G1 = {1, 5}, G2 = {3, 4}; shuffle takes the next group
    m0, m1, m2 = [2.5, -1.0], [17.0, -3.0], [12.0, -3.5]
    proto = group_prototypes(EMB, 2, shuffle=False, generator=seeded())
    assert close(proto.tolist(), [m0, m1, m0, m2, m2, m1], 1e-9)
    shuffled = group_prototypes(EMB, 2, shuffle=True, generator=seeded())
    assert close(shuffled.tolist(), [m1, m2, m1, m0, m0, m2], 1e-9)


def test_group_prototypes_uneven_groups():
    emb = torch.tensor([[2.0 ** i] for i in range(7)], dtype=torch.float64)
    # 7 // 3 = 2 groups: {1, 2, 4, 5} (4 images) and {0, 3, 6}
    a, b = (2 + 4 + 16 + 32) / 4, (1 + 8 + 64) / 3
    proto = group_prototypes(emb, 3, shuffle=False, generator=seeded())
    assert close(proto[:, 0].tolist(), [b, a, a, b, a, a, b], 1e-9)
    shuffled = group_prototypes(emb, 3, shuffle=True, generator=seeded())
    assert close(shuffled[:, 0].tolist(), [a, b, b, a, b, b, a], 1e-9)


def test_group_prototypes_group_of_one_and_one_group():
    own = group_prototypes(EMB, 1, shuffle=False, generator=seeded())
    assert torch.equal(own, EMB)
    other = group_prototypes(EMB, 1, shuffle=True, generator=seeded())
    # each image's anchor is exactly one other image's embedding, every image used once
    rows = [EMB.tolist().index(r) for r in other.tolist()]
    assert sorted(rows) == list(range(6)) and all(r != i for i, r in enumerate(rows))
    # batch smaller than a group: one group, the batch mean
    whole = group_prototypes(EMB, 10, shuffle=False, generator=seeded())
    assert close(whole.tolist(), [[63 / 6, -2.5]] * 6, 1e-9)
    assert close(group_prototypes(EMB[:4], 4, shuffle=False).tolist(), [[15 / 4, -1.5]] * 4, 1e-9)


def test_shuffle_proto_never_holds_the_image():
    emb = torch.eye(12) * 60
    for gs in (1, 2, 3, 4, 6):
        for s in range(3):
            out = group_prototypes(emb, gs, shuffle=True, generator=seeded(s))
            assert bool((out.diagonal() == 0).all()), (gs, s)
            own = group_prototypes(emb, gs, shuffle=False, generator=seeded(s))
            assert close(own.diagonal().tolist(), [60 / gs] * 12, 1e-5), (gs, s)


@pytest.mark.parametrize(("b", "gs"), [(5, 3), (4, 4), (3, 5), (1, 1)])
def test_shuffle_proto_needs_two_groups(b, gs):
    with pytest.raises(ValueError, match=f"^shuffle_proto needs at least 2 groups of {gs}; batch is {b}$"):
        group_prototypes(torch.ones(b, 2), gs, shuffle=True)


def test_anchors_for():
    assert ANCHORS == ("self", "proto", "shuffle_proto")
    assert anchors_for("self", EMB, 3) is EMB
    g0, g1 = [14 / 3, -2.0], [49 / 3, -3.0]
    assert close(anchors_for("proto", EMB, 3, generator=seeded()).tolist(), [g1, g0, g0, g0, g1, g1], 1e-9)
    assert close(anchors_for("shuffle_proto", EMB, 3, generator=seeded()).tolist(),
                 [g0, g1, g1, g1, g0, g0], 1e-9)
    m0, m1, m2 = [2.5, -1.0], [17.0, -3.0], [12.0, -3.5]
    assert close(anchors_for("shuffle_proto", EMB, 2, seeded()).tolist(), [m1, m2, m1, m0, m0, m2], 1e-9)
    for bad in ("mean", "Proto", ""):
        with pytest.raises(ValueError, match=re.escape(f"anchor must be one of {ANCHORS}, got {bad!r}")):
            anchors_for(bad, EMB, 3)


# anchors of 2 images; 2 pairs each; distances from 3-4-5 triangles
ANCHOR = t([[0, 0], [1, 1]])
POS = t([[[3, 4], [0, 1]], [[1, 1], [1, 2]]])      # d_pos: 5, 1 | 0, 1
NEG = t([[[0, 2], [6, 8]], [[1, 3], [1, 2.5]]])    # d_neg: 2, 10 | 2, 1.5


def test_triplet_loss_known_values():
    # max(m + d_pos - d_neg, 0): m = 1 -> 4, 0, 0, 0.5
    assert close(triplet_loss(ANCHOR, POS, NEG, margin=1.0).item(), 4.5 / 4, 1e-6)
    # m = 0 -> 3, 0, 0, 0
    assert close(triplet_loss(ANCHOR, POS, NEG, margin=0.0).item(), 3 / 4, 1e-6)
    # m = 3 -> 6, 0, 1, 2.5
    assert close(triplet_loss(ANCHOR, POS, NEG, margin=3.0).item(), 9.5 / 4, 1e-6)
    # equal distances with margin 0: zero
    assert triplet_loss(ANCHOR, POS, POS, margin=0.0).item() == 0.0


def test_ordinal_accuracy_known_values():
    # pos closer in 3 of the 4 pairs
    assert close(ordinal_accuracy(ANCHOR, POS, NEG).item(), 75.0, 1e-5)
    assert close(ordinal_accuracy(ANCHOR, NEG, POS).item(), 25.0, 1e-5)
    # ties do not count as ordered
    assert ordinal_accuracy(ANCHOR, POS, POS).item() == 0.0
    assert ordinal_accuracy(ANCHOR[:1], POS[:1, 1:], NEG[:1, 1:]).item() == 100.0


# --------------------------------------------------------------------------- reinforce


def test_discounted_returns_known_values():
    r = t([[1, 2], [4, -2], [8, 6]])  # [T=3, B=2], no zero anywhere
    assert discounted_returns(r, 0.5).tolist() == [[5, 2.5], [8, 1], [8, 6]]
    assert discounted_returns(r, 1.0).tolist() == [[13, 6], [12, 4], [8, 6]]
    assert discounted_returns(r, 0.0).tolist() == r.tolist()
    assert r.tolist() == [[1, 2], [4, -2], [8, 6]]  # not modified
    one = discounted_returns(t([[3, -1]]), 0.5)
    assert one.tolist() == [[3, -1]]
    assert discounted_returns(r.double(), 0.5).dtype == torch.float64


# T = 2, B = 3, gamma = 0.5:
#   rewards [[2, 2.5, 3], [4, 1, -2]] -> returns [[4, 3, 2], [4, 1, -2]]; mean first-step return 3
#   baseline = per-step batch mean (3, then 1) -> advantages [[1, 0, -1], [3, 0, -3]]
#   their std (n - 1 = 5): sqrt(20 / 5) = 2 -> normalized [[0.5, 0, -0.5], [1.5, 0, -1.5]]
#   log_probs [[-1, -2, -1], [-1, -0.5, -3]] -> policy = -((-0.5 - 1.5) + 0 + (0.5 + 4.5)) / 3 = -1
#   unnormalized: policy = -((-1 - 3) + 0 + (1 + 9)) / 3 = -2
#   entropies sum over T: [0.75, 1.5, 2.25] -> mean 1.5; bonus coef * 1.5 / T
REWARDS = [[2, 2.5, 3], [4, 1, -2]]
LOG_PROBS = [[-1, -2, -1], [-1, -0.5, -3]]
ENTROPIES = [[0.5, 1.0, 1.5], [0.25, 0.5, 0.75]]


def run_reinforce(**kw):
    lp = t(LOG_PROBS).requires_grad_()
    ent = t(ENTROPIES).requires_grad_()
    out = reinforce_loss(lp, ent, t(REWARDS), **kw)
    out.loss.backward()
    return out, lp.grad, ent.grad


def test_reinforce_with_baseline_normalization_and_entropy():
    out, g_lp, g_ent = run_reinforce(gamma=0.5, entropy_coef=0.4, normalize=True)
    assert isinstance(out, PolicyLoss)
    assert close(out.policy.item(), -1.0, 1e-5)
    assert close(out.entropy.item(), 1.5, 1e-6)
    assert close(out.mean_return.item(), 3.0, 1e-6)
    assert close(out.loss.item(), -1.0 - 0.4 * 1.5 / 2, 1e-5)
    # d loss / d log_prob = -normalized advantage / B: the better-than-average step is pushed up
    assert close(g_lp.tolist(), [[-0.5 / 3, 0, 0.5 / 3], [-1.5 / 3, 0, 1.5 / 3]], 1e-5)
    assert g_lp[1, 0] < 0 < g_lp[1, 2]
    # d loss / d entropy = -coef / (T * B)
    assert close(g_ent.tolist(), [[-0.4 / 6] * 3] * 2, 1e-6)


def test_reinforce_without_normalization():
    out, g_lp, g_ent = run_reinforce(gamma=0.5, entropy_coef=0.4, normalize=False)
    assert close(out.policy.item(), -2.0, 1e-5)
    assert close(out.loss.item(), -2.0 - 0.3, 1e-5)
    assert close(out.entropy.item(), 1.5, 1e-6)
    assert close(out.mean_return.item(), 3.0, 1e-6)
    assert close(g_lp.tolist(), [[-1 / 3, 0, 1 / 3], [-1, 0, 1]], 1e-5)


def test_reinforce_gamma_discounting():
    # gamma = 1: returns [[6, 3.5, 1], [4, 1, -2]]; advantages [[2.5, 0, -2.5], [3, 0, -3]]
    out, g_lp, _ = run_reinforce(gamma=1.0, entropy_coef=0.0, normalize=False)
    assert close(out.mean_return.item(), 3.5, 1e-6)
    assert close(out.policy.item(), -((-2.5 - 3) + (2.5 + 9)) / 3, 1e-5)
    assert close(out.loss.item(), out.policy.item(), 1e-7)
    assert close(g_lp.tolist(), [[-2.5 / 3, 0, 2.5 / 3], [-1, 0, 1]], 1e-5)


def test_reinforce_defaults():
    # gamma 0.99, entropy_coef 0.5, normalize, one episode per image
    out, g_lp, g_ent = run_reinforce()
    ref, g_ref, ge_ref = run_reinforce(gamma=0.99, entropy_coef=0.5, normalize=True, episodes=1)
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(g_lp, g_ref) and torch.equal(g_ent, ge_ref)
    # returns [[2 + 3.96, 2.5 + 0.99, 3 - 1.98], [4, 1, -2]]
    assert close(out.mean_return.item(), (5.96 + 3.49 + 1.02) / 3, 1e-5)
    assert close(g_ent.tolist(), [[-0.5 / 6] * 3] * 2, 1e-6)


def test_reinforce_normalizes_two_values_and_leaves_one_alone():
    # T = 1, B = 2: advantages [-1, 1], std sqrt(2)
    lp = t([[-1, -2]]).requires_grad_()
    out = reinforce_loss(lp, t([[0.0, 0.0]]), t([[1, 3]]), entropy_coef=0.0)
    out.loss.backward()
    s = 1 / math.sqrt(2)
    assert close(lp.grad.tolist(), [[s / 2, -s / 2]], 1e-5)
    assert close(out.policy.item(), -(s - 2 * s) / 2, 1e-5)
    assert close(out.mean_return.item(), 2.0)
    # a single value: no std to divide by, the advantage is 0 (and finite)
    single = reinforce_loss(t([[-1.0]]), t([[0.6]]), t([[5.0]]), entropy_coef=0.5)
    assert single.policy.item() == 0.0
    assert close(single.loss.item(), -0.3, 1e-6)
    assert close(single.mean_return.item(), 5.0)


def test_reinforce_normalization_of_tiny_advantages():
    # advantages +-1e-6, std sqrt(2) * 1e-6: divided by (std + 1e-6) they become +-1 / (sqrt(2) + 1)
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    rewards = torch.tensor([[0.0, 2e-6]], dtype=torch.float64)
    reinforce_loss(lp, torch.zeros(1, 2, dtype=torch.float64), rewards, entropy_coef=0.0).loss.backward()
    a = 1 / (math.sqrt(2) + 1)
    assert close(lp.grad.tolist(), [[a / 2, -a / 2]], 1e-9)


def test_reinforce_two_episodes_per_image_leave_one_out():
    # T = 1, E = 2: each episode's baseline is the other episode: [1-3, 3-1, 10-20, 20-10]
    lp = t([[-1, -1, -1, -1]]).requires_grad_()
    out = reinforce_loss(lp, t([[0.0] * 4]), t([[1, 3, 10, 20]]), entropy_coef=0.0, normalize=False, episodes=2)
    out.loss.backward()
    assert close(lp.grad.tolist(), [[0.5, -0.5, 2.5, -2.5]], 1e-6)
    assert close(out.policy.item(), 0.0, 1e-6)
    assert close(out.mean_return.item(), 8.5)


def test_reinforce_three_episodes_per_image_leave_one_out():
    # T = 2, 2 images x E = 3 (image-major), gamma 0.5
    rewards = t([[1, 2, 6, 10, 10, 10], [0, 0, 0, 2, 0, -2]])
    # returns [[1, 2, 6, 11, 10, 9], [0, 0, 0, 2, 0, -2]]
    # t=0: 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2 | 11 - (10+9)/2, 10 - (11+9)/2, 9 - (11+10)/2
    # t=1: image 0 all 0 | 2 - (0-2)/2, 0 - 0, -2 - (2+0)/2
    adv = [[-3, -1.5, 4.5, 1.5, 0, -1.5], [0, 0, 0, 3, 0, -3]]
    lp = torch.full((2, 6), -1.0, requires_grad=True)
    ent = torch.ones(2, 6, requires_grad=True)
    out = reinforce_loss(lp, ent, rewards, gamma=0.5, entropy_coef=0.3, normalize=False, episodes=3)
    out.loss.backward()
    assert close(lp.grad.tolist(), [[-a / 6 for a in row] for row in adv], 1e-6)
    assert close(out.mean_return.item(), 39 / 6, 1e-6)
    assert close(out.entropy.item(), 2.0, 1e-6)
    # policy = -(sum of -1 * adv) / 6 = sum(adv) / 6 = 0
    assert close(out.policy.item(), 0.0, 1e-6)
    assert close(out.loss.item(), -0.3 * 2.0 / 2, 1e-6)
    assert close(ent.grad.tolist(), [[-0.3 / 12] * 6] * 2, 1e-7)
    # normalized: the same advantages divided by their std, sqrt(54 / 11)
    lp2 = torch.full((2, 6), -1.0, requires_grad=True)
    reinforce_loss(lp2, ent.detach(), rewards, gamma=0.5, entropy_coef=0.3, episodes=3).loss.backward()
    s = math.sqrt(54 / 11)
    assert close(lp2.grad.tolist(), [[-a / 6 / s for a in row] for row in adv], 1e-5)


def test_reinforce_episodes_must_split_the_batch():
    lp, ent, r = torch.zeros(2, 6), torch.zeros(2, 6), torch.ones(2, 6)
    with pytest.raises(ValueError, match="^6 episodes do not split into groups of 4$"):
        reinforce_loss(lp, ent, r, episodes=4)
    with pytest.raises(ValueError, match="^6 episodes do not split into groups of 5$"):
        reinforce_loss(lp, ent, r, episodes=5)
    reinforce_loss(lp, ent, r, episodes=6)  # one image, six episodes: fine


def test_reinforce_gradient_sign_raises_the_better_action():
    logits = torch.zeros(2, requires_grad=True)
    dist = torch.distributions.Categorical(logits=logits.expand(3, 2))
    actions = torch.tensor([0, 1, 1])
    lp = dist.log_prob(actions)[None]  # [T=1, B=3]
    out = reinforce_loss(lp, dist.entropy()[None], t([[2.0, 0.0, 0.0]]), entropy_coef=0.0)
    out.loss.backward()
    assert logits.grad[0] < 0 < logits.grad[1]  # gradient descent raises the rewarded action's logit
