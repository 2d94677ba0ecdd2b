"""The glyph generator (``models.data.glyphs``) and its dataset kind: shapes, determinism, tight boxes,
the font split, the four cMNIST backgrounds, and ``--data glyphs`` on the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from models.data import glyphs as glyph_module
from models.data.cmnist import BACKGROUNDS
from models.data.glyphs import (
    GLYPH_CLASSES,
    INK_THRESHOLD,
    GlyphSpec,
    font_files,
    generate,
    glyphs,
    render_glyph,
    split_fonts,
)

SHIPPED = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


def ink_box(img: torch.Tensor) -> tuple[int, int, int, int]:
    """The tight box ``(x1, y1, x2, y2)`` of the non-zero pixels of ``img [H, W]``."""
    ys, xs = torch.nonzero(img > 0, as_tuple=True)
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def test_no_digit_among_the_classes_and_every_class_renders_in_every_font():
    assert len(set(GLYPH_CLASSES)) == len(GLYPH_CLASSES) >= 6
    assert not any(c.isdigit() for c in GLYPH_CLASSES)
    for font in font_files() or (None,):
        for c in GLYPH_CLASSES:
            tile = render_glyph(c, font, 30)
            assert max(tile.shape) == 30 and tile.dtype == np.float32
            assert tile.max() <= 1.0 and (tile[tile > 0] >= INK_THRESHOLD).all()
            # cut tight: every edge row and column holds ink
            assert tile[0].any() and tile[-1].any() and tile[:, 0].any() and tile[:, -1].any()


@pytest.mark.parametrize("background", BACKGROUNDS)
def test_shapes_dtypes_and_determinism(background):
    a = generate(GlyphSpec("K", "train", 6, background, seed=3))
    b = generate(GlyphSpec("K", "train", 6, background, seed=3))
    c = generate(GlyphSpec("K", "train", 6, background, seed=4))
    assert a.images.shape == (6, 1, 84, 84) and a.images.dtype == torch.float32
    assert a.boxes.shape == (6, 4) and a.boxes.dtype == torch.float32
    assert float(a.images.min()) >= 0 and float(a.images.max()) <= 1
    assert torch.equal(a.images, b.images) and torch.equal(a.boxes, b.boxes)
    assert not torch.equal(a.images, c.images)
    assert torch.equal(a.boxes, a.boxes.round()), "integer pixel edges"
    wh = a.boxes[:, 2:] - a.boxes[:, :2]
    assert bool((a.boxes >= 0).all()) and bool((a.boxes <= 84).all())
    assert bool((wh.amax(1) >= 28).all()) and bool((wh.amax(1) <= 37).all()), "long side in the style's 28-36 (+1)"


def test_a_draw_is_a_prefix_and_offset_slices_it():
    whole = glyphs("@", "train", 8, "patch", seed=1)
    head = glyphs("@", "train", 3, "patch", seed=1)
    tail = glyphs("@", "train", 5, "patch", seed=1, offset=3)
    assert torch.equal(head.images, whole.images[:3]) and torch.equal(tail.images, whole.images[3:])
    assert torch.equal(tail.boxes, whole.boxes[3:])


def test_boxes_are_tight_around_the_ink():
    """On a black canvas the non-zero pixels are the glyph's ink: their tight box is the box, exactly."""
    for c in GLYPH_CLASSES:
        data = glyphs(c, "test", 4, "none", seed=2)
        for img, box in zip(data.images[:, 0], data.boxes, strict=True):
            assert ink_box(img) == tuple(int(v) for v in box), c


def test_patches_never_cover_the_glyph():
    plain = glyphs("W", "train", 10, "none", seed=5)
    patched = glyphs("W", "train", 10, "patch", seed=5)
    assert torch.equal(plain.boxes, patched.boxes)  # the same instances, only the background differs
    for p, q, box in zip(plain.images[:, 0], patched.images[:, 0], patched.boxes.long(), strict=True):
        x1, y1, x2, y2 = box.tolist()
        assert torch.equal(p[y1:y2, x1:x2], q[y1:y2, x1:x2])
        outside = q.clone()
        outside[y1:y2, x1:x2] = 0
        assert float((outside > 0).float().mean()) > 0.05  # there are patches


def test_classes_differ():
    """Different characters give different ink (same font, size, seed); images of two classes differ."""
    font = split_fonts("train")[0]
    tiles = {c: render_glyph(c, font, 32) for c in GLYPH_CLASSES}
    for i, a in enumerate(GLYPH_CLASSES):
        for b in GLYPH_CLASSES[i + 1:]:
            ta, tb = tiles[a], tiles[b]
            assert ta.shape != tb.shape or np.abs(ta - tb).mean() > 0.05, (a, b)
    assert not torch.equal(glyphs("A", "train", 2, "none").images, glyphs("e", "train", 2, "none").images)


def test_test_fonts_are_held_out_and_splits_use_their_own_streams():
    train, val, test = split_fonts("train"), split_fonts("val"), split_fonts("test")
    if len(font_files()) > 1:
        assert not set(train) & set(test) and set(train) | set(test) == set(font_files())
        assert 1 <= len(test) < len(train)
    assert train == val
    a, b = glyphs("R", "train", 4, "none", seed=0), glyphs("R", "val", 4, "none", seed=0)
    assert not torch.equal(a.images, b.images)
    with pytest.raises(ValueError, match="split"):
        glyphs("R", "holdout", 1)
    with pytest.raises(ValueError, match="one character"):
        glyphs("AB", "train", 1)
    with pytest.raises(ValueError, match="background"):
        glyphs("A", "train", 1, "snow")


def test_no_font_files_falls_back_to_the_builtin_font(monkeypatch):
    monkeypatch.setattr(glyph_module, "font_files", lambda: ())
    assert split_fonts("test") == (None,)
    data = glyphs("&", "test", 3, "none", seed=0)
    for img, box in zip(data.images[:, 0], data.boxes, strict=True):
        assert ink_box(img) == tuple(int(v) for v in box)


def test_clutter_is_cut_from_other_glyphs():
    data = glyphs("g", "train", 4, "clutter", seed=0)
    for img, box in zip(data.images[:, 0], data.boxes.long(), strict=True):
        x1, y1, x2, y2 = box.tolist()
        outside = img.clone()
        outside[y1:y2, x1:x2] = 0
        assert float((outside > 0).float().mean()) > 0.01


def test_glyph_kind_draws_disjoint_exemplars_and_unlabeled_and_tests_on_test_fonts(monkeypatch):
    from models.experiments.datasets import GlyphKind

    kind = GlyphKind("#", "patch")
    assert kind.model_config().input.size == 84 and kind.sizes()["exemplars"] == 5
    ex = kind.draw(None, "exemplars", 5, seed=0)
    unl = kind.draw(None, "unlabeled", 6, seed=0, after=5)
    both = glyphs("#", "train", 11, "patch", seed=1000)
    assert torch.equal(ex.images, both.images[:5]) and torch.equal(unl.images, both.images[5:])
    seen = []
    monkeypatch.setattr(glyph_module, "split_fonts", lambda split: seen.append(split) or font_files() or (None,))
    kind.draw(None, "test", 2, seed=0)
    assert seen == ["test"]


@pytest.mark.slow
def test_cli_evaluates_the_shipped_bundle_on_glyphs(capsys):
    from models.cli import main

    code = main(["evaluate", "--bundle", str(SHIPPED), "--data", "glyphs", "--glyph", "W", "--n-test", "10",
                 "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["glyph"] == "W" and out["n_test"] == 10 and 0 <= out["corloc"] <= 100


# The fonts every glyph figure in BENCHMARKS.md was rendered with (Debian's fonts-dejavu-core and -extra: their
# files' names and sizes) and the FreeType that rendered them (Pillow's).
BENCHMARK_FONTS = "216801570fb24de7"
BENCHMARK_FREETYPE = "2.14.3"


def fonts_fingerprint() -> str:
    import hashlib
    import os

    listing = "".join(f"{os.path.basename(f)}:{os.path.getsize(f)};" for f in font_files())
    return hashlib.sha256(listing.encode()).hexdigest()[:16]


def test_the_generated_glyphs_are_the_ones_every_glyph_number_was_measured_on():
    """With the benchmarks' fonts and FreeType, the generator draws the images the glyph figures of BENCHMARKS.md
    were measured on (unchanged since 2026-11-26): a change to what it draws (fonts chosen, sizes, strokes,
    rotations, positions, the resize, the ink threshold, the streams' keys) shows here. A deliberate change re-runs
    the benchmarks and updates these. Elsewhere (other fonts, another FreeType) the images differ by design: skipped."""
    import hashlib

    from PIL import features

    if (fonts_fingerprint(), features.version("freetype2")) != (BENCHMARK_FONTS, BENCHMARK_FREETYPE):
        pytest.skip(f"fonts {fonts_fingerprint()} / FreeType {features.version('freetype2')}: not the benchmarks' "
                    f"({BENCHMARK_FONTS} / {BENCHMARK_FREETYPE})")

    def digest(b) -> str:  # type: ignore[no-untyped-def]
        h = hashlib.sha256(np.ascontiguousarray(b.images.numpy()).tobytes())
        h.update(np.ascontiguousarray(b.boxes.numpy()).tobytes())
        return h.hexdigest()[:16]

    cases = {"patch": GlyphSpec("A", "train", 8, "patch", seed=0),
             "clutter": GlyphSpec("&", "test", 6, "clutter", seed=1),
             "impulse": GlyphSpec("?", "val", 6, "impulse", seed=2, offset=3),
             "gaussian": GlyphSpec("W", "test", 6, "gaussian", seed=3),
             "none": GlyphSpec("g", "train", 6, "none", seed=4)}
    assert {k: digest(generate(s)) for k, s in cases.items()} == {
        "patch": "80d9990bc501dbf9", "clutter": "7ac49b35c0ade0b5", "impulse": "2ae7884778de062a",
        "gaussian": "31104e1b9ec67d3f", "none": "3f6daa4528d86e43"}
    assert digest(glyphs("A", "train", 8)) == "80d9990bc501dbf9"  # patch, seed 0, from the first image


@pytest.mark.parametrize(("n", "n_test"), [(1, 1), (2, 1), (3, 1), (8, 2), (22, 6)])
def test_a_quarter_of_the_fonts_and_at_least_one_are_held_out_for_test(monkeypatch, n, n_test):
    files = tuple(f"/fonts/f{i:02d}.ttf" for i in range(n))
    monkeypatch.setattr(glyph_module, "font_files", lambda: files)
    test, train, val = (split_fonts(s) for s in ("test", "train", "val"))
    if n == 1:  # one font serves every split
        assert test == train == val == files
        return
    assert len(test) == n_test and train == val and len(train) == n - n_test
    assert set(test) | set(train) == set(files) and not set(test) & set(train)
    assert list(test) == sorted(test) and list(train) == sorted(train)
    with pytest.raises(ValueError, match=r"^split must be one of \('train', 'val', 'test'\), got 'holdout'$"):
        split_fonts("holdout")


def test_the_test_fonts_are_a_fixed_draw():
    """The partition is drawn once, from its own seed (not a job's): of the benchmarks' 22 DejaVu files, the
    condensed sans, the three mono variants but the regular, and two bold-italic serifs."""
    files = tuple(f"/fonts/f{i:02d}.ttf" for i in range(22))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(glyph_module, "font_files", lambda: files)
        held = split_fonts("test")
    assert held == tuple(files[i] for i in (9, 10, 11, 12, 15, 19))


def test_a_glyph_is_drawn_upright_without_extra_stroke_by_default_and_to_its_size():
    font = font_files()[0] if font_files() else None
    plain = render_glyph("K", font, 30)
    assert np.array_equal(plain, render_glyph("K", font, 30, 0, 0.0))
    assert not np.array_equal(plain, render_glyph("K", font, 30, 2, 0.0))
    assert not np.array_equal(plain, render_glyph("K", font, 30, 0, 8.0))
    for size in (20, 28, 36):
        tile = render_glyph("K", font, size, 1, 5.0)
        assert max(tile.shape) == size and tile.dtype == np.float32
        assert float(tile.max()) <= 1.0 and float(tile[tile > 0].min()) >= INK_THRESHOLD
        assert tile[0].any() and tile[-1].any() and tile[:, 0].any() and tile[:, -1].any()  # tight


def test_where_no_scale_gives_the_size_the_tile_is_the_nearest_above_it():
    """The threshold can cut a faint edge row at every scale near the size asked for (2 of 4,752 combinations of
    the benchmarks'): then the nearest tile above it, never one below."""
    font = "/usr/share/fonts/truetype/dejavu/DejaVuSans-ExtraLight.ttf"
    if font not in font_files():
        pytest.skip("DejaVu Sans ExtraLight (Debian's fonts-dejavu-extra) is not installed")
    for size, stroke, want in ((29, 0, (30, 28)), (31, 1, (32, 30))):
        tile = render_glyph("W", font, size, stroke, -12.0)
        assert tile.shape == want
        assert tile[0].any() and tile[-1].any() and tile[:, 0].any() and tile[:, -1].any()


def test_a_styles_stroke_range_is_drawn_from_its_lower_end_up():
    """Strokes of (2, 2): every glyph is one of the split's fonts at stroke 2, none thinner."""
    style = glyph_module.GlyphStyle(size=(30, 30), stroke=(2, 2), rotation=0.0)
    data = generate(GlyphSpec("R", "test", 4, "none", seed=0, style=style))
    renders = [render_glyph("R", f, 30, 2, 0.0) for f in split_fonts("test")]
    for img, box in zip(data.images[:, 0].numpy(), data.boxes.long(), strict=True):
        crop = img[box[1]:box[3], box[0]:box[2]]
        assert any(r.shape == crop.shape and np.array_equal(r, crop) for r in renders)


def test_a_glyph_may_be_as_large_as_the_canvas_and_other_requests_are_refused_by_name():
    style = glyph_module.GlyphStyle(size=(84, 84), stroke=(0, 0), rotation=0.0)
    big = generate(GlyphSpec("A", "train", 1, "none", style=style))
    x1, y1, x2, y2 = ink_box(big.images[0, 0])
    assert (x1, y1, x2, y2) == tuple(int(v) for v in big.boxes[0]) and max(x2 - x1, y2 - y1) == 84
    too_big = glyph_module.GlyphStyle(size=(60, 85))
    with pytest.raises(ValueError, match=r"^glyph size \(60, 85\) does not fit a 84x84 canvas$"):
        generate(GlyphSpec("A", "train", 1, "none", style=too_big))
    with pytest.raises(ValueError, match=r"^background must be one of \('patch', 'clutter', 'impulse', 'gaussian', "
                                         r"'none'\), got 'snow'$"):
        glyphs("A", "train", 1, "snow")
    with pytest.raises(ValueError, match=r"^split must be one of \('train', 'val', 'test'\), got 'holdout'$"):
        glyphs("A", "holdout", 1)
    with pytest.raises(ValueError, match="^a glyph class is one character, got 'AB'$"):
        glyphs("AB", "train", 1)
