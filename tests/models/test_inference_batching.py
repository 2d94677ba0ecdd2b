"""``Localizer.localize_batch``: one forward pass for the images of several calls, a prototype per image.

What a server that batches requests relies on: the answers of a batch equal those of each call run apart
(its own images, its own prototype), boxes in each image's own pixels, trajectories included.
"""

import pytest
import torch
from test_rollout_inference_behaviour import images, tiny_bundle

from models.inference import Localizer, preprocess


def calls(loc, n_calls=4, seed=0):
    """Calls of 1-3 images of different sizes, each with its own prototype."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(n_calls):
        n = 1 + c % 3
        size = (32, 48, 20, 64)[c % 4]
        ims = list(images(n, 1, seed + c, size=size, width=size + 8 * (c % 2)))
        proto = torch.randn(16, generator=g) * 3
        out.append((ims, proto))
    return out


def assert_same(batched, apart):
    assert len(batched) == len(apart)
    for b, a in zip(batched, apart, strict=True):
        assert b.box == pytest.approx(a.box, abs=1e-4)
        assert b.score == pytest.approx(a.score, rel=1e-4, abs=1e-4)
        if a.trajectory is None:
            assert b.trajectory is None
        else:
            assert torch.allclose(torch.tensor(b.trajectory), torch.tensor(a.trajectory), atol=1e-4)


@pytest.mark.parametrize("nearest", [False, True])
@pytest.mark.parametrize("use_prototype", [False, True])
def test_a_batch_of_calls_answers_as_the_calls_run_apart(nearest, use_prototype):
    loc = Localizer(tiny_bundle(3, use_prototype=use_prototype), "cpu")
    cs = calls(loc)
    apart = [r for ims, p in cs for r in loc.localize(ims, p, trajectory=True, nearest=nearest)]
    batch, scales = preprocess([im for ims, _ in cs for im in ims], loc.spec)
    protos = torch.cat([p.expand(len(ims), -1) for ims, p in cs])  # [B, D], one per image
    batched = loc.localize_batch(batch, scales, protos, loc.agent(), trajectory=True, nearest=nearest)
    assert_same(batched, apart)
    # the calls really differ: another prototype gives other answers somewhere
    other = loc.localize_batch(batch, scales, protos.flip(0), loc.agent(), nearest=nearest)
    assert [r.score for r in other] != pytest.approx([r.score for r in batched])


def test_a_shared_prototype_equals_one_row_per_image_and_trajectories_are_optional():
    loc = Localizer(tiny_bundle(5), "cpu")
    ims = list(images(6, 1, 9))
    proto = torch.randn(16)
    batch, scales = preprocess(ims, loc.spec)
    shared = loc.localize_batch(batch, scales, proto, loc.agent(), trajectory=True)
    rows = loc.localize_batch(batch, scales, proto.expand(6, -1), loc.agent(), trajectory=True)
    assert_same(rows, shared)
    assert_same(shared, loc.localize(ims, proto, trajectory=True))
    plain = loc.localize_batch(batch, scales, proto, loc.agent())
    assert all(r.trajectory is None for r in plain)
    assert [r.box for r in plain] == [r.box for r in shared]
    assert all(len(r.trajectory) == loc.bundle.config.env.steps + 1 and r.trajectory[-1] == r.box for r in shared)


def test_prototype_rows_must_match_the_images():
    loc = Localizer(tiny_bundle(0), "cpu")
    batch, scales = preprocess(list(images(3)), loc.spec)
    with pytest.raises(ValueError, match=r"\[3, D\]"):
        loc.localize_batch(batch, scales, torch.randn(2, 16), loc.agent())
    with pytest.raises(ValueError, match="prototype must be"):
        loc.localize_batch(batch, scales, torch.randn(3, 1, 16), loc.agent())
