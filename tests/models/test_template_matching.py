"""Template matching (``models.core.matching``, the benchmarks' baseline; ``Templates.match``): its normalized
cross-correlation against a slow loop written out here, exact boxes where the answer is known, and batch
independence."""

import pytest
import torch

from models.core.metrics import corloc
from models.data.glyphs import glyphs
from models.data.types import exemplar_crops
from models.experiments.baselines import TEMPLATE_SCALES, ncc_map, scaled_template, template_matching


def slow_ncc(image: torch.Tensor, template: torch.Tensor, x: int, y: int, min_std: float = 1e-3) -> float:
    """TM_CCOEFF_NORMED at one position, with explicit loops: per-channel means, sums over the channels."""
    c, h, w = template.shape
    t_mean = [sum(float(template[k, i, j]) for i in range(h) for j in range(w)) / (h * w) for k in range(c)]
    w_mean = [sum(float(image[k, y + i, x + j]) for i in range(h) for j in range(w)) / (h * w) for k in range(c)]
    num = tt = ww = 0.0
    for k in range(c):
        for i in range(h):
            for j in range(w):
                a = float(template[k, i, j]) - t_mean[k]
                b = float(image[k, y + i, x + j]) - w_mean[k]
                num, tt, ww = num + a * b, tt + a * a, ww + b * b
    if ww < c * h * w * min_std ** 2:
        return 0.0
    return num / (tt * ww) ** 0.5


@pytest.mark.parametrize("channels", [1, 3])
def test_ncc_matches_the_slow_reference(channels):
    g = torch.Generator().manual_seed(channels)
    images = torch.rand(2, channels, 9, 11, generator=g, dtype=torch.float64)
    images[1, :, :4, :5] = 0.25  # a flat corner: windows inside it score 0
    template = torch.rand(channels, 4, 3, generator=g, dtype=torch.float64)
    fast = ncc_map(images, template)
    assert fast.shape == (2, 6, 9)
    for n in range(2):
        for y, x in [(0, 0), (0, 8), (5, 0), (5, 8), (2, 3), (4, 6), (1, 1)]:
            assert float(fast[n, y, x]) == pytest.approx(slow_ncc(images[n], template, x, y), abs=1e-9)
    assert float(fast[1, 0, 0]) == 0.0 and float(fast[1, 0, 1]) == 0.0


def test_several_templates_of_one_size_score_each_as_alone_and_a_duplicate_crop_changes_nothing():
    """``ncc_maps``: one pass for templates of one size, each channel the slow reference (a flat template among
    them scores 0 on its own channel only); ``template_matching`` over them answers as with the crop once."""
    from models.core.matching import ncc_maps

    g = torch.Generator().manual_seed(3)
    images = torch.rand(2, 1, 12, 10, generator=g, dtype=torch.float64)
    templates = torch.rand(3, 1, 4, 3, generator=g, dtype=torch.float64)
    templates[1] = 0.6  # flat
    maps = ncc_maps(images, templates)
    assert maps.shape == (2, 3, 9, 8) and torch.equal(maps[:, 1], torch.zeros(2, 9, 8, dtype=torch.float64))
    for e in (0, 2):
        for n, y, x in [(0, 0, 0), (1, 8, 7), (0, 4, 5), (1, 2, 1)]:
            assert float(maps[n, e, y, x]) == pytest.approx(slow_ncc(images[n], templates[e], x, y), abs=1e-9)
    # the same crop twice: every score ties, and the first crop's smallest scale with its best position wins
    crop = images[0, :, 2:8, 3:7].clone()
    boxes, scores = template_matching(images, [crop, crop.clone()], scales=(1.0, 0.8), return_scores=True)
    one, best = template_matching(images, [crop], scales=(0.8, 1.0), return_scores=True)
    assert torch.equal(boxes, one) and torch.equal(scores, best)
    assert boxes[0].tolist() == [3.0, 2.0, 7.0, 8.0] and float(scores[0]) == pytest.approx(1.0, abs=1e-9)


def test_ncc_is_one_where_the_template_was_cut_and_ignores_brightness_and_contrast():
    g = torch.Generator().manual_seed(0)
    image = torch.rand(1, 1, 20, 20, generator=g, dtype=torch.float64)
    template = image[0, :, 6:13, 3:8].clone()
    score = ncc_map(image, template)
    assert float(score[0, 6, 3]) == pytest.approx(1.0, abs=1e-9)
    assert int(score.flatten().argmax()) == 6 * score.shape[-1] + 3
    assert float(ncc_map(image, 0.5 * template + 0.3)[0, 6, 3]) == pytest.approx(1.0, abs=1e-9)
    assert torch.equal(ncc_map(image, torch.full_like(template, 0.4)), torch.zeros(1, 14, 16, dtype=torch.float64))


def paste_in_noise(crop: torch.Tensor, boxes: list[tuple[int, int]], size: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    images = 0.5 * torch.rand(len(boxes), crop.shape[0], size, size, generator=g)
    h, w = crop.shape[-2:]
    for i, (x, y) in enumerate(boxes):
        images[i, :, y:y + h, x:x + w] = crop
    return images


def test_a_crop_pasted_into_noise_is_found_at_its_box():
    g = torch.Generator().manual_seed(1)
    crop = (torch.rand(1, 11, 7, generator=g) > 0.5).float()  # a sharp object, unlike the noise
    where = [(0, 0), (41, 37), (17, 5), (30, 20)]
    images = paste_in_noise(crop, where)
    boxes, scores = template_matching(images, [crop], return_scores=True)
    assert boxes.tolist() == [[x, y, x + 7, y + 11] for x, y in where]
    assert torch.allclose(scores, torch.ones(4), atol=1e-5)
    # vectorized over the batch: each image alone gets the same answer
    for i in range(len(where)):
        assert torch.equal(template_matching(images[i:i + 1], [crop]), boxes[i:i + 1])


def test_the_right_scale_and_exemplar_win():
    g = torch.Generator().manual_seed(2)
    crop = (torch.rand(3, 12, 16, generator=g) > 0.5).float()
    other = (torch.rand(3, 10, 10, generator=g) > 0.5).float()
    bigger = scaled_template(crop, 1.33)  # the object is a third larger than the exemplar
    assert bigger.shape == (3, 16, 21)
    images = paste_in_noise(bigger, [(5, 9), (20, 30)], size=56)
    boxes = template_matching(images, [other, crop], scales=TEMPLATE_SCALES)
    assert boxes.tolist() == [[5, 9, 26, 25], [20, 30, 41, 46]]
    # an absolute reference side: the long side is scale x ref_side
    assert scaled_template(crop, 0.5, ref_side=32).shape == (3, 12, 16)
    assert scaled_template(crop, 1.0, ref_side=24).shape == (3, 18, 24)


def test_templates_too_large_are_skipped_and_errors():
    crop = torch.rand(1, 10, 10)
    images = paste_in_noise(crop, [(1, 2)], size=12)
    assert template_matching(images, [crop], scales=(1.0, 1.33)).tolist() == [[1, 2, 11, 12]]
    with pytest.raises(ValueError, match="larger"):
        template_matching(images, [crop], scales=(1.5,))
    with pytest.raises(ValueError, match="at least one"):
        template_matching(images, [])
    with pytest.raises(ValueError, match="channel"):
        ncc_map(images, torch.rand(3, 4, 4))


def test_template_matching_finds_glyphs_on_patches():
    """The benchmark's setting in small: exemplar crops of one glyph class (train fonts) find it in test
    images (held-out fonts) on the patch background."""
    torch.set_num_threads(1)
    ex = glyphs("K", "train", 5, "patch", seed=1000)
    test = glyphs("K", "test", 24, "patch", seed=0)
    boxes = template_matching(test.images, exemplar_crops(ex))
    assert boxes.shape == (24, 4)
    assert corloc(boxes, test.boxes) >= 75


def test_a_sets_templates_keep_their_crops_and_match_them_at_each_images_scale():
    """``Templates`` keep the crops for ``match`` (8-bit, long side at most ``MATCH_SIDE``, with their uploaded size),
    through ``to_dict`` / ``from_dict``; a calibration stored before has none (``match``: NaN). ``match`` finds each
    crop at its uploaded size in the image's pixels: an image uploaded at twice the size is matched with the crop
    halved in the input frame, and gives the same box in that frame."""
    import json

    from models.core.templates import MATCH_SIDE, Templates, make_templates, match_crops

    g = torch.Generator().manual_seed(2)
    crop = ((torch.rand(1, 12, 8, generator=g) > 0.5).float() * 255).round() / 255
    big = torch.rand(1, 90, 150, generator=g)
    kept, sizes = match_crops([crop, big])
    assert sizes == [(12, 8), (90, 150)] and kept[0].equal(crop) and max(kept[1].shape[-2:]) == MATCH_SIDE
    t = Templates(make_templates([crop]), None, 48, 1, (0.0,), crops=kept[:1], crop_sizes=sizes[:1])
    back = Templates.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.crop_sizes == [(12, 8)] and back.crops[0].equal(crop)
    where = [(3, 5), (30, 20)]
    images = paste_in_noise(crop, where)  # [2, 1, 48, 48], scale 1
    boxes = back.match(images, torch.ones(2, 2))
    assert boxes.tolist() == [[x, y, x + 8, y + 12] for x, y in where]
    # an image uploaded at 96 px (the crop at its own size in it), seen at 48: the crop is matched at half its size
    where2 = [(6, 10), (60, 40)]
    half = torch.nn.functional.interpolate(paste_in_noise(crop, where2, size=96), size=(48, 48), mode="bilinear",
                                           antialias=True, align_corners=False)
    found = back.match(half, torch.full((2, 2), 2.0))
    assert (found - torch.tensor([[x / 2, y / 2, x / 2 + 4, y / 2 + 6] for x, y in where2])).abs().max() <= 1.0
    old = t.to_dict()
    del old["crops"]
    before = Templates.from_dict(old)
    assert before.crops is None and before.match(images, torch.ones(2, 2)).isnan().all()


@pytest.mark.parametrize("channels", [1, 3])
def test_best_windows_of_templates_of_many_sizes_equal_each_ncc_map(channels, monkeypatch):
    """``best_windows`` (every template at once, by FFT and one integral image, in chunks of images) gives each
    template's best score and window as ``ncc_map`` alone, for templates of several sizes, a flat one among them
    and images with flat regions."""
    import models.core.matching as matching

    monkeypatch.setattr(matching, "MAX_CHUNK_ELEMENTS", 3 * 4 * 21 * 19)  # 3 of the 5 images a chunk
    g = torch.Generator().manual_seed(10 + channels)
    images = torch.rand(5, channels, 21, 19, generator=g)
    images[1, :, :9, :8] = 0.5  # a flat corner
    templates = [torch.rand(channels, h, w, generator=g) for h, w in ((4, 3), (7, 9), (21, 2))]
    templates.append(torch.full((channels, 5, 5), 0.3))  # flat: scores 0 everywhere
    tops, boxes = matching.best_windows(images, templates)
    assert tops.shape == (5, 4) and boxes.shape == (5, 4, 4)
    for k, t in enumerate(templates):
        score = ncc_map(images, t).flatten(1)
        top, idx = score.max(dim=1)
        assert tops[:, k].tolist() == pytest.approx(top.tolist(), abs=1e-5)
        h, w = t.shape[-2:]
        x, y = idx % (19 - w + 1), idx // (19 - w + 1)
        if k < 3:  # random templates: one best window
            assert boxes[:, k].tolist() == torch.stack([x, y, x + w, y + h], 1).float().tolist()
        else:
            assert tops[:, k].tolist() == [0.0] * 5


def test_best_windows_never_answers_a_position_whose_window_runs_past_an_edge():
    """Positions whose window would run past the right or the bottom edge (the FFT's circular correlation has a value
    there) are never answered, even where every window inside the image scores below them: a ramp template on an
    image of the opposite ramp scores -1 at every valid position, and the best is one of those (``ncc_map``'s)."""
    from models.core.matching import best_windows

    ramp = torch.linspace(0.1, 0.9, 16)
    for image, t in [(ramp.flip(0).expand(1, 1, 12, 16), ramp[:5].expand(1, 4, 5)),  # along x
                     (ramp[:12].flip(0)[:, None].expand(1, 1, 12, 16), ramp[:4, None].expand(1, 4, 5))]:  # along y
        top, box = best_windows(image.contiguous(), [t.contiguous()])
        assert float(top[0, 0]) == pytest.approx(-1.0, abs=1e-5)
        assert float(ncc_map(image, t).max()) == pytest.approx(-1.0, abs=1e-5)
        x1, y1, x2, y2 = box[0, 0].tolist()
        assert (x2 - x1, y2 - y1) == (5, 4) and 0 <= x1 <= 16 - 5 and 0 <= y1 <= 12 - 4


def test_templates_that_fit_exactly_are_kept_and_those_past_either_side_skipped():
    """The images 12 x 16: a template as tall as the images (or as wide) is matched; one taller (even if narrower), or
    wider (even if shorter), is skipped, not an error; with ``ref_side`` a crop's long side is scaled from it."""
    g = torch.Generator().manual_seed(22)
    images = 0.2 * torch.rand(2, 1, 12, 16, generator=g)
    tall, wide = (torch.rand(1, 12, 6, generator=g) > 0.5).float(), (torch.rand(1, 5, 16, generator=g) > 0.5).float()
    images[0, :, :, 7:13], images[1, :, 4:9, :] = tall, wide
    assert template_matching(images[:1], [tall], scales=(1.0,)).tolist() == [[7, 0, 13, 12]]
    assert template_matching(images[1:], [wide], scales=(1.0,)).tolist() == [[0, 4, 16, 9]]
    too_tall, too_wide = torch.rand(1, 14, 4, generator=g), torch.rand(1, 4, 18, generator=g)
    both = template_matching(images, [too_tall, too_wide, tall, wide], scales=(1.0,))
    assert both.tolist() == template_matching(images, [tall, wide], scales=(1.0,)).tolist()
    small = tall[:, ::2, ::2]  # 6 x 3: scaled by ref_side 12 to a 12 x 6 window, else its own size
    (x1, y1, x2, y2), = template_matching(images[:1], [small], scales=(1.0,), ref_side=12.0).tolist()
    assert (x2 - x1, y2 - y1) == (6, 12)
    (x1, y1, x2, y2), = template_matching(images[:1], [small], scales=(1.0,)).tolist()
    assert (x2 - x1, y2 - y1) == (3, 6)
    with pytest.raises(ValueError, match="^template matching needs at least one exemplar crop$"):
        template_matching(images, [])
