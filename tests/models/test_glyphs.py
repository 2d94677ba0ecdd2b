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
