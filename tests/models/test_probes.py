"""Synthetic probes pixel for pixel: each probe written out from its box, its crop and its background (the crop
resized as the code says, blended with an alpha computed here), the alphas and the fills against values computed
by hand or by a plain reference, the refusals by their messages, and the random draws by their ranges."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.data.probes import _elliptical, _feathered, _push_pull, erase_boxes, fill_boxes, paste_probes


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def feathered_by_hand(h: int, w: int, feather: int) -> torch.Tensor:
    """``[h, w]``: a pixel's distance to the nearest border (pixel centres, in pixels) over ``feather``, at most 1."""
    out = torch.empty(h, w)
    for y in range(h):
        for x in range(w):
            d = min(y + 0.5, h - 0.5 - y, x + 0.5, w - 0.5 - x)
            out[y, x] = 1.0 if feather <= 0 else min(d / feather, 1.0)
    return out


def elliptical_by_hand(h: int, w: int, feather: int) -> torch.Tensor:
    band = max(feather, 0.08 * min(h, w), 1.0) / (min(h, w) / 2)
    out = torch.empty(h, w)
    for y in range(h):
        for x in range(w):
            r = math.hypot((y + 0.5) / h * 2 - 1, (x + 0.5) / w * 2 - 1)
            out[y, x] = min(max((1 - r) / band, 0.0), 1.0)
    return out


# ---- alphas -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("h", "w", "feather"), [(4, 6, 2), (5, 3, 1), (9, 12, 3), (6, 6, 0), (3, 7, -1)])
def test_the_feathered_alpha_is_the_distance_to_the_border_over_the_feather(h, w, feather):
    alpha = _feathered(h, w, feather)
    assert alpha.shape == (1, h, w) and alpha.dtype == torch.float32
    torch.testing.assert_close(alpha[0], feathered_by_hand(h, w, feather), rtol=0, atol=1e-6)


def test_the_feathered_alpha_by_known_values():
    assert _feathered(4, 6, 2)[0].tolist() == [
        [0.25, 0.25, 0.25, 0.25, 0.25, 0.25],
        [0.25, 0.75, 0.75, 0.75, 0.75, 0.25],
        [0.25, 0.75, 0.75, 0.75, 0.75, 0.25],
        [0.25, 0.25, 0.25, 0.25, 0.25, 0.25]]
    assert _feathered(3, 3, 1)[0].tolist() == [[0.5, 0.5, 0.5], [0.5, 1.0, 0.5], [0.5, 0.5, 0.5]]


@pytest.mark.parametrize(("h", "w", "feather"), [(10, 10, 2), (12, 30, 0), (50, 40, 2), (20, 20, 6), (7, 9, 1)])
def test_the_elliptical_alpha_ramps_inside_the_inscribed_ellipse(h, w, feather):
    """The band is the most of the feather, 8 % of the shorter side and one pixel: each case above picks another."""
    alpha = _elliptical(h, w, feather)
    assert alpha.shape == (1, h, w) and alpha.dtype == torch.float32
    torch.testing.assert_close(alpha[0], elliptical_by_hand(h, w, feather), rtol=0, atol=1e-5)
    torch.testing.assert_close(alpha[0], alpha[0].flip(0).flip(1), rtol=0, atol=1e-5)  # centred


# ---- paste_probes -------------------------------------------------------------------------------------------------


def expected_probe(background: torch.Tensor, crop: torch.Tensor, box: torch.Tensor, feather: int, shape: str
                   ) -> torch.Tensor:
    """The probe image written out: ``crop`` resized to the box (bilinear, antialiased, pixel centres), clamped to
    [0, 1], blended over ``background`` with the shape's alpha; the rest of the background untouched."""
    x1, y1, x2, y2 = (int(v) for v in box)
    nh, nw = y2 - y1, x2 - x1
    patch = F.interpolate(crop[None], size=(nh, nw), mode="bilinear", antialias=True, align_corners=False)[0]
    patch = patch.clamp(0, 1)
    alpha = (feathered_by_hand(nh, nw, feather) if shape == "rect" else elliptical_by_hand(nh, nw, feather))[None]
    out = background.clone()
    out[:, y1:y2, x1:x2] = background[:, y1:y2, x1:x2] * (1 - alpha) + patch * alpha
    return out


@pytest.mark.parametrize("shape", ["rect", "ellipse"])
def test_each_probe_is_its_crop_resized_into_its_box_and_blended_with_the_alpha(shape):
    background = torch.rand(1, 3, 48, 48, generator=gen(0))  # one image: every probe's background is known
    crops = [torch.rand(3, 12, 20, generator=gen(1)) * 3 - 1,  # out of [0, 1]: clamped
             torch.rand(3, 18, 9, generator=gen(2))]
    probes = paste_probes(crops, background, 24, object_side=16, generator=gen(4), feather=3, shape=shape)
    assert probes.images.shape == (24, 3, 48, 48) and probes.boxes.dtype == torch.float32
    assert set(probes.sources.tolist()) == {0, 1}
    for img, box, src in zip(probes.images, probes.boxes, probes.sources, strict=True):
        torch.testing.assert_close(img, expected_probe(background[0], crops[int(src)], box, 3, shape),
                                   rtol=0, atol=1e-5)
    assert probes.images.min() >= 0 and probes.images.max() <= 1


def test_paste_probes_leaves_its_input_images_as_they_were():
    images = torch.rand(3, 1, 30, 30, generator=gen(1))
    before = images.clone()
    paste_probes([torch.ones(1, 8, 8)], images, 10, object_side=8, generator=gen(2))
    assert torch.equal(images, before)


def test_the_long_side_is_the_object_side_times_a_factor_drawn_from_the_whole_scale_range():
    images = torch.zeros(1, 1, 100, 100)
    probes = paste_probes([torch.ones(1, 10, 20)], images, 400, object_side=20, scale=(0.8, 1.5), generator=gen(5))
    w = probes.boxes[:, 2] - probes.boxes[:, 0]
    h = probes.boxes[:, 3] - probes.boxes[:, 1]
    assert w.min() >= 16 and w.max() <= 30  # 20 x [0.8, 1.5]
    assert w.min() <= 17 and w.max() >= 29  # both ends of the range are drawn
    torch.testing.assert_close(h, torch.round(w / 2), rtol=0, atol=1.0)  # aspect kept
    fixed = paste_probes([torch.ones(1, 10, 20)], images, 20, object_side=20, scale=(1.2, 1.2), generator=gen(5))
    assert torch.all(fixed.boxes[:, 2] - fixed.boxes[:, 0] == 24)
    assert torch.all(fixed.boxes[:, 3] - fixed.boxes[:, 1] == 12)


def test_a_probe_is_at_most_nine_tenths_of_the_image_and_at_least_two_pixels_a_side():
    images = torch.zeros(2, 1, 40, 40)
    big = paste_probes([torch.ones(1, 10, 10)], images, 5, object_side=200, generator=gen(0))
    assert torch.all(big.boxes[:, 2] - big.boxes[:, 0] == 36) and torch.all(big.boxes[:, 3] - big.boxes[:, 1] == 36)
    flat = paste_probes([torch.ones(1, 1, 30)], images, 5, object_side=10, scale=(1.0, 1.0), generator=gen(0))
    assert torch.all(flat.boxes[:, 3] - flat.boxes[:, 1] == 2) and torch.all(flat.boxes[:, 2] - flat.boxes[:, 0] == 10)
    thin = paste_probes([torch.ones(1, 30, 1)], images, 5, object_side=10, scale=(1.0, 1.0), generator=gen(0))
    assert torch.all(thin.boxes[:, 2] - thin.boxes[:, 0] == 2) and torch.all(thin.boxes[:, 3] - thin.boxes[:, 1] == 10)


def test_probes_reach_every_border_and_draw_their_columns_and_rows_apart():
    images = torch.zeros(1, 1, 40, 40)
    probes = paste_probes([torch.ones(1, 10, 10)], images, 600, object_side=10, scale=(1.0, 1.0), generator=gen(6))
    x1, y1 = probes.boxes[:, 0], probes.boxes[:, 1]
    assert x1.min() == 0 and y1.min() == 0 and x1.max() == 30 and y1.max() == 30  # flush with every border
    assert (x1 != y1).float().mean() > 0.9  # two draws, not one


def test_the_same_generator_makes_the_same_probes_whatever_the_global_seed():
    images = torch.rand(4, 1, 30, 30, generator=gen(0))
    crops = [torch.rand(1, 8, 6, generator=gen(1)), torch.rand(1, 5, 9, generator=gen(2))]
    with torch.random.fork_rng():  # the global seed set here is not left behind
        torch.manual_seed(1)
        a = paste_probes(crops, images, 12, object_side=9, generator=gen(7))
        torch.manual_seed(2)
        b = paste_probes(crops, images, 12, object_side=9, generator=gen(7))
    assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes) and torch.equal(a.sources, b.sources)


def test_paste_probes_refuses_what_it_cannot_paste_and_says_what():
    images = torch.zeros(2, 1, 20, 20)
    with pytest.raises(ValueError, match="at least one exemplar crop"):
        paste_probes([], images, 1, object_side=5, generator=gen())
    with pytest.raises(ValueError, match=r"unlabeled images \[N, C, S, S\]; got \(0, 1, 20, 20\)"):
        paste_probes([torch.ones(1, 4, 4)], images[:0], 1, object_side=5, generator=gen())
    with pytest.raises(ValueError, match=r"got \(1, 20, 20\)"):
        paste_probes([torch.ones(1, 4, 4)], images[0], 1, object_side=5, generator=gen())
    with pytest.raises(ValueError, match="square at the input size; got 20x16"):
        paste_probes([torch.ones(1, 4, 4)], images[..., :16], 1, object_side=5, generator=gen())
    with pytest.raises(ValueError, match="crop has 3 channels, images have 1"):
        paste_probes([torch.ones(3, 4, 4)], images, 1, object_side=5, generator=gen())


# ---- fill_boxes and its push-pull ---------------------------------------------------------------------------------


def fill_alpha_by_hand(h: int, w: int, box: list[float], grow: float, band: float) -> torch.Tensor:
    x1, y1, x2, y2 = box
    sw, sh = max(x2 - x1, 1.0), max(y2 - y1, 1.0)
    lx, ly, hx, hy = x1 - grow * sw, y1 - grow * sh, x2 + grow * sw, y2 + grow * sh
    ramp = max(band * min(hx - lx, hy - ly), 1.0)
    out = torch.empty(h, w, dtype=torch.float64)
    for y in range(h):
        for x in range(w):
            d = min(y + 0.5 - ly, hy - y - 0.5, x + 0.5 - lx, hx - x - 0.5)
            out[y, x] = min(max(d / ramp, 0.0), 1.0)
    return out


@pytest.mark.parametrize(("box", "grow", "band"), [([10.0, 6.0, 30.0, 14.0], 0.15, 0.15),
                                                   ([3.0, 20.0, 9.0, 38.0], 0.0, 0.4),
                                                   ([20.0, 10.0, 20.5, 30.0], 0.1, 0.2)])
def test_fill_boxes_blends_the_fill_in_with_a_ramp_over_the_grown_box(box, grow, band):
    """Around a region the fill sees one value (the image is constant outside it), so the fill is that value and
    the result is written out from the alpha alone."""
    h, w = 40, 44
    alpha = fill_alpha_by_hand(h, w, box, grow, band)
    images = torch.full((1, 2, h, w), 0.3, dtype=torch.float64)
    images[0, :, alpha > 0] = torch.tensor([[0.9], [0.1]], dtype=torch.float64)  # the object, inside the region
    out = fill_boxes(images, torch.tensor([box]), grow=grow, band=band)
    expected = images * (1 - alpha) + 0.3 * alpha
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-9)


def test_fill_boxes_fills_one_image_and_several_each_in_its_own_box():
    images = torch.rand(3, 1, 24, 24, generator=gen(3))
    boxes = torch.tensor([[2.0, 2.0, 8.0, 8.0], [10.0, 12.0, 20.0, 22.0], [0.0, 0.0, 24.0, 5.0]])
    both = fill_boxes(images, boxes)
    for i in range(3):
        torch.testing.assert_close(fill_boxes(images[i:i + 1], boxes[i:i + 1])[0], both[i], rtol=0, atol=1e-6)
    assert not torch.equal(fill_boxes(images[:1], boxes[:1]), images[:1])  # one image is filled too


def push_pull_by_hand(images: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """The fill written plainly: known pixels kept; at the coarsest level (a side of at most 2) the mean of the
    known pixels; above it each 2 x 2 block (cut at the far edges) averaged over its known pixels, filled one level
    down, and bilinearly brought back up."""
    n, c, h, w = images.shape
    if min(h, w) <= 2:
        out = images.clone()
        for i in range(n):
            k = known[i, 0] > 0
            for ch in range(c):
                mean = float(images[i, ch][k].sum()) / max(float(k.sum()), 1e-6)
                out[i, ch][~k] = mean
        return out
    ch_, cw = (h + 1) // 2, (w + 1) // 2
    coarse = torch.zeros(n, c, ch_, cw, dtype=images.dtype)
    ck = torch.zeros(n, 1, ch_, cw, dtype=images.dtype)
    for y in range(ch_):
        for x in range(cw):
            blk = known[:, :, 2 * y:2 * y + 2, 2 * x:2 * x + 2]
            cnt = blk.sum((2, 3))  # [n, 1]
            tot = (images[:, :, 2 * y:2 * y + 2, 2 * x:2 * x + 2] * blk).sum((2, 3))  # [n, c]
            coarse[:, :, y, x] = torch.where(cnt > 0, tot / cnt.clamp(min=1e-6), torch.zeros_like(tot))
            ck[:, 0, y, x] = (cnt[:, 0] > 0).to(images.dtype)
    filled = push_pull_by_hand(coarse, ck)
    up = F.interpolate(filled, size=(h, w), mode="bilinear", align_corners=False)
    return images * known + up * (1 - known)


@pytest.mark.parametrize(("h", "w"), [(9, 7), (16, 16), (5, 12)])
def test_push_pull_matches_the_fill_written_out(h, w):
    images = torch.rand(2, 2, h, w, generator=gen(h), dtype=torch.float64)
    known = (torch.rand(2, 1, h, w, generator=gen(w), dtype=torch.float64) > 0.6).to(torch.float64)
    images = images + 50 * (1 - known)  # what is not known must not leak into the fill
    torch.testing.assert_close(_push_pull(images, known), push_pull_by_hand(images, known), rtol=0, atol=1e-9)


def test_push_pull_fills_from_the_only_pixels_it_knows_even_on_odd_sides():
    images = torch.full((1, 1, 5, 5), 9.0)
    known = torch.zeros(1, 1, 5, 5)
    images[..., 4], known[..., 4] = 0.7, 1.0  # the last column alone is known: an odd side's leftover
    torch.testing.assert_close(_push_pull(images, known), torch.full((1, 1, 5, 5), 0.7), rtol=0, atol=1e-6)
    tiny = torch.tensor([[[[1.0, 5.0], [3.0, 9.0]]]])
    tiny_known = torch.tensor([[[[1.0, 1.0], [1.0, 0.0]]]])
    torch.testing.assert_close(_push_pull(tiny, tiny_known), torch.tensor([[[[1.0, 5.0], [3.0, 3.0]]]]))
    one_known = torch.tensor([[[[0.0, 0.0], [0.0, 1.0]]]])  # the mean of one pixel is that pixel, exactly
    assert torch.equal(_push_pull(tiny, one_known), torch.full((1, 1, 2, 2), 9.0))


# ---- erase_boxes --------------------------------------------------------------------------------------------------


def test_erase_boxes_takes_each_region_from_another_image_any_other_and_from_the_edge():
    n = 5
    images = torch.stack([torch.full((1, 12, 12), float(i)) for i in range(n)])
    boxes = torch.tensor([[0.0, 0.0, 4.0, 3.0]]).expand(n, 4)  # at the corner: row 0 and column 0 too
    donors: dict[int, set[int]] = {i: set() for i in range(n)}
    for seed in range(40):
        out = erase_boxes(images, boxes, gen(seed))
        for i in range(n):
            region = out[i, 0, 0:3, 0:4]
            assert region.unique().numel() == 1
            donor = int(region[0, 0])
            assert donor != i
            donors[i].add(donor)
            rest = out[i, 0].clone()
            rest[0:3, 0:4] = i
            assert torch.all(rest == i)
    assert all(donors[i] == set(range(n)) - {i} for i in range(n))  # every other image can give


def test_erase_boxes_with_two_images_swaps_their_regions_and_one_image_is_kept():
    images = torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8)])
    boxes = torch.tensor([[1.0, 1.0, 5.0, 5.0], [2.0, 3.0, 7.0, 8.0]])
    out = erase_boxes(images, boxes, gen(0))
    assert torch.all(out[0, 0, 1:5, 1:5] == 1) and torch.all(out[1, 0, 3:8, 2:7] == 0)
    one = erase_boxes(images[:1], boxes[:1], gen(0))
    assert torch.equal(one, images[:1]) and one.data_ptr() != images.data_ptr()


def test_erase_boxes_draws_from_its_generator_only():
    images = torch.rand(6, 1, 10, 10, generator=gen(0))
    boxes = torch.tensor([[1.0, 1.0, 6.0, 6.0]]).expand(6, 4)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        a = erase_boxes(images, boxes, gen(11))
        torch.manual_seed(4)
        b = erase_boxes(images, boxes, gen(11))
    assert torch.equal(a, b)
