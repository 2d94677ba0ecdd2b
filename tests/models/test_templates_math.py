"""The NCC features' and template matching's math pinned against references written out here
(``models.core.templates``, ``models.core.matching``): box reads against a loop over torchvision's ``roi_align``
sampling, resizes against PIL, the flat-signal thresholds on both sides, empty inputs, leave-one-out means,
a sample's source template, and the stored templates' fields. Written against the mutants ``scripts/mutation``
left alive (TESTING.md)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from models.core.matching import best_windows, ncc_map, ncc_maps, scaled_template, template_matching
from models.core.templates import (
    JITTER,
    Templates,
    box_contents,
    box_ncc,
    box_ncc_sets,
    make_templates,
    mean_ncc,
    source_template,
    zero_mean_unit,
)


def _bilinear(img: np.ndarray, y: float, x: float) -> float:
    """torchvision's ``roi_align`` CPU sampling of one point: 0 beyond one pixel outside, edges clamped."""
    h, w = img.shape
    if y < -1 or y > h or x < -1 or x > w:
        return 0.0
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(math.floor(y)), int(math.floor(x))
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * img[y0, x0] + (1 - ly) * lx * img[y0, x1] + ly * (1 - lx) * img[y1, x0]
            + ly * lx * img[y1, x1])


def _read_loop(img: np.ndarray, box: tuple[float, float, float, float], side: int) -> np.ndarray:
    """A box read at ``side x side`` as ``roi_align(aligned=True, sampling_ratio=-1)`` does, one point at a time:
    each bin the mean of ``ceil(box side / side)`` samples per axis (a large box is averaged, not point-sampled)."""
    x1, y1, x2, y2 = (v - 0.5 for v in box)
    bw, bh = (x2 - x1) / side, (y2 - y1) / side
    gw, gh = math.ceil((x2 - x1) / side), math.ceil((y2 - y1) / side)
    out = np.zeros((side, side))
    for py in range(side):
        for px in range(side):
            out[py, px] = sum(_bilinear(img, y1 + py * bh + (iy + 0.5) * bh / gh, x1 + px * bw + (ix + 0.5) * bw / gw)
                              for iy in range(gh) for ix in range(gw)) / (gw * gh)
    return out


def _pil_resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[C, h, w]`` resized to ``size`` (h, w) by PIL's bilinear filter, which widens when it shrinks: the
    reference of torch's ``antialias=True``."""
    chans = [np.asarray(Image.fromarray(c.float().numpy(), mode="F").resize(size[::-1], Image.BILINEAR)) for c in x]
    return torch.from_numpy(np.stack(chans)).float()


def test_box_reads_are_roi_align_with_adaptive_sampling_on_every_channel():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 30, 26, generator=g)
    boxes = torch.tensor([[[2.0, 3.0, 25.0, 29.0], [-3.0, -2.0, 12.0, 40.0]],  # large (3 samples a bin), off the edge
                          [[5.5, 6.25, 9.0, 10.0], [0.0, 0.0, 26.0, 30.0]]])
    got = box_contents(images, boxes, 8)
    assert got.shape == (2, 2, 3, 8, 8)
    for n in range(2):
        for k in range(2):
            for c in range(3):
                ref = _read_loop(images[n, c].double().numpy(), tuple(boxes[n, k].tolist()), 8)
                assert np.abs(got[n, k, c].double().numpy() - ref).max() < 1e-5, (n, k, c)
    # no images or no boxes: the shape says so
    assert box_contents(images, boxes[:, :0], 8).shape == (2, 0, 3, 8, 8)
    assert box_contents(images[:0], boxes[:0], 8).shape == (0, 2, 3, 8, 8)


def test_zero_mean_unit_scales_to_one_and_zeroes_flat_reads_at_its_threshold():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(3, 2, 1, 4, 4, generator=g, dtype=torch.float64) * 0.01  # small norms: still scaled to one
    u = zero_mean_unit(x)
    assert u.shape == (3, 2, 16) and u.dtype == torch.float64
    assert torch.allclose(u.norm(dim=-1), torch.ones(3, 2, dtype=torch.float64))
    assert torch.allclose(u.sum(-1), torch.zeros(3, 2, dtype=torch.float64), atol=1e-12)
    # the bar is min_std * sqrt(D) on the norm of the centred read (D = 16 values here, not the batch's sizes)
    d = x - x.mean(dim=(-2, -1), keepdim=True)
    d = d / d.flatten(-3).norm(dim=-1)[..., None, None, None]  # unit norm
    bar = 1e-3 * 16 ** 0.5
    assert bool((zero_mean_unit(d * bar * 1.05).norm(dim=-1) > 0.999).all())
    assert bool((zero_mean_unit(d * bar * 0.95) == 0).all())


def test_box_ncc_of_one_template_of_empty_sets_and_of_an_empty_set_before_another():
    g = torch.Generator().manual_seed(2)
    img = 0.3 * torch.rand(2, 1, 40, 40, generator=g)
    crop = (torch.rand(1, 16, 16, generator=g) > 0.5).float()
    img[:, :, 10:26, 12:28] = crop
    one = make_templates([crop])  # a set of one template
    boxes = torch.tensor([[[12.0, 10, 28, 26]], [[12.0, 10, 28, 26]]])
    ncc = box_ncc(img, boxes, one, jitter=0.0)
    assert ncc.shape == (2, 1, 1) and bool((ncc > 0.99).all())
    empty = torch.zeros(0, 1, 16, 16)
    for got in box_ncc_sets(img, boxes, [empty, empty]):  # nothing to compare with: [n, K, 0] float64 each
        assert got.shape == (2, 1, 0) and got.dtype == torch.float64
    first, second = box_ncc_sets(img, boxes, [empty, one], jitter=0.0)  # an empty set does not end the others
    assert first.shape == (2, 1, 0) and first.dtype == torch.float64
    assert torch.equal(second, ncc)


def test_mean_ncc_leaves_one_out_and_is_zero_with_nothing_left():
    ncc = torch.tensor([[0.2, 0.6], [0.5, 0.1], [0.9, 0.3]])
    got = mean_ncc(ncc, torch.tensor([0, -1, 1]))
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor([0.6, 0.3, 0.9], dtype=torch.float64))  # one left: that one, not halved
    assert torch.equal(mean_ncc(torch.tensor([[0.7]]), torch.tensor([0])), torch.zeros(1, dtype=torch.float64))
    assert torch.allclose(mean_ncc(torch.tensor([[0.7]])), torch.tensor([0.7], dtype=torch.float64))  # one template
    none = mean_ncc(torch.zeros(3, 0))  # no templates: 0
    assert torch.equal(none, torch.zeros(3, dtype=torch.float64))


def test_templates_read_boxes_with_their_own_jitter_and_keep_the_batch_shape():
    g = torch.Generator().manual_seed(3)
    img = 0.3 * torch.rand(3, 1, 48, 48, generator=g)
    crop = (torch.rand(1, 20, 20, generator=g) > 0.5).float()
    img[:, :, 10:30, 14:34] = crop
    off = torch.tensor([[[16.0, 12, 36, 32]]]).expand(3, 1, 4)  # 2 px off: the jittered reads find it better
    t = make_templates([crop, torch.rand(1, 20, 20, generator=g)])
    exact = Templates(t, None, 48, 1, (0.0,), jitter=0.0)
    pos, neg = exact.ncc(img, off)
    assert pos.shape == (3, 1) and neg is None
    assert torch.allclose(pos, box_ncc(img, off, t, jitter=0.0).mean(-1).double())
    jittered, _ = Templates(t, None, 48, 1, (0.0,)).ncc(img, off)
    assert bool((jittered > pos + 0.05).all())
    # negative exemplars: one is enough to be read; an empty set of them reads as none
    one_neg = Templates(t, t[1:], 48, 1, (0.0,), jitter=0.0).ncc(img, off)[1]
    assert one_neg is not None and torch.allclose(one_neg, box_ncc(img, off, t[1:], jitter=0.0)[..., 0].double())
    assert Templates(t, t[:0], 48, 1, (0.0,)).ncc(img, off)[1] is None


def test_a_samples_source_is_the_best_template_above_the_bar_read_without_jitter():
    g = torch.Generator().manual_seed(4)
    crops = [(torch.rand(1, 16, 16, generator=g) > 0.5).float() for _ in range(3)]
    t = make_templates(crops)
    img = 0.2 * torch.rand(4, 1, 40, 40, generator=g)
    for i, c in enumerate([1, 2, 0]):
        img[i, :, 5:21, 7:23] = crops[c]
    true = torch.tensor([[7.0, 5, 23, 21]] * 3 + [[float("nan")] * 4])
    src = source_template(img, true, t)
    assert src.dtype == torch.long and src.tolist() == [1, 2, 0, -1]  # NaN box: no source
    assert source_template(img, true, t[:0]).tolist() == [-1] * 4  # no templates
    assert source_template(img[:1], true[3:], t).tolist() == [-1]  # no box
    # a box 2 px off: read as given (no jitter), so the bar between the exact and the jittered reads refuses it
    off = torch.tensor([[9.0, 7, 25, 23]])
    exact = float(box_ncc(img[:1], off[:, None], t, jitter=0.0)[0, 0].max())
    best = float(box_ncc(img[:1], off[:, None], t)[0, 0].max())
    assert best > exact + 0.05
    assert source_template(img[:1], off, t, min_ncc=(exact + best) / 2).tolist() == [-1]
    assert source_template(img[:1], off, t, min_ncc=exact).tolist() == [1]  # a read at the bar is its source
    weak = 0.2 * torch.rand(1, 1, 40, 40, generator=g)  # nothing pasted: below the default bar of 0.5
    assert source_template(weak, true[:1], t).tolist() == [-1]


def test_stored_templates_keep_every_field_and_clamp_what_they_store():
    g = torch.Generator().manual_seed(5)
    ex = make_templates([torch.rand(1, 10, 12, generator=g) for _ in range(2)])
    t = Templates(ex, None, 84, 1, (0.25,), jitter=0.05)
    d = t.to_dict()
    assert d["negative_count"] == 0 and d["negatives"] is None and "crops" not in d
    back = Templates.from_dict(d)
    assert (back.size, back.channels, back.fill, back.jitter) == (84, 1, (0.25,), 0.05)
    assert torch.equal(back.exemplars, ex) and back.negatives is None
    del d["jitter"]  # stored before the field existed: the default
    assert Templates.from_dict(d).jitter == JITTER
    # crops without their sizes are not stored (template matching needs both)
    assert "crops" not in Templates(ex, None, 84, 1, (0.0,), crops=[torch.rand(1, 4, 4)]).to_dict()
    # values out of [0, 1] are stored clamped, not wrapped around the byte
    wild = Templates(torch.tensor([-0.5, 0.5, 1.5, 0.2]).view(1, 1, 2, 2), None, 84, 1, (0.0,))
    stored = Templates.from_dict(wild.to_dict()).exemplars.flatten()
    assert torch.allclose(stored, torch.tensor([0.0, 128 / 255, 1.0, 51 / 255]), atol=1e-7)


def test_make_templates_resizes_like_pil_on_the_8_bit_grid():
    g = torch.Generator().manual_seed(6)
    checker = (torch.arange(32)[:, None] + torch.arange(32)[None]) % 2  # 1-px checkerboard: aliasing shows
    white = torch.rand(1, 9, 13, generator=g)
    white[:, 3:] = 1.0  # white stays 1 on the 8-bit grid
    crops = [checker[None].float(), white]  # one shrunk, one enlarged
    t = make_templates(crops, side=16)
    assert t.shape == (2, 1, 16, 16)
    for c, got in zip(crops, t, strict=True):
        ref = (_pil_resize(c, (16, 16)).clamp(0, 1) * 255).round() / 255
        assert (got - ref).abs().max() <= 1 / 255 + 1e-6
    assert torch.equal(t * 255, (t * 255).round()) and float(t.max()) == 1.0
    assert float(t[0].std()) < 0.05  # the checkerboard averaged to gray, not sampled
    assert make_templates([]).shape == (0, 1, 16, 16) and make_templates([], side=8).shape == (0, 1, 8, 8)


def test_scaled_templates_resize_like_pil_and_keep_two_pixels_a_side():
    checker = ((torch.arange(24)[:, None] + torch.arange(24)[None]) % 2).float()[None]
    half = scaled_template(checker, 0.5)
    assert half.shape == (1, 12, 12)
    assert (half - _pil_resize(checker, (12, 12))).abs().max() < 1e-5
    g = torch.Generator().manual_seed(7)
    small = torch.rand(1, 5, 7, generator=g)
    up = scaled_template(small, 2.0)
    assert up.shape == (1, 10, 14) and (up - _pil_resize(small, (10, 14))).abs().max() < 1e-5
    assert scaled_template(torch.rand(1, 2, 6), 0.5).shape == (1, 2, 3)
    assert scaled_template(torch.rand(1, 6, 2), 0.5).shape == (1, 3, 2)


def test_ncc_maps_refuse_templates_larger_than_the_images_in_either_side():
    images = torch.rand(1, 1, 9, 11)
    assert ncc_maps(images, torch.rand(1, 1, 9, 11)).shape == (1, 1, 1, 1)  # as large as the image: one window
    assert ncc_maps(images, torch.rand(1, 1, 4, 11)).shape == (1, 1, 6, 1)
    for h, w in [(10, 3), (3, 12), (10, 12)]:
        with pytest.raises(ValueError, match=r"template 1?\d?x1?\d? is larger than the images \(9, 11\)"):
            ncc_maps(images, torch.rand(1, 1, h, w))
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        ncc_maps(images, torch.rand(1, 3, 2, 2))


def test_flat_windows_and_flat_templates_score_zero_at_their_thresholds():
    g = torch.Generator().manual_seed(8)
    h, w, min_std = 3, 4, 1e-3  # c * n = 12 pixels a window
    pattern = torch.rand(1, h, w, generator=g, dtype=torch.float64)
    pattern = pattern - pattern.mean()
    pattern = pattern / pattern.square().sum().sqrt()  # zero mean, unit norm
    bar = min_std * 12 ** 0.5  # the norm under which a template, or a window, is flat
    images = torch.rand(1, 1, 8, 9, generator=g, dtype=torch.float64)
    for factor, flat in [(0.5, True), (1.5, False)]:
        scores = ncc_maps(images, (0.5 + factor * bar * pattern)[None])
        assert bool((scores == 0).all()) == flat, factor
        window = torch.full((1, 1, h, w), 0.5, dtype=torch.float64) + factor * bar * pattern
        other = torch.rand(1, 1, h, w, generator=g, dtype=torch.float64)
        one = ncc_maps(window, other)
        assert bool((one == 0).all()) == flat, factor
        # best_windows' bars are the same (a window of h x w pixels, not h / w)
        assert (float(best_windows(images, [0.5 + factor * bar * pattern])[0][0, 0]) == 0.0) == flat, factor
        assert (float(best_windows(window, [other[0]])[0][0, 0]) == 0.0) == flat, factor
    # ncc_map passes its own bar on
    low = torch.full((1, 1, h, w), 0.5, dtype=torch.float64) + 0.01 * pattern
    template = torch.rand(1, h, w, generator=g, dtype=torch.float64)
    assert float(ncc_map(low, template)[0, 0, 0]) != 0.0
    assert float(ncc_map(low, template, min_std=0.1)[0, 0, 0]) == 0.0


def test_a_sets_match_goes_on_past_a_scale_whose_templates_do_not_fit():
    g = torch.Generator().manual_seed(9)
    crop = (torch.rand(1, 12, 12, generator=g) > 0.5).float()
    images = 0.3 * torch.rand(2, 1, 32, 32, generator=g)
    images[1, :, 4:16, 6:18] = crop  # the second image at the crop's own scale
    t = Templates(make_templates([crop]), None, 32, 1, (0.0,), crops=[crop], crop_sizes=[(12, 12)])
    scales = torch.tensor([[0.2, 0.2], [1.0, 1.0]])  # the first image: its crop 60 px, larger than the input
    out = t.match(images, scales)
    assert out[0].isnan().all()
    assert out[1].tolist() == template_matching(images[1:], [crop])[0].tolist() == [6.0, 4.0, 18.0, 16.0]
