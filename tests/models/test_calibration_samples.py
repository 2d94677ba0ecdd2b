"""What a set's calibration is fitted on, part by part: synthetic backgrounds (the domain's strokes scattered on the
bundle's fill, brighter or darker as the fill asks), the crops' transforms that do not look like an exemplar, the
crops scrambled (a permutation of their own cells, never the identity), and the positives and negatives in the
proportions, boxes, sources and object flags the fits read."""

from __future__ import annotations

import pytest
import torch

from models.config import InputSpec
from models.core.templates import make_templates
from models.data.calibration_samples import (
    PROBE_SCALE,
    make_samples,
    scrambled_crops,
    synthetic_backgrounds,
    transformed_crops,
)
from models.data.types import LabeledImages


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def asymmetric(h: int = 12, w: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.rand(1, h, w, generator=gen(seed))


# ---- backgrounds --------------------------------------------------------------------------------------------------


def test_backgrounds_are_the_fill_with_the_domains_strokes_brighter_on_a_dark_fill_darker_on_a_light_one():
    dark = InputSpec(channels=1, size=48, fill=(0.0,), exemplar_size=16)
    ink = [torch.ones(1, 16, 16)]  # bright strokes: tiles of exactly 1 where they land
    out = synthetic_backgrounds(ink, dark, 6, gen(1))
    assert out.shape == (6, 1, 48, 48) and out.min() >= 0 and out.max() <= 1
    assert all(bool((img == 1).sum() >= 4 * 4 * 4) for img in out)  # at least 4 tiles of 4 x 4 on each image
    light = InputSpec(channels=1, size=48, fill=(1.0,), exemplar_size=16)
    out = synthetic_backgrounds([torch.zeros(1, 16, 16)], light, 6, gen(1))  # dark ink on paper
    assert all(bool((img == 0).sum() >= 4 * 4 * 4) for img in out)
    blank = synthetic_backgrounds([], dark, 6, gen(1))  # no crops (or none of these channels): no tiles
    assert not bool((blank == 1).any())
    assert not bool((synthetic_backgrounds([torch.ones(3, 16, 16)], dark, 6, gen(1)) == 1).any())


def covered_by_squares(mask: torch.Tensor, t: int) -> bool:
    """Whether every set pixel of ``mask [H, W]`` lies in some t x t square of set pixels."""
    m = mask.float()[None, None]
    full = (torch.nn.functional.avg_pool2d(m, t, stride=1) == 1).float()  # t x t windows all set
    cover = torch.nn.functional.max_pool2d(torch.nn.functional.pad(full, (t - 1, t - 1, t - 1, t - 1)), t, stride=1)
    return bool((cover[0, 0] >= m[0, 0]).all())


def test_backgrounds_tiles_are_a_quarter_of_the_exemplar_size_unless_given():
    spec = InputSpec(channels=1, size=60, fill=(0.0,), exemplar_size=24)  # tiles of 6
    ink = [torch.ones(1, 24, 24)]
    for img in synthetic_backgrounds(ink, spec, 4, gen(2))[:, 0]:
        assert covered_by_squares(img == 1, 6) and not covered_by_squares(img == 1, 7)
    for img in synthetic_backgrounds(ink, spec, 4, gen(2), tile=10)[:, 0]:
        assert covered_by_squares(img == 1, 10) and not covered_by_squares(img == 1, 11)
    small = InputSpec(channels=1, size=30, fill=(0.0,), exemplar_size=8)  # a quarter is 2: at least 3
    for img in synthetic_backgrounds([torch.ones(1, 8, 8)], small, 4, gen(2))[:, 0]:
        assert covered_by_squares(img == 1, 3) and not covered_by_squares(img == 1, 4)


def test_colour_backgrounds_carry_flat_rectangles_of_any_colour():
    spec = InputSpec(channels=3, size=48, fill=(0.0, 0.0, 0.0), exemplar_size=16)
    out = synthetic_backgrounds([], spec, 10, gen(4))
    spread = (out.max(1).values - out.min(1).values)  # [n, S, S]: how far a pixel is from gray
    assert float(spread.max()) > 0.5  # the channels of a rectangle are drawn apart, not one gray


def test_backgrounds_are_seeded_by_their_generator_alone():
    spec = InputSpec(channels=3, size=32, fill=(0.2, 0.3, 0.4), exemplar_size=12)
    crops = [torch.rand(3, 12, 9, generator=gen(3))]
    with torch.random.fork_rng():  # the global seed set here is not left behind
        torch.manual_seed(0)
        a = synthetic_backgrounds(crops, spec, 3, gen(5))
        torch.manual_seed(1)
        assert torch.equal(a, synthetic_backgrounds(crops, spec, 3, gen(5)))
    assert not torch.equal(a, synthetic_backgrounds(crops, spec, 3, gen(6)))


# ---- other shapes -------------------------------------------------------------------------------------------------


def test_transformed_crops_are_the_three_rotations_and_two_flips_in_order():
    crop = asymmetric()
    templates = make_templates([crop], 16)
    out = transformed_crops([crop], templates)
    expected = [torch.rot90(crop, k, (1, 2)) for k in (1, 2, 3)] + [crop.flip(-1), crop.flip(-2)]
    assert len(out) == 5 and all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))
    assert all(t.is_contiguous() for t in out)


def test_a_transform_that_still_looks_like_an_exemplar_is_left_out():
    plus = torch.zeros(1, 11, 11)
    plus[:, 5, :] = plus[:, :, 5] = 1.0  # symmetric under every rotation and flip
    assert transformed_crops([plus], make_templates([plus], 16)) == []
    half = torch.zeros(1, 12, 12)
    half[:, :, :6] = 1.0  # a left-right flip is its negative; upside down it is itself
    out = transformed_crops([half], make_templates([half], 16))
    kept = [torch.rot90(half, k, (1, 2)) for k in (1, 2, 3)] + [half.flip(-1)]  # upside down it is itself: left out
    assert len(out) == 4 and all(torch.equal(a, b) for a, b in zip(out, kept, strict=True))
    assert len(transformed_crops([plus], make_templates([plus], 16), max_ncc=1.01)) == 5  # the bar is the caller's


def test_scrambled_crops_shuffle_their_own_cells_never_in_place():
    crop = torch.arange(1 * 12 * 9, dtype=torch.float32).view(1, 12, 9)
    out = scrambled_crops([crop], gen(0), per_crop=6)
    assert len(out) == 6
    for j, s in enumerate(out):
        k = 2 + j % 2  # 2 x 2, 3 x 3, 2 x 2, ...
        hs, ws = 12 // k, 9 // k
        assert s.shape == (1, k * hs, k * ws)
        cells = {tuple(crop[:, y * hs:(y + 1) * hs, x * ws:(x + 1) * ws].flatten().tolist())
                 for y in range(k) for x in range(k)}
        got = [tuple(s[:, y * hs:(y + 1) * hs, x * ws:(x + 1) * ws].flatten().tolist())
               for y in range(k) for x in range(k)]
        assert set(got) == cells and len(got) == len(cells)  # every cell once
        assert not torch.equal(s, crop[:, :k * hs, :k * ws])  # never the identity
    flat = scrambled_crops([torch.ones(1, 2, 8)], gen(0), per_crop=3)  # 3 x 3 cells of a 2-row crop: skipped
    assert len(flat) == 2 and all(f.shape == (1, 2, 8) for f in flat)  # the 2 x 2 ones before and after it
    rgb = torch.rand(3, 8, 8, generator=gen(1))
    for s in scrambled_crops([rgb], gen(2), per_crop=2):  # each cell moves with all its channels
        k = {8: 2, 6: 3}[s.shape[-1]]
        cells = {tuple(rgb[:, y * (8 // k):(y + 1) * (8 // k), x * (8 // k):(x + 1) * (8 // k)].flatten().tolist())
                 for y in range(k) for x in range(k)}
        assert {tuple(s[:, y * (8 // k):(y + 1) * (8 // k), x * (8 // k):(x + 1) * (8 // k)].flatten().tolist())
                for y in range(k) for x in range(k)} == cells


def test_a_scramble_drawn_as_the_identity_is_rolled_so_every_scramble_moves_a_cell():
    crop = torch.arange(16.0).view(1, 4, 4)
    for seed in range(200):  # 2 x 2 grids: 1 in 24 draws is the identity
        s = scrambled_crops([crop], gen(seed), per_crop=1)[0]
        assert not torch.equal(s, crop)


# ---- the samples --------------------------------------------------------------------------------------------------


def backgrounds(n: int = 8, s: int = 40) -> torch.Tensor:
    return torch.stack([torch.full((1, s, s), 0.01 * (i + 1)) for i in range(n)])  # each known by its value


@pytest.mark.parametrize(("n", "look", "n_look", "n_scr"), [(30, False, 0, 15), (31, False, 0, 15),
                                                             (30, True, 10, 10), (31, True, 10, 10)])
def test_negatives_are_plain_backgrounds_scrambled_exemplars_and_look_alikes_in_their_shares(n, look, n_look, n_scr):
    crops = [asymmetric(seed=1), asymmetric(10, 14, seed=2)]
    looks = [torch.ones(1, 9, 9), torch.ones(1, 7, 12)] if look else None
    bg = backgrounds()
    smp = make_samples(crops, bg, n, object_side=12, generator=gen(3), negative_crops=looks)
    n_plain = n - n_look - n_scr
    assert len(smp.positives) == n and len(smp.negatives) == n
    assert smp.negative_objects.tolist() == [False] * n_plain + [True] * (n_scr + n_look)
    # plain negatives are backgrounds as they are
    assert all(any(torch.equal(img, b) for b in bg) for img in smp.negatives[:n_plain])
    assert all(not any(torch.equal(img, b) for b in bg) for img in smp.negatives[n_plain:])
    # only the look-alikes' boxes and sources are known
    assert torch.isnan(smp.negative_boxes[:n_plain + n_scr]).all()
    assert (smp.negative_sources[:n_plain + n_scr] == -1).all()
    if look:
        assert not torch.isnan(smp.negative_boxes[n_plain + n_scr:]).any()
        assert set(smp.negative_sources[n_plain + n_scr:].tolist()) <= {0, 1}
        for img, box, src in zip(smp.negatives[n_plain + n_scr:], smp.negative_boxes[n_plain + n_scr:],
                                 smp.negative_sources[n_plain + n_scr:], strict=True):
            x1, y1, x2, y2 = (int(v) for v in box)
            assert img[0, (y1 + y2) // 2, (x1 + x2) // 2] == 1  # the look-alike is where its box says
            assert round(12 * PROBE_SCALE[0]) <= max(x2 - x1, y2 - y1) <= round(12 * PROBE_SCALE[1])
            assert (x2 - x1 == y2 - y1) if int(src) == 0 else (x2 - x1 > y2 - y1)  # its source's shape
    assert smp.shapes is None


def test_positives_are_the_crops_pasted_near_the_object_size_after_the_labeled_examples():
    crops = [asymmetric(seed=4)]
    labeled = LabeledImages(torch.rand(3, 1, 40, 40, generator=gen(5)), torch.tensor([[1.0, 2.0, 20.0, 30.0]] * 3))
    smp = make_samples(crops, backgrounds(), 50, object_side=16, generator=gen(6), labeled=labeled)
    assert len(smp.positives) == 53 and torch.equal(smp.positives.images[:3], labeled.images)
    assert torch.equal(smp.positives.boxes[:3], labeled.boxes)
    assert smp.positives.sources.tolist() == [-1] * 3 + [0] * 50  # labeled examples are no crop's paste
    side = (smp.positives.boxes[3:, 2:] - smp.positives.boxes[3:, :2]).max(1).values
    assert side.min() >= round(16 * PROBE_SCALE[0]) and side.max() <= round(16 * PROBE_SCALE[1])
    none = LabeledImages(torch.zeros(0, 1, 40, 40), torch.zeros(0, 4))
    plain = make_samples(crops, backgrounds(), 50, object_side=16, generator=gen(6), labeled=none)
    assert len(plain.positives) == 50
