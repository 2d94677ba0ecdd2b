"""``app.engine_ncc`` by value: what the local engine reads beside the model, on the batch it ran, is what the route's
verdict would read call by call (``Templates.ncc``, the known-kinds check, ``Templates.match`` on each call's own
rows), whatever the batch holds around a call; each set of templates, and each verifier, is read once per batch; the
answers already read by the second look are not read again, and give the same features.

The calls are stand-ins of ``app.serving.Prepared`` with only what these functions read (``templates``, ``kind``,
``second_look``); the engine's own tests (``tests/app/test_app_batching.py``) run them behind the model."""

from __future__ import annotations

from itertools import accumulate
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from app import engine_ncc
from app.engine_ncc import SecondLook, answer_rows, doubtful_answers, read_kinds, read_ncc, template_windows
from models.calibration import Calibration
from models.core.platt import PlattFit
from models.core.templates import Templates, make_templates, match_crops
from models.inference import Instance, Localization
from models.verifier import KindCheck, KindVerifier

S = 48  # the stand-in bundle's input size


def images(n: int, seed: int = 0) -> Tensor:
    """``[n, 1, S, S]``: noise with a bright square and a dark bar at places of each image's own."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, S, S, generator=g) * 0.3
    for i in range(n):
        y0, x0 = (int(v) for v in torch.randint(0, S - 16, (2,), generator=g))
        x[i, :, y0:y0 + 14, x0:x0 + 14] = 0.9
        x[i, :, (y0 + 20) % (S - 4):(y0 + 20) % (S - 4) + 3, 4:S - 4] = 0.05
    return x


def templates(seed: int, *, negatives: bool) -> Templates:
    crops = [images(1, seed + k)[0, :, 4:40, 6:30] for k in range(3)]
    kept, _ = match_crops(crops)
    return Templates(make_templates(crops), make_templates([images(1, seed + 9)[0, :, 0:20, 0:20]]) if negatives
                     else None, S, 1, (0.0,), crops=kept, crop_sizes=[(36, 24)] * 3)


T1, T2 = templates(1, negatives=True), templates(20, negatives=False)


class Counting:
    """A set of templates (or a verifier) that counts its reads (``method``) and the rows they read."""

    def __init__(self, inner, method: str):  # type: ignore[no-untyped-def]
        self.inner, self.method, self.calls, self.rows = inner, method, 0, []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name != self.method:
            return getattr(self.inner, name)

        def read(images01: Tensor, boxes: Tensor):  # type: ignore[no-untyped-def]
            self.calls += 1
            self.rows.append(tuple(boxes.shape[:2]))  # (images, boxes each); ``match``: (images, 2)
            return getattr(self.inner, name)(images01, boxes)
        return read


def call(templates=None, kind=None, look=None) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(templates=templates, kind=kind, second_look=look)


def layout(counts: list[int]) -> list[int]:
    return list(accumulate(counts, initial=0))[:-1]


def box(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
    return (x, y, x + w, y + h)


def results_for(n: int, instances: dict[int, int], seed: int = 0) -> list[Localization]:
    """``n`` answers in image pixels (of images 1.5x the input: ``SCALES``), ``instances[r]`` instances on row r."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(n):
        xy = (torch.rand(2 + 2 * instances.get(r, 0), generator=g) * 30).tolist()
        out.append(Localization(box(xy[0], xy[1], 30, 24), 0.1 + r / 10, None, [
            Instance(box(xy[2 + 2 * k], xy[3 + 2 * k], 18, 27), 0.3 + k / 7) for k in range(instances.get(r, 0))]
            if r in instances else None))
    return out


def scales_for(n: int) -> Tensor:
    """Each image's (w / S, h / S): of several sizes, none the input's."""
    return torch.tensor([[1.5, 1.25], [0.75, 2.0]] + [[1.0 + r / 8, 0.5 + r / 9] for r in range(2, n)])[:n]


def on_input(results: list[Localization], scales: Tensor) -> Tensor:
    """Each row of ``answer_rows`` in input pixels, as the route's verdict reads them
    (``app.calibration._on_input``)."""
    boxes, _ = answer_rows(results)
    return boxes / torch.cat([scales, scales], dim=1)[:, None]


def test_answer_rows_are_each_answer_then_its_instances_padded_with_the_answer():
    results = [Localization((1.0, 2.0, 3.0, 4.0), 0.25, None, [Instance((5.0, 6.0, 7.0, 8.0), 0.5),
                                                               Instance((9.0, 9.5, 10.0, 11.0), 0.75)]),
               Localization((0.5, 0.0, 2.0, 2.0), 0.125),
               Localization((3.0, 3.0, 6.0, 6.0), 0.375, None, [Instance((1.0, 1.0, 2.0, 2.0), 1.5)]),
               Localization((2.0, 2.0, 4.0, 4.0), 0.0625, None, [])]
    boxes, scores = answer_rows(results)
    assert boxes.dtype == torch.float32 and scores.dtype == torch.float64
    assert boxes.tolist() == [[[1, 2, 3, 4], [5, 6, 7, 8], [9, 9.5, 10, 11]],
                              [[0.5, 0, 2, 2]] * 3,
                              [[3, 3, 6, 6], [1, 1, 2, 2], [3, 3, 6, 6]],
                              [[2, 2, 4, 4]] * 3]
    assert scores.tolist() == [[0.25, 0.5, 0.75], [0.125] * 3, [0.375, 1.5, 0.375], [0.0625] * 3]
    alone, alone_scores = answer_rows(results[1:2] + results[3:])
    assert alone.shape == (2, 1, 4) and alone_scores.tolist() == [[0.125], [0.0625]]


def per_call_ncc(t: Templates, batch: Tensor, results: list[Localization], scales: Tensor
                 ) -> tuple[Tensor, Tensor | None]:
    return t.ncc(batch, on_input(results, scales))


def check_padded(got: Tensor, want: Tensor) -> None:
    """``got`` (a batch's row width) is ``want`` (the call's own) padded with each row's answer."""
    w = want.shape[1]
    assert got.shape[0] == want.shape[0] and got.shape[1] >= w
    assert torch.allclose(got[:, :w], want, atol=1e-6), (got, want)
    assert torch.equal(got[:, w:], got[:, :1].expand(-1, got.shape[1] - w))


def test_read_ncc_reads_each_call_as_its_verdict_would_one_read_per_set_of_templates():
    counts = [2, 1, 2, 1, 1, 0, 1]
    n = sum(counts)
    batch, scales = images(n, 3), scales_for(n)
    results = results_for(n, {0: 2, 3: 1, 6: 1})
    t1, t2 = Counting(T1, "ncc"), Counting(T2, "ncc")
    other_look = SecondLook(Calibration(PlattFit(["log_score"], [0.0], [1.0], [1.0], 0.0)), 0.5, 2)
    calls = [call(t1), call(t2), call(t1, look=other_look), call(), call(t1, kind=("verifier", "check")),
             call(t1), call(t2)]
    starts = layout(counts)
    got = read_ncc(calls, starts, counts, batch, scales, results)  # type: ignore[arg-type]
    assert (t1.calls, t2.calls) == (1, 1)  # calls 0 and 2 (another second look) in one read; 1 and 6 in one
    for i in (0, 1, 2, 6):
        rows = list(range(starts[i], starts[i] + counts[i]))
        want = per_call_ncc(T1 if calls[i].templates is t1 else T2, batch[rows], [results[r] for r in rows],
                            scales[rows])
        check_padded(got[i][0], want[0])
        if want[1] is None:
            assert got[i][1] is None
        else:
            check_padded(got[i][1], want[1])
    assert got[3] is None and got[4] is None and got[5] is None  # no templates; a kind check's; no images
    # The answers' features known (the second look read them): the same features, only the instances read
    known = {i: (got[i][0][:, :1], None if got[i][1] is None else got[i][1][:, :1]) for i in (0, 2)}
    again = read_ncc(calls, starts, counts, batch, scales, results, known)  # type: ignore[arg-type]
    assert (t1.calls, t2.calls) == (2, 2) and t1.rows[-1] == (2, 2) and t2.rows[-1] == (2, 1)
    for i in (0, 1, 2, 6):
        for a, b in zip(again[i], got[i], strict=True):
            assert (a is None and b is None) or torch.allclose(a, b, atol=1e-6)
    # known, the most instances of a set one (rows of width 2): those read too
    one = results_for(n, {0: 1, 4: 1, 6: 1})
    first = read_ncc(calls, starts, counts, batch, scales, one)  # type: ignore[arg-type]
    known_one = {i: (first[i][0][:, :1], first[i][1][:, :1]) for i in (0, 2)}
    reads = t1.calls
    second = read_ncc(calls, starts, counts, batch, scales, one, known_one)  # type: ignore[arg-type]
    assert t1.calls == reads + 1 and t1.rows[-1] == (2, 1) and first[0][0].shape[1] == 2
    for i in (0, 2):
        assert torch.allclose(second[i][0], first[i][0], atol=1e-6)
        assert torch.allclose(second[i][1], first[i][1], atol=1e-6)
    # every call of a set known, none with instances: nothing read
    plain = results_for(n, {})
    before = read_ncc(calls, starts, counts, batch, scales, plain)  # type: ignore[arg-type]
    calls_before = t1.calls
    none_read = read_ncc(calls, starts, counts, batch, scales, plain,  # type: ignore[arg-type]
                         {0: before[0], 2: before[2]})
    assert t1.calls == calls_before and torch.equal(none_read[0][0], before[0][0])
    assert none_read[2][1] is not None and torch.equal(none_read[2][1], before[2][1])


def verifier(seed: int) -> KindVerifier:
    torch.manual_seed(seed)
    v = KindVerifier(1, ["0", "1", "background"]).eval()
    v.sha256 = f"v{seed}"
    return v


def check_of(v: KindVerifier, seed: int) -> KindCheck:
    g = torch.Generator().manual_seed(seed)
    d = v.kinds.shape[1]
    rows = F.normalize(torch.randn(3, d, generator=g), dim=-1).tolist()
    return KindCheck(rows[0], rows[1:], "0", 0.9, v.sha256 or "", temperature=20.0)


V1, V2 = verifier(1), verifier(2)
K1, K1b, K2 = check_of(V1, 1), check_of(V1, 2), check_of(V2, 3)


def test_read_kinds_reads_each_calls_check_as_its_verdict_would_one_pass_per_verifier():
    counts = [2, 1, 1, 0, 2]
    n = sum(counts)
    batch, scales = images(n, 4), scales_for(n)
    results = results_for(n, {0: 1, 2: 2, 5: 1}, seed=1)
    v1, v2 = Counting(V1, "embed_boxes"), Counting(V2, "embed_boxes")
    calls = [call(T1, kind=(v1, K1)), call(T1), call(T2, kind=(v2, K2)), call(T1, kind=(v1, K1)),
             call(T2, kind=(v1, K1b))]
    starts = layout(counts)
    got = read_kinds(calls, starts, counts, batch, scales, results)  # type: ignore[arg-type]
    assert (v1.calls, v2.calls) == (1, 1)  # calls 0 and 4 (two checks of one verifier) in one pass
    for i in (0, 2, 4):
        rows = list(range(starts[i], starts[i] + counts[i]))
        v, check = calls[i].kind[0].inner, calls[i].kind[1]
        with torch.no_grad():
            want = check.probability(v.embed_boxes(batch[rows], on_input([results[r] for r in rows], scales[rows])))
        check_padded(got[i], want)
        assert got[i].dtype == torch.float64
    assert got[1] is None and got[3] is None
    # the answers' probabilities known: the same, only the instances read (rows 0 and 5 of verifier 1's calls)
    known = {0: got[0][:, :1], 4: got[4][:, :1]}
    again = read_kinds(calls, starts, counts, batch, scales, results, known)  # type: ignore[arg-type]
    assert (v1.calls, v2.calls) == (2, 2) and v1.rows[-1] == (2, 1) and v2.rows[-1] == (1, 1)
    for i in (0, 2, 4):
        assert torch.allclose(again[i], got[i], atol=1e-6)
    # known, and no instance anywhere: no pass at all
    plain = results_for(n, {}, seed=1)
    before = read_kinds(calls, starts, counts, batch, scales, plain)  # type: ignore[arg-type]
    passes = v1.calls
    after = read_kinds(calls, starts, counts, batch, scales, plain, {0: before[0], 4: before[4]})  # type: ignore[arg-type]
    assert v1.calls == passes and torch.equal(after[0], before[0]) and torch.equal(after[4], before[4])


NCC_FIT = PlattFit(["log_score", "ncc"], [-1.0, 0.2], [0.5, 0.2], [-1.0, 3.0], 0.1)
NCC_NEG_FIT = PlattFit(["log_score", "ncc", "ncc_negatives"], [-1.0, 0.2, 0.2], [0.5, 0.2, 0.2], [-1.0, 3.0, -2.0],
                       0.1)
SCORE_FIT = PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0)
CAL_A = Calibration(SCORE_FIT, ncc=NCC_FIT, ncc_negatives=NCC_NEG_FIT)
CAL_B = Calibration(SCORE_FIT, ncc=PlattFit(["log_score", "ncc"], [-1.0, 0.2], [0.5, 0.2], [1.0, 2.0], -0.2))


def test_the_second_look_doubts_each_answer_by_its_own_calls_rule_and_keeps_what_it_read():
    """Each answer is doubtful where its call's calibration gives its NCC features (read alone) a confidence under
    the call's bar (strictly: one at the bar is not), and, for a call with a kind check, its check's probability
    is under the bar too; one read per set of templates and calibration; the answers read are kept for
    ``read_ncc`` / ``read_kinds``."""
    counts = [3, 2, 3, 2, 3, 1, 0, 2]
    n = sum(counts)
    batch = images(n, 5)
    g = torch.Generator().manual_seed(7)
    xy = torch.rand(n, 2, generator=g) * 30
    boxes = torch.cat([xy, xy + torch.tensor([16.0, 14.0])], dim=1)
    distances = torch.rand(n, generator=g) * 0.5 + 0.1
    t1, t2 = Counting(T1, "ncc"), Counting(T2, "ncc")
    v1 = Counting(V1, "embed_boxes")
    starts = layout(counts)
    # each call's templates and calibration (call 4: with a kind check, call 5: no second look, call 6: no images)
    plan = [(T1, CAL_A), (T2, CAL_A), (T1, CAL_A), (T1, CAL_B), (T1, CAL_A), (T1, None), (T1, CAL_A), (T1, CAL_A)]
    owner = [i for i, k in enumerate(counts) for _ in range(k)]
    alone = [plan[owner[r]][0].ncc(batch[r:r + 1], boxes[r][None, None]) for r in range(n)]  # each box read alone
    c = {r: float(plan[owner[r]][1].confidence(
        distances[r:r + 1].double(), ncc=alone[r][0][:, 0], ncc_negatives=None if alone[r][1] is None
        else alone[r][1][:, 0])[0]) for r in range(n) if plan[owner[r]][1] is not None}
    with torch.no_grad():  # the kind call's rows (10-12) as the engine reads them: one pass, so a bar is exact
        kind_p = [0.0] * 10 + K1.probability(V1.embed_boxes(batch[10:13], boxes[10:13][:, None]))[:, 0].tolist()
    looks = [SecondLook(CAL_A, sorted(c[r] for r in range(3))[1], 2),  # one row at the bar exactly: not doubtful
             SecondLook(CAL_A, max(c[3], c[4]) + 1e-9, 2),  # both doubtful
             SecondLook(CAL_A, min(c[r] for r in (5, 6, 7)) - 1e-9, 2, template_bar=0.3),  # none
             SecondLook(CAL_B, 1.0, 2),  # every one; T1 with another calibration: another read
             SecondLook(CAL_A, sorted(kind_p[10:13])[1], 2),  # the kind check's bar at its middle row
             None, SecondLook(CAL_A, 0.9, 2), SecondLook(CAL_A, 1.0, 2)]
    t = {id(T1): t1, id(T2): t2}
    calls = [call(t[id(tt)], kind=(v1, K1) if i == 4 else None, look=looks[i]) for i, (tt, _) in enumerate(plan)]
    answer_ncc: dict = {}
    answer_kind: dict = {}
    pick = doubtful_answers(calls, starts, counts, batch, boxes, distances, answer_ncc, answer_kind)  # type: ignore[arg-type]
    want = []
    for r in range(n):
        look = calls[owner[r]].second_look
        doubt = look is not None and c[r] < look.below
        if calls[owner[r]].kind is not None:
            doubt = doubt and kind_p[r] < look.below
        want.append(doubt)
    assert pick.tolist() == want
    assert pick[0:3].sum() == 1 and pick[3:5].all() and not pick[5:8].any() and pick[8:10].all()
    assert not pick[13] and pick[14:16].all()
    # reads: T1 with CAL_A (calls 0, 2, 7 and the kind call's doubted rows), T1 with CAL_B, T2 with CAL_A
    assert (t1.calls, t2.calls, v1.calls) == (2, 1, 1)
    assert sorted(answer_ncc) == [0, 1, 2, 3, 7] and sorted(answer_kind) == [4]
    for i in answer_ncc:
        rows = range(starts[i], starts[i] + counts[i])
        pos = torch.cat([alone[r][0] for r in rows])
        assert torch.allclose(answer_ncc[i][0], pos, atol=1e-6)
        assert (answer_ncc[i][1] is None) == (calls[i].templates is t2)
    assert answer_kind[4][:, 0].tolist() == kind_p[10:13]
    # a kind call's NCC is read only where the check doubts: 1 row of its 3 (the kind bar at the middle one)
    assert sorted(r[0] for r in t1.rows) == [2, 3 + 3 + 2 + 1]


def test_the_second_look_takes_nothing_where_no_call_looks():
    counts = [2, 1]
    batch, boxes = images(3), torch.tensor([[1.0, 1.0, 20.0, 20.0]] * 3)
    t1 = Counting(T1, "ncc")
    answer_ncc: dict = {}
    pick = doubtful_answers([call(t1), call()], [0, 2], counts, batch, boxes, torch.ones(3), answer_ncc, {})  # type: ignore[arg-type]
    assert pick.dtype == torch.bool and pick.tolist() == [False] * 3 and t1.calls == 0 and answer_ncc == {}


def test_template_windows_match_each_picked_image_of_the_calls_that_ask_once_per_set():
    counts = [2, 2, 1, 2]
    n = sum(counts)
    batch, scales = images(n, 6), scales_for(n)
    t1, t2 = Counting(T1, "match"), Counting(T2, "match")
    with_bar = SecondLook(CAL_A, 0.5, 2, template_bar=0.4)
    calls = [call(t1, look=with_bar), call(t2, look=with_bar), call(t1, look=SecondLook(CAL_A, 0.5, 2)),
             call(t1, look=with_bar)]
    picked = torch.tensor([1, 2, 3, 4, 6])  # rows of calls 0, 1, 1, 2 (no bar) and 3
    out = template_windows(calls, counts, batch, scales, picked)  # type: ignore[arg-type]
    assert out.shape == (5, 4) and (t1.calls, t2.calls) == (1, 1) and (t1.rows, t2.rows) == ([(2, 2)], [(2, 2)])
    for k, r in enumerate(picked.tolist()):
        if r == 4:
            assert out[k].isnan().all()
            continue
        t = T2 if r in (2, 3) else T1
        want = t.match(batch[r:r + 1], scales[r:r + 1])[0]
        assert not want.isnan().any() and torch.allclose(out[k], want, atol=1e-5), (r, out[k], want)
    assert template_windows(calls, counts, batch, scales, torch.tensor([4])).isnan().all()
    assert (t1.calls, t2.calls) == (1, 1)  # nothing picked of a call that asks: no match
    no_templates = [call(None, look=with_bar)]
    assert template_windows(no_templates, [1], batch[:1], scales[:1], torch.tensor([0])).isnan().all()


@pytest.mark.parametrize("fit", [False, True])
def test_calls_are_grouped_by_templates_and_with_fit_by_calibration_too(fit):
    look_a, look_b = SecondLook(CAL_A, 0.5, 2), SecondLook(CAL_B, 0.5, 2)
    calls = [call(T1, look=look_a), call(T2, look=look_a), call(T1, look=look_b), call(T1), call(T1, look=look_a),
             call(T2)]
    groups = engine_ncc._by_templates(calls, [0, 1, 2, 3, 4, 5], fit=fit)  # type: ignore[arg-type]
    # with fit, a call with no second look is with the others of its templates that have none
    assert groups == ([[0, 4], [1], [2], [3], [5]] if fit else [[0, 2, 3, 4], [1, 5]])
    assert engine_ncc._by_templates(calls, [0, 2], fit=False) == [[0, 2]]
    assert engine_ncc._by_templates(calls, [0, 2]) == [[0, 2]]  # not by calibration unless asked
    assert engine_ncc._by_verifier([call(kind=(V1, K1)), call(kind=(V2, K2)), call(kind=(V1, K1b))], [0, 1, 2]) \
        == [[0, 2], [1]]
    assert engine_ncc._by_verifier([call(kind=(V1, K1)), call(kind=(V1, K1b))], [1]) == [[1]]
