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
