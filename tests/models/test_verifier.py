"""The known-kinds verifier (``models.verifier``): its check's math, its file, the shipped one on cMNIST."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from models.backbones.onednn import OneDnnConvs
from models.backbones.onednn import available as onednn_available
from models.calibration import Calibration, calibrate_policy, stored_kind
from models.core.boxes import paired_iou
from models.core.platt import PlattFit
from models.data.glyphs import glyphs
from models.data.types import exemplar_crops
from models.experiments.cmnist import cmnist
from models.verifier import (
    KNOWN_BAR,
    NEGATIVE_BAR,
    KindCheck,
    KindVerifier,
    background_boxes,
    encoder,
    jitter,
    load_verifier,
    read_boxes,
    resize_crops,
    save_verifier,
    train_verifier,
    verifier_path,
)

SHIPPED = Path(__file__).resolve().parents[2] / "bundles"


def test_the_check_is_a_softmax_over_the_sets_prototype_and_the_others():
    e = F.normalize(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), dim=-1)
    check = KindCheck([1.0, 0.0], [[0.0, 1.0]], "a", 0.99, "sha", temperature=10.0)
    p = check.probability(e)
    assert p.dtype == torch.float64
    assert p[0] == pytest.approx(1 / (1 + torch.exp(torch.tensor(-10.0)).item()))
    assert p[1] == pytest.approx(1 / (1 + torch.exp(torch.tensor(10.0)).item()))
    assert p[2] == pytest.approx(0.5)  # as near one as the other
    assert KindCheck.from_dict(check.to_dict()) == check
    # batched over any leading shape, as boxes [n, K, D]
    assert check.probability(e.view(3, 1, 2)).shape == (3, 1)


def test_read_boxes_reads_each_images_boxes():
    images = torch.zeros(2, 1, 84, 84)
    images[0, :, 10:30, 10:30] = 1.0
    images[1, :, 50:70, 50:70] = 1.0
    inside = [[12.0, 12, 28, 28], [52, 52, 68, 68]]  # within each square (roi_align blends at the edges)
    x = read_boxes(images, torch.tensor([inside, inside])).view(2, 2, -1).mean(-1)
    assert x.tolist() == [[pytest.approx(1.0), pytest.approx(0.0)], [pytest.approx(0.0), pytest.approx(1.0)]]


def test_background_boxes_sit_beside_the_object():
    b = cmnist(3, "train", 64, seed=0).boxes
    bg = background_boxes(b, 84, torch.Generator().manual_seed(0))
    assert bg.shape == b.shape and (bg >= 0).all() and (bg <= 84).all()
    assert (paired_iou(bg, b) < 0.1).float().mean() >= 0.95


def test_a_tiny_verifier_trains_saves_loads_and_checks(tmp_path):
    parts = {str(d): cmnist(d, "train", 24, seed=0) for d in (1, 4)}
    v = train_verifier({k: p.images for k, p in parts.items()}, {k: p.boxes for k, p in parts.items()},
                       iterations=3, seed=0)
    assert v.names == ["1", "4", "background"] and v.kinds.shape == (3, 64)
    path = verifier_path(tmp_path / "b.pt")
    assert path.name == "b.verifier"
    sha = save_verifier(path, v, {"test": True})
    back = load_verifier(path)
    assert back.sha256 == sha and back.names == v.names and torch.equal(back.kinds, v.kinds)
    crops = exemplar_crops(parts["4"])[:5]
    x = read_boxes(parts["4"].images[:2], parts["4"].boxes[:2, None])
    assert torch.allclose(back.embed(x), v.embed(x), atol=1e-5)  # loaded: batch norms folded (``freeze``)
    assert set(back.state_dict()) == set(v.state_dict())  # the folded copy is not saved
    assert back.check([c.repeat(3, 1, 1) for c in crops]) is None  # not its channels
    (tmp_path / "bad.verifier").write_bytes(b"not a verifier")
    with pytest.raises(ValueError, match="not a qloc verifier"):
        load_verifier(tmp_path / "bad.verifier")


def test_a_calibration_with_a_check_round_trips_and_applies_only_with_its_verifier():
    v = KindVerifier(1, ["0", "background"])
    v.sha256 = "abc"
    check = KindCheck([1.0] + [0.0] * 63, [[0.0, 1.0] + [0.0] * 62], "0", 0.97, "abc")
    cal = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0), kind=check)
    assert not cal.kind_applies(v)  # a check needs the NCC fits' templates (grayscale sets)
    d = cal.to_dict()
    assert d["version"] == 3 and stored_kind(d) == check
    assert Calibration.from_dict(d).kind == check
    assert stored_kind(None) is None and stored_kind({"version": 2}) is None


@pytest.fixture(scope="module")
def shipped():
    path = SHIPPED / "mnist-general.verifier"
    if not path.is_file():
        pytest.skip("the shipped verifier is not installed")
    from models.bundle import load_bundle
    from models.inference import Localizer

    return load_verifier(path), Localizer(load_bundle(SHIPPED / "mnist-general.pt"), "cpu")


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_the_served_encoder_on_onednn_gives_the_nets_embeddings(shipped):
    v = shipped[0]
    assert isinstance(v._served[0], OneDnnConvs) and [k for k, _ in v._served[0].steps] == ["conv", "relu", "pool"] * 3
    folded = load_verifier(SHIPPED / "mnist-general.verifier").freeze(onednn=False)
    assert isinstance(folded._served[0], torch.nn.Sequential)
    x = read_boxes(cmnist(7, "val", 9, "clutter", 0).images, cmnist(7, "val", 9, "clutter", 0).boxes[:, None])
    for n in (1, 2, 9):  # one box, and batches
        with torch.no_grad():
            plain = F.normalize(v.net(x[:n]), dim=-1)  # batch norms as trained, eager layers
        assert torch.allclose(v.embed(x[:n]), plain, atol=1e-5)
        assert torch.allclose(folded.embed(x[:n]), plain, atol=1e-5)
    assert v.embed(x[:0]).shape == (0, v.kinds.shape[1])
    convs = v._served[0]
    with torch.no_grad():
        ref = convs.dense(x[:2])
        assert torch.allclose(convs(x[:2]), ref, atol=1e-5)
        assert torch.allclose(convs(x[:2].contiguous(memory_format=torch.channels_last)), ref, atol=1e-5)
        assert convs(x[:0]).shape == (0, v.kinds.shape[1])
    with torch.enable_grad():
        assert torch.allclose(convs(x[:2]), ref, atol=1e-5)  # gradients on: the layers as given


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_the_served_encoder_answers_several_threads_at_once(shipped):
    import threading

    v = shipped[0]
    xs = [read_boxes(p.images, p.boxes[:, None]) for p in (cmnist(d, "val", 8, "patch", 0) for d in range(4))]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the API sets it: new threads must run oneDNN with it too, not OpenMP's default
    try:
        ref = [v.embed(x) for x in xs]
        wrong: list[int] = []

        def work(i: int) -> None:
            for _ in range(25):
                if not torch.equal(v.embed(xs[i]), ref[i]):
                    wrong.append(i)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(threads_before)
    assert wrong == []


def test_the_shipped_verifier_knows_digits_and_not_glyphs(shipped):
    v, _ = shipped
    assert v.names == [*map(str, range(10)), "background"]
    four = v.check(exemplar_crops(cmnist(4, "train", 5, seed=1000)))
    assert four is not None and four.kind == "4" and four.known >= KNOWN_BAR and four.verifier == v.sha256
    assert len(four.others) == 10  # nine other digits and the background
    k_crops = exemplar_crops(glyphs("K", "train", 5, seed=1000))
    assert v.check(k_crops) is None
    # negative exemplars: a crop of another known kind is represented by its prototype already; one of a kind the
    # verifier never saw (K: cosine <= 0.6 with any digit) becomes a prototype of its own (NEGATIVE_BAR)
    nines = exemplar_crops(cmnist(9, "train", 3, seed=2000))
    nine_sims = v.embed(resize_crops(nines)) @ v.kinds[:-1].T
    represented = int(((nine_sims.max(1).values >= NEGATIVE_BAR) & (nine_sims.argmax(1) != 4)).sum())
    assert represented >= 2
    with_negs = v.check(exemplar_crops(cmnist(4, "train", 5, seed=1000)), nines + k_crops[:2])
    assert len(with_negs.others) == 10 + (3 - represented) + 2


def test_with_the_check_a_set_of_fours_is_found_on_fours_and_not_on_other_digits(shipped):
    """The served confidence of a new set of 4s on `mnist-general` (validation images): the NCC fit alone calls
    about a third of the other digits found (precision 0.68); the check calls almost none."""
    v, loc = shipped
    crops = exemplar_crops(cmnist(4, "train", 5, seed=1000))
    proto = loc.prototype(crops)
    cal = calibrate_policy(loc, proto, crops, nearest=loc.default_nearest, n=32, seed=0, verifier=v)
    assert cal.kind is not None and cal.stats["kind"] == "4"
    fours = cmnist(4, "val", 40, seed=0)
    others = torch.cat([cmnist(d, "val", 5, seed=0).images for d in (1, 7, 9, 2, 6, 8, 0, 3)])
    agent = loc.agent()
    served, fit = {}, {}
    for name, imgs in (("fours", fours.images), ("others", others)):
        ro = loc.run(imgs, proto, agent, nearest=loc.default_nearest)
        boxes, scores = ro.boxes[-1][:, None], ro.distances[-1][:, None]
        served[name] = cal.box_confidence(imgs, boxes, scores, verifier=v)[:, 0]
        fit[name] = cal.box_confidence(imgs, boxes, scores)[:, 0]
        if name == "fours":
            right = paired_iou(ro.boxes[-1], fours.boxes) >= 0.5
    assert (served["fours"][right] >= 0.5).float().mean() >= 0.9
    assert (served["others"] >= 0.5).float().mean() <= 0.1
    assert (served["others"] >= 0.5).sum() < (fit["others"] >= 0.5).sum()  # the fit alone: a third or more
    other = KindVerifier(1, v.names)
    other.sha256 = "another file"
    assert torch.equal(cal.box_confidence(others[:4], torch.tensor([[[20.0, 20, 48, 48]]] * 4), torch.ones(4, 1),
                                          verifier=other),
                       cal.box_confidence(others[:4], torch.tensor([[[20.0, 20, 48, 48]]] * 4), torch.ones(4, 1)))


# --- pinned against the module's surviving mutants (TESTING.md, mutation testing)


def test_read_boxes_samples_pixel_centres_and_averages_each_bin():
    ramp = torch.arange(84.0).repeat(84, 1)[None, None]  # value = x
    whole = read_boxes(ramp[..., :28, :28], torch.tensor([[[0.0, 0.0, 28.0, 28.0]]]))
    assert torch.allclose(whole[0, 0], ramp[0, 0, :28, :28], atol=1e-5)  # aligned: bin centres on pixel centres
    third = read_boxes(ramp ** 2, torch.tensor([[[0.0, 0.0, 84.0, 84.0]]]))  # 3 x 3 samples per bin, averaged
    x = torch.arange(28.0) * 3 + 1  # each bin's samples at x - 1, x, x + 1
    assert torch.allclose(third[0, 0, 0], x ** 2 + 2 / 3, atol=1e-2)  # one sample at the centre would give x ** 2
    two = torch.stack([ramp[0], 2 * ramp[0]])[:, :, :28, :28]  # each image reads its own boxes
    both = read_boxes(two, torch.tensor([[[0.0, 0.0, 28.0, 28.0]], [[0.0, 0.0, 28.0, 28.0]]]))
    assert torch.allclose(both[1], 2 * both[0])
    f64 = read_boxes(two, torch.tensor([[[0.0, 0.0, 28.0, 28.0]], [[0.0, 0.0, 28.0, 28.0]]], dtype=torch.float64))
    assert f64.dtype == torch.float32 and torch.allclose(f64, both)  # boxes in another dtype: read as the images


def test_resize_crops_antialiases_and_keeps_pixel_centres():
    checker = (torch.arange(84)[:, None] + torch.arange(84)[None]) % 2  # period 2 px: averages to 0.5
    out = resize_crops([checker[None].float()])
    assert out.shape == (1, 1, 28, 28) and (out - 0.5).abs().max() < 0.05
    ramp = torch.arange(28.0).repeat(28, 1)[None]
    assert torch.allclose(resize_crops([ramp * 2])[0, 0], ramp[0] * 2, atol=1e-5)  # same size: unchanged
    small = resize_crops([torch.arange(14.0).repeat(14, 1)[None]])[0, 0, 0]
    assert small[0] == pytest.approx(0.0, abs=1e-5) and small[-1] == pytest.approx(13.0, abs=1e-5)
    assert small[1] == pytest.approx(0.0 + 0.25, abs=1e-5)  # align_corners=False: half-pixel centres


def test_a_verifier_file_records_its_format_widths_and_provenance_and_loads_them(tmp_path):
    v = KindVerifier(1, ["a", "background"], widths=(8, 16, 16)).eval()
    assert [m.out_channels for m in v.net if isinstance(m, torch.nn.Conv2d)] == [8, 16, 16]
    assert v.sha256 is None and v._served == ()
    sha = save_verifier(tmp_path / "v.verifier", v, {"by": "test"})
    d = torch.load(tmp_path / "v.verifier", weights_only=True)
    assert (d["format"], d["format_version"], d["widths"], d["provenance"]) == ("qloc-verifier", 1, [8, 16, 16],
                                                                                 {"by": "test"})
    back = load_verifier(tmp_path / "v.verifier")
    assert back.widths == (8, 16, 16) and back.sha256 == sha
    x = torch.rand(3, 1, 28, 28)
    assert torch.allclose(back.embed(x), v.eval().embed(x), atol=1e-5)


def test_a_verifier_file_that_is_not_one_is_refused_without_running_its_pickle(tmp_path):
    class Boom:
        def __reduce__(self):
            return (print, ("a pickle ran",))

    torch.save({"format": "qloc-verifier", "x": Boom()}, tmp_path / "pickle.verifier")
    with pytest.raises(ValueError, match=r"pickle.verifier is not a qloc verifier file \(UnpicklingError\)"):
        load_verifier(tmp_path / "pickle.verifier")  # weights only: no code from the file runs
    torch.save([1, 2], tmp_path / "list.verifier")
    with pytest.raises(ValueError, match=r"list.verifier is not a qloc verifier file$"):
        load_verifier(tmp_path / "list.verifier")
    torch.save({"format": "something else"}, tmp_path / "other.verifier")
    with pytest.raises(ValueError, match=r"other.verifier is not a qloc verifier file$"):
        load_verifier(tmp_path / "other.verifier")


def test_the_default_encoder_reads_one_channel_into_64_dimensions():
    assert encoder().eval()(torch.rand(2, 1, 28, 28)).shape == (2, 64)


def test_jitter_moves_and_scales_boxes_within_its_amount_and_repeats_with_its_generator():
    boxes = torch.tensor([[10.0, 20.0, 30.0, 60.0]]).repeat(4000, 1)  # w 20, h 40
    out = jitter(boxes, torch.Generator().manual_seed(0), amount=0.1)
    assert torch.equal(out, jitter(boxes, torch.Generator().manual_seed(0), amount=0.1))
    cx, cy = (out[:, 0] + out[:, 2]) / 2, (out[:, 1] + out[:, 3]) / 2
    sw, sh = (out[:, 2] - out[:, 0]) / 20, (out[:, 3] - out[:, 1]) / 40
    assert (cx - 20).abs().max() <= 2.0 + 1e-4 and (cx - 20).abs().max() > 1.9  # up to 0.1 of the width
    assert (cy - 40).abs().max() <= 4.0 + 1e-4 and (cy - 40).abs().max() > 3.8  # of the height
    assert torch.allclose(sw, sh) and sw.min() >= 0.9 - 1e-5 and sw.max() <= 1.1 + 1e-5  # one scale, 1 +- 0.1
    assert sw.min() < 0.91 and sw.max() > 1.09 and (cx < 20).any() and (cx > 20).any()
    assert abs(float(torch.corrcoef(torch.stack([cx, cy]))[0, 1])) < 0.1  # independent shifts
    assert abs(float(torch.corrcoef(torch.stack([sw, cy]))[0, 1])) < 0.1  # the scale apart from the shifts
    default = jitter(boxes[:2000], torch.Generator().manual_seed(1))
    shift = ((default[:, 0] + default[:, 2]) / 2 - 20).abs().max()
    assert 2.8 < shift <= 3.0 + 1e-4  # the default amount: 0.15 of the width


def test_a_short_training_learns_to_tell_look_alike_digits_apart():
    parts = {str(d): cmnist(d, "train", 48, seed=0) for d in (4, 9)}
    images, boxes = {k: p.images for k, p in parts.items()}, {k: p.boxes for k, p in parts.items()}
    held = [cmnist(d, "val", 60, seed=0) for d in (4, 9)]

    def accuracy(iterations: int) -> float:
        v = train_verifier(images, boxes, iterations=iterations, seed=0, widths=(8, 16, 16)).freeze()
        assert v.widths == (8, 16, 16) and v.names == ["4", "9", "background"]
        e = torch.cat([v.embed(read_boxes(p.images, p.boxes[:, None])) for p in held])
        return float(((e @ v.kinds[:2].T).argmax(1) == torch.arange(2).repeat_interleave(60)).float().mean())

    untrained, trained = accuracy(0), accuracy(150)  # nearest prototype, held-out 4s and 9s
    assert untrained < 0.85 and trained >= 0.9  # measured 0.73 and 0.96


def test_training_repeats_with_its_seed():
    parts = {str(d): cmnist(d, "train", 16, seed=0) for d in (1, 4)}
    args = ({k: p.images for k, p in parts.items()}, {k: p.boxes for k, p in parts.items()})
    a, b = train_verifier(*args, iterations=2, seed=5), train_verifier(*args, iterations=2, seed=5)
    assert torch.equal(a.kinds, b.kinds)
    assert not torch.equal(a.kinds, train_verifier(*args, iterations=2, seed=6).kinds)


def test_background_boxes_are_squares_of_the_objects_size_overlapping_it_least_of_their_tries():
    from torchvision.ops import box_iou

    g = torch.Generator().manual_seed(3)
    xy, wh = torch.rand(200, 2, generator=g) * 36, 40 + torch.rand(200, 2, generator=g) * 8  # big: most tries overlap
    b = torch.cat([xy, xy + wh], 1)
    out = background_boxes(b, 84, torch.Generator().manual_seed(7), tries=16)
    side = out[:, 2] - out[:, 0]
    assert torch.allclose(out[:, 3] - out[:, 1], side) and (out >= 0).all() and (out <= 84 + 1e-4).all()
    ratio = side / wh.mean(1)
    assert ratio.min() >= 0.8 - 1e-5 and ratio.max() <= 1.4 + 1e-5 and ratio.min() < 0.85 and ratio.max() > 1.3
    r = torch.Generator().manual_seed(7)  # the same draws, scored by torchvision's IoU
    s = wh.mean(1, keepdim=True) * (0.8 + 0.6 * torch.rand(200, 16, generator=r))
    x, y = torch.rand(200, 16, generator=r) * (84 - s), torch.rand(200, 16, generator=r) * (84 - s)
    cand = torch.stack([x, y, x + s, y + s], -1)
    iou = torch.stack([box_iou(cand[i], b[i:i + 1])[:, 0] for i in range(200)])
    assert (iou > 0).all(1).float().mean() > 0.3  # rows where the least overlap is not zero tell IoUs apart
    assert torch.allclose(out, cand[torch.arange(200), iou.argmin(1)])


class Scripted(KindVerifier):
    """A verifier whose embedding is given: a flat crop of value ``i / 10`` embeds as ``table[i]`` (to test ``check``'s
    rules on exact cosines, not a network's)."""

    def __init__(self, kinds: torch.Tensor, table: torch.Tensor):
        super().__init__(1, [f"k{i}" for i in range(len(kinds) - 1)] + ["background"], dim=kinds.shape[1])
        self.kinds.copy_(kinds)
        self.table = table

    def embed(self, x):
        return self.table[torch.round(x[:, 0, 0, 0] * 10).long()]


def flat(i: int) -> torch.Tensor:
    return torch.full((1, 12, 9), i / 10)


def test_the_check_takes_the_nearest_known_kind_its_bars_inclusive_and_keeps_only_negatives_no_other_kind_owns(
        monkeypatch):
    """``check`` by value: the nearest kind among the known ones (the last known one too; never the background), its
    cosine kept to 4 decimals; ``KNOWN_BAR`` and ``NEGATIVE_BAR`` reached count; a negative is left out only when
    another known kind owns it (its nearest, at the bar), kept when it is nearest the set's own kind or none's."""
    eye = torch.eye(5)
    kinds = torch.stack([eye[0], eye[1], eye[2], eye[4]])  # k0, k1, k2 (the last known kind), background
    near = F.normalize(torch.tensor([0.0, 0.0, 1.0, 0.55, 0.0]), dim=0)  # the set: nearest k2, cosine ~0.8762
    table = torch.stack([
        near,
        F.normalize(torch.tensor([1.0, 0.0, 0.3, 0.0, 0.0]), dim=0),  # 1: a negative k0 owns (nearest k0)
        F.normalize(torch.tensor([0.3, 0.0, 1.0, 0.0, 0.0]), dim=0),  # 2: a negative nearest the set's own kind
        F.normalize(torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0]), dim=0),  # 3: a negative of no known kind
        F.normalize(torch.tensor([0.9, 0.3, 0.0, 0.5, 0.0]), dim=0),  # 4: nearest k0, below the bar
        F.normalize(torch.tensor([0.4, 1.0, 0.0, 0.0, 0.0]), dim=0),  # 5: a negative k1 owns
    ])
    v = Scripted(kinds, table)
    proto, at, known = v.nearest_kind([flat(0), flat(0)])
    assert (at, known) == (2, pytest.approx(float(near[2]))) and torch.allclose(proto, near)
    monkeypatch.setattr("models.verifier.KNOWN_BAR", known)  # reached exactly: known
    monkeypatch.setattr("models.verifier.NEGATIVE_BAR", float(table[5, 1]))  # reached exactly by 5, below 1's
    assert float(table[1, 0]) > float(table[5, 1]) > float(table[4, 0])
    c = v.check([flat(0)], [flat(1), flat(2), flat(3), flat(4), flat(5)])
    assert (c.kind, c.known, c.verifier) == ("k2", round(known, 4), "") and c.known != known
    assert torch.allclose(torch.tensor(c.prototype), near)
    want = torch.cat([kinds[:2], kinds[3:], table[2:5]])  # the other known kinds, the background, negatives 2, 3, 4
    assert torch.allclose(torch.tensor(c.others), want)
    monkeypatch.setattr("models.verifier.KNOWN_BAR", float(torch.nextafter(torch.tensor(known), torch.tensor(2.0))))
    assert v.check([flat(0)]) is None  # just below the bar: not a known kind
