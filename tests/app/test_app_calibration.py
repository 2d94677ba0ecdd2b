"""Calibrated confidence, ``found``, ``threshold`` / ``min_confidence`` and negative exemplars on the API."""

import math
import re
import uuid

import pytest
import torch
from PIL import Image
from service_fixtures import files, make_test_settings, migrate, png_bytes, row_counts
from sqlalchemy import create_engine, select, update
from sqlalchemy.orm import Session

from app.calibration import SECOND_LOOK_FOUND, judge
from app.lru import LoadingLRU
from app.tables import Checkpoint, ExemplarSet
from models.calibration import Calibration
from models.core.platt import PlattFit
from models.core.templates import Templates
from models.inference import Instance, Localization


def new_set(client, negatives=(), **data):
    r = client.post("/v1/exemplar-sets", data=data,
                    files=files(png_bytes(28, 28, seed=9)) + files(*negatives, field="negative_files"))
    assert r.status_code == 201, r.text
    return r.json()


def localize(client, sid, query="", n=3):
    r = client.post(f"/v1/exemplar-sets/{sid}/localize{query}", files=files(*[png_bytes(seed=i) for i in range(n)]))
    assert r.status_code == 200, r.text
    return r.json()["results"]


def fixed(bias: float) -> dict:
    """A calibration that answers sigmoid(bias) whatever the score."""
    return Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], bias)).to_dict()


def test_patch_changes_the_threshold_and_name_and_refuses_bad_changes_writing_nothing(client, settings):
    """PATCH a set's threshold: the next answers are `found` by it (same boxes, same confidences, no new calibration);
    its name too. Every bad change is a 422 naming what to fix, and the set is left as it was."""
    es = new_set(client, name="cats")
    with Session(create_engine(settings.database_url)) as s:  # a known calibration: confidence 0.5 everywhere
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(es["id"])).values(calibration=fixed(0.0)))
        s.commit()
    url = f"/v1/exemplar-sets/{es['id']}"
    before = localize(client, es["id"])
    assert all(r["found"] for r in before)
    r = client.patch(url, json={"threshold": 0.6})
    assert r.status_code == 200 and r.json()["threshold"] == 0.6 and r.json()["name"] == "cats", r.text
    after = localize(client, es["id"])
    assert [r["box"] for r in after] == [r["box"] for r in before] and not any(r["found"] for r in after)
    assert [r["confidence"] for r in after] == [r["confidence"] for r in before]
    assert client.get(url).json()["threshold"] == 0.6
    r = client.patch(url, json={"name": "tabby cats"})
    assert r.status_code == 200 and r.json()["name"] == "tabby cats" and r.json()["threshold"] == 0.6
    assert client.patch(url, json={"name": None}).json()["name"] is None
    for body, says in (({}, "nothing to change"), ({"threshold": 1.5}, "threshold"), ({"threshold": -0.1}, "threshold"),
                       ({"threshold": None}, "threshold"), ({"threshold": "high"}, "threshold"),
                       ({"threshold": True}, "threshold"), ({"threshold": "0.4"}, "threshold"),
                       ({"name": ""}, "name"), ({"name": "   "}, "name"),
                       ({"name": "x" * 201}, "name"), ({"name": "a\x00b"}, "NUL"),
                       ({"threshold": 0.2, "calibration": {}}, "calibration"), ([0.2], "")):
        r = client.patch(url, json=body)
        assert r.status_code == 422 and says in r.text, (body, r.text)
    for raw, says in ((b'{"threshold": NaN}', "threshold"), (b'{"threshold": Infinity}', "threshold"),
                      (b"not json", "JSON"), (b'{"name": "a\\ud800"}', "unicode")):  # JSON's escape of no text
        r = client.patch(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 422 and says in r.text, (raw, r.text)
    for ctype, raw in (("application/x-www-form-urlencoded", b"threshold=0.2"), ("text/plain", b'{"threshold": 0.2}')):
        r = client.patch(url, content=raw, headers={"content-type": ctype})
        assert r.status_code == 415 and "takes a JSON body" in r.text, (ctype, r.text)
    got = client.get(url).json()
    assert got["threshold"] == 0.6 and got["name"] is None  # nothing of the refused changes written
    assert client.patch(url, json={"threshold": 1}).json()["threshold"] == 1.0  # a JSON integer is a number
    assert client.patch(url, json={"name": " padded "}).json()["name"] == "padded"  # trimmed, as at creation
    r = client.patch(url, json={"name": "   "})
    assert "name is empty (only spaces): give it some text, or null to clear it" in r.text, r.text
    zero = client.patch(url, json={"threshold": -0.0}).json()["threshold"]
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0  # -0 is 0
    assert math.copysign(1.0, new_set(client, threshold="-0")["threshold"]) == 1.0
    assert client.app.openapi()["components"]["schemas"]["ExemplarSetChange"]["minProperties"] == 1
    assert client.patch(f"/v1/exemplar-sets/{uuid.uuid4()}", json={"threshold": 0.3}).status_code == 404


def test_a_new_set_is_calibrated_and_answers_carry_confidence_and_found(client, settings):
    es = new_set(client, threshold="0.3")
    assert es["calibrated"] and es["threshold"] == 0.3 and es["num_negatives"] == 0
    with Session(create_engine(settings.database_url)) as s:
        cal = s.get_one(ExemplarSet, uuid.UUID(es["id"])).calibration
    assert cal["score"]["features"] == ["log_score"] and cal["negatives"] is None
    assert cal["stats"]["positives"] >= 128 and cal["stats"]["negatives"] == 128
    for r in localize(client, es["id"]):
        assert 0.0 <= r["confidence"] <= 1.0 and r["found"] == (r["confidence"] >= 0.3)
        assert len(r["box"]) == 4 and r["score"] > 0


def test_calibration_samples_sets_what_a_new_set_is_fit_on(tmp_path, bundle_dir):
    from fastapi.testclient import TestClient

    from app.main import create_app

    s = make_test_settings(tmp_path, bundle_dir, calibration_samples=16)
    migrate(s.database_url)
    with TestClient(create_app(s)) as c:
        es = new_set(c)
        with Session(create_engine(s.database_url)) as db:
            cal = db.get_one(ExemplarSet, uuid.UUID(es["id"])).calibration
        assert cal["stats"]["positives"] == 16 and cal["stats"]["negatives"] == 16
        assert all(0.0 <= r["confidence"] <= 1.0 for r in localize(c, es["id"]))


def test_threshold_and_min_confidence_decide_found_and_keep_the_box(client, settings):
    es = new_set(client)
    with Session(create_engine(settings.database_url)) as s:  # a known calibration: confidence 0.5 everywhere
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(es["id"])).values(calibration=fixed(0.0)))
        s.commit()
    base = localize(client, es["id"])
    assert all(r["confidence"] == pytest.approx(0.5) and r["found"] for r in base)  # 0.5 >= the default 0.5
    raised = localize(client, es["id"], "?min_confidence=0.6")
    assert all(not r["found"] for r in raised)
    assert [r["box"] for r in raised] == [r["box"] for r in base]
    assert all(r["found"] for r in localize(client, es["id"], "?min_confidence=0.1"))
    client.patch(f"/v1/exemplar-sets/{es['id']}", json={"threshold": 0.6})
    assert not any(r["found"] for r in localize(client, es["id"]))
    lowered = localize(client, es["id"], "?min_confidence=0.4")  # the request's bar: lower than the set's too
    assert all(r["found"] for r in lowered) and [r["box"] for r in lowered] == [r["box"] for r in base]
    r = client.post(f"/v1/exemplar-sets/{es['id']}/localize?min_confidence=1.5", files=files(png_bytes()))
    assert r.status_code == 422
    for bad in ("nan", "inf"):
        r = client.post(f"/v1/exemplar-sets/{es['id']}/localize?min_confidence={bad}", files=files(png_bytes()))
        assert r.status_code == 422 and "finite number" in r.text, r.text


def test_a_set_without_calibration_answers_as_before(client, settings):
    es = new_set(client)
    with Session(create_engine(settings.database_url)) as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(es["id"])).values(calibration=None))
        s.commit()
    assert client.get(f"/v1/exemplar-sets/{es['id']}").json()["calibrated"] is False
    for r in localize(client, es["id"], "?min_confidence=0.9"):
        assert "confidence" not in r and r["found"] is True


def test_the_served_checkpoints_calibration_wins_over_the_sets(client, settings):
    es = new_set(client)
    sid = uuid.UUID(es["id"])
    with Session(create_engine(settings.database_url)) as s:
        base_id = s.scalars(select(Checkpoint.id).where(Checkpoint.exemplar_set_id == sid)).one()
        s.execute(update(ExemplarSet).where(ExemplarSet.id == sid).values(calibration=fixed(-4.0)))
        s.execute(update(Checkpoint).where(Checkpoint.id == base_id).values(calibration=fixed(4.0)))
        s.commit()
    assert all(r["confidence"] > 0.98 for r in localize(client, es["id"]))
    with Session(create_engine(settings.database_url)) as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == base_id).values(calibration=None))
        s.commit()
    assert all(r["confidence"] < 0.02 and not r["found"] for r in localize(client, es["id"]))


def test_negative_exemplars_are_stored_and_enter_the_confidence(client, settings):
    neg = png_bytes(28, 28, seed=9)  # the exemplar itself as a "look-alike": every box near it is suspect
    es = new_set(client, negatives=[neg, png_bytes(30, 20, seed=4)])
    assert es["num_negatives"] == 2 and es["calibrated"]
    with Session(create_engine(settings.database_url)) as s:
        row = s.get_one(ExemplarSet, uuid.UUID(es["id"]))
        assert len(row.negatives) == 2 * row.prototype_dim * 4
        assert row.calibration["negatives"]["features"] == ["log_score", "log_ratio"]
    plain = new_set(client)
    # A known calibration: the score fit says 0.5 whatever the box; the negatives' fit says d_n / (d_p + d_n)
    ratio = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0),
                        PlattFit(["log_score", "log_ratio"], [0.0, 0.0], [1.0, 1.0], [0.0, -1.0], 0.0)).to_dict()
    with Session(create_engine(settings.database_url)) as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id.in_([uuid.UUID(es["id"]), uuid.UUID(plain["id"])]))
                  .values(calibration=ratio))
        s.commit()
    with_neg, without = localize(client, es["id"]), localize(client, plain["id"])
    assert [r["box"] for r in with_neg] == [r["box"] for r in without]  # same agent, same boxes
    assert all(r["confidence"] == pytest.approx(0.5) for r in without)  # no negatives: the score fit
    assert all(abs(r["confidence"] - 0.5) > 1e-4 for r in with_neg)  # the look-alikes' distance counts


@pytest.mark.parametrize("crops", [1, 3])
def test_rerank_answers_with_the_likeliest_candidate(client, settings, crops):
    """``rerank=true``: the answer is the candidate (several-instances search) of highest confidence; the
    candidates are not returned unless asked for. 3 crops: the grayscale test bundle's NCC fits judge them."""
    r = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=9 + k) for k in range(crops)])
                    + files(png_bytes(28, 28, seed=4), field="negative_files"))
    assert r.status_code == 201, r.text
    es = r.json()
    with Session(create_engine(settings.database_url)) as s:
        cal = s.get_one(ExemplarSet, uuid.UUID(es["id"])).calibration
    assert (cal.get("ncc") is not None) == (crops >= 2)
    reranked = localize(client, es["id"], "?rerank=true")
    candidates = localize(client, es["id"], "?max_instances=4")
    for r, c in zip(reranked, candidates, strict=True):
        assert "instances" not in r
        best = max(c["instances"], key=lambda i: i["confidence"])
        assert r["box"] == pytest.approx(best["box"]) and r["confidence"] == pytest.approx(best["confidence"])
        assert r["confidence"] >= c["confidence"] - 1e-6  # never a less likely answer than the agent's
    both = localize(client, es["id"], "?rerank=true&max_instances=2")
    assert all(len(r["instances"]) <= 2 for r in both)


def ncc_fitted_set(client, settings, crops: int, centre: float, slope: float) -> str:
    """A set of ``crops`` crops whose NCC fit is ``sigmoid(slope * (ncc - centre))`` (3 crops: the grayscale test
    bundle fits NCC; 1 crop: it keeps the score's fit, left as it is)."""
    r = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=9 + k) for k in range(crops)]))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    with Session(create_engine(settings.database_url)) as s:
        row = s.get_one(ExemplarSet, uuid.UUID(sid))
        cal = dict(row.calibration)
        assert (cal.get("ncc") is not None) == (crops > 1)
        if crops > 1:
            cal["ncc"] = {"features": ["log_score", "ncc"], "mean": [0.0, centre], "std": [1.0, 1.0],
                          "weights": [0.0, slope], "bias": 0.0}
            row.calibration = cal
        s.commit()
    return sid


@pytest.mark.parametrize("crops", [1, 3])
def test_rerank_auto_takes_a_second_look_only_at_doubtful_answers(client, settings, crops):
    """``rerank=auto`` (the default's second look without template matching's window), on a set whose confidence
    is the NCC fit (3 crops, the grayscale test bundle): an answer below half the set's threshold is replaced by the
    likeliest candidate when that one reaches the threshold (and says so: ``reranked``); every other answer is the
    agent's own (``rerank=false``), whatever ``min_confidence``. A set whose confidence is not the NCC fit (1 crop:
    the score's) keeps the agent's answers."""
    n = 8

    def answers(sid: str) -> tuple[list, list, list]:
        agent = localize(client, sid, "?rerank=false", n=n)
        candidates = localize(client, sid, "?rerank=false&max_instances=4", n=n)
        return agent, candidates, [max(c["instances"], key=lambda i: i["confidence"]) for c in candidates]

    # First the NCC of each answer and best candidate (a known fit, inverted); then a fit for the same crops (the
    # same agent) under which the answer farthest below its best candidate is doubtful and that candidate found
    agent, _, bests = answers(ncc_fitted_set(client, settings, crops, 0.17, 60.0))
    ncc = [[0.17 + math.log(p / (1 - p)) / 60.0 for p in (a["confidence"], b["confidence"])]
           for a, b in zip(agent, bests, strict=True)]
    low, high = max(ncc, key=lambda v: v[1] - v[0])
    sid = ncc_fitted_set(client, settings, crops, high - 1e-4, 2.2 / max(high - low, 1e-3))
    agent, candidates, bests = answers(sid)
    cut = 0.5  # the set's threshold (the default)

    def looks() -> dict[str, float]:
        text = client.get("/metrics").text
        return {o: float(m.group(1)) if (m := re.search(rf'qloc_localize_second_looks_total{{outcome="{o}"}} (\S+)',
                                                          text)) else 0.0 for o in ("reranked", "kept")}

    engine = client.app.state.inference.batcher.stats
    before, calls = looks(), engine.items
    auto = localize(client, sid, "?rerank=auto", n=n)
    after = looks()
    assert engine.items - calls == 1  # the engine took the second look in the same forward pass
    explicit = localize(client, sid, "?rerank=auto&min_confidence=0.99", n=n)
    with_instances = localize(client, sid, "?rerank=auto&max_instances=4", n=n)  # the candidates at hand: no 2nd call
    calls = engine.items
    two = localize(client, sid, "?rerank=auto&max_instances=2", n=n)  # the route's second call, the doubtful only
    doubtful = sum(a["confidence"] < cut / 2 for a in agent) if crops > 1 else 0
    assert engine.items - calls == 1 + (doubtful > 0)
    switched = kept = 0
    for a, c, best, r, e, w, t in zip(agent, candidates, bests, auto, explicit, with_instances, two, strict=True):
        assert "instances" not in r and c["box"] == pytest.approx(a["box"])
        if crops > 1 and a["confidence"] < cut / 2 and best["confidence"] >= cut:
            switched += 1
            assert r["box"] == pytest.approx(best["box"]) and r["confidence"] == pytest.approx(best["confidence"])
            # a second look's answer is found from SECOND_LOOK_FOUND (the best of several reaches 0.5 by chance)
            assert r["reranked"] is True and r["found"] == (best["confidence"] >= SECOND_LOOK_FOUND)
        else:
            kept += 1
            assert r["box"] == pytest.approx(a["box"]) and r["confidence"] == pytest.approx(a["confidence"])
            assert "reranked" not in r
        assert e["box"] == pytest.approx(r["box"])  # min_confidence decides found, not the box
        assert w["box"] == pytest.approx(r["box"]) and len(w["instances"]) == len(c["instances"])
        assert t["box"] == pytest.approx(r["box"]) and 1 <= len(t["instances"]) <= min(2, len(c["instances"]))
        assert [v for i in t["instances"] for v in i["box"]] == pytest.approx(  # the same search, cut at 2 (those of
            [v for i in c["instances"][:len(t["instances"])] for v in i["box"]])  # them apart: models.instances)
    assert (switched > 0) == (crops > 1) and kept > 0
    assert after["reranked"] - before["reranked"] == switched
    assert after["kept"] - before["kept"] == doubtful - switched
    for threshold in (0.1, 0.9):  # the set's threshold decides found, not which box answers
        assert client.patch(f"/v1/exemplar-sets/{sid}", json={"threshold": threshold}).status_code == 200
        moved = localize(client, sid, "?rerank=auto", n=n)
        assert [v for m in moved for v in m["box"]] == pytest.approx([v for r in auto for v in r["box"]])
        for m, r in zip(moved, auto, strict=True):
            bar = max(threshold, SECOND_LOOK_FOUND) if r.get("reranked") else threshold
            assert m["confidence"] == pytest.approx(r["confidence"]) and m["found"] == (m["confidence"] >= bar), m
    r = client.post(f"/v1/exemplar-sets/{sid}/localize?rerank=maybe", files=files(png_bytes()))
    assert r.status_code == 422 and "rerank" in r.text


@pytest.mark.parametrize(("rerank", "answer", "best", "switched"), [
    ("auto", 0.20, 0.60, True),  # doubtful (below half the threshold 0.5) and a candidate reaching it
    ("auto", 0.30, 0.90, False),  # below the threshold but not doubtful: the agent's answer stays
    ("auto", 0.20, 0.45, False),  # doubtful, but no candidate reaches the threshold
    ("auto", 0.60, 0.95, False),  # found
    ("true", 0.60, 0.95, True),  # always the likeliest
    ("false", 0.01, 0.99, False),  # never
])
def test_judge_reranks_by_the_rule_asked_for(rerank, answer, best, switched):
    """``judge``'s rule, on known confidences: an NCC fit that is the identity on the logit of the features
    given (``ncc=``, as the engine passes them), the threshold 0.5."""
    logit = [math.log(p / (1 - p)) for p in (answer, 0.1, best)]
    templates = Templates(torch.zeros(1, 16, 16, dtype=torch.uint8), None, 84, 1, (0.0,))
    cal = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0), None, 0.5, {},
                      PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], 0.0), None,
                      templates).to_dict()
    boxes = [(0.0, 0.0, 10.0, 10.0), (20.0, 20.0, 30.0, 30.0), (40.0, 40.0, 50.0, 50.0)]
    result = Localization(boxes[0], 1.0, instances=[Instance(b, 1.0) for b in boxes])
    ncc = (torch.tensor([logit[:1] + logit], dtype=torch.float64), None)  # the answer, then its 3 instances
    [j] = judge([result], [Image.new("L", (84, 84))], cal, threshold=0.5, min_confidence=0.99, loaded=None,
                prototype=b"", negatives=None, rerank=rerank, ncc=ncc)
    assert j.box == (boxes[2] if switched else boxes[0]) and j.reranked == switched
    assert j.confidence == pytest.approx(best if switched else answer) and not j.found  # min_confidence 0.99
    [j] = judge([result], [Image.new("L", (84, 84))], cal, threshold=0.5, min_confidence=None, loaded=None,
                prototype=b"", negatives=None, rerank=rerank, ncc=ncc)
    # a candidate auto took is found from SECOND_LOOK_FOUND; rerank=true's from the threshold, as any answer
    bar = SECOND_LOOK_FOUND if switched and rerank == "auto" else 0.5
    assert j.found == (j.confidence >= bar)
    if switched and rerank == "auto":
        [j] = judge([result], [Image.new("L", (84, 84))], cal, threshold=0.5, min_confidence=None, loaded=None,
                    prototype=b"", negatives=None, rerank=rerank,
                    ncc=(torch.tensor([logit[:1] + logit[:2] + [math.log(0.85 / 0.15)]], dtype=torch.float64), None))
        assert j.reranked and j.found  # 0.85 >= SECOND_LOOK_FOUND

    # auto looks among the first 4 candidates only: a fifth (max_instances > 4) leaves the answer as it was
    many = Localization(boxes[0], 1.0, instances=[Instance((float(k), 0.0, k + 5.0, 5.0), 1.0) for k in range(5)])
    ncc = (torch.tensor([[logit[0], logit[0], logit[1], logit[1], logit[1], logit[2]]], dtype=torch.float64), None)
    [j] = judge([many], [Image.new("L", (84, 84))], cal, threshold=0.5, min_confidence=None, loaded=None,
                prototype=b"", negatives=None, rerank=rerank, ncc=ncc)
    assert j.reranked == (switched and rerank == "true") and len(j.instances) == 5


def test_bad_negative_files_and_thresholds_are_refused_with_nothing_written(client, settings):
    before = row_counts(settings.database_url)
    r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)) + [("negative_files", ("x.png", b"nope",
                                                                                               "image/png"))])
    assert 400 <= r.status_code < 500 and "detail" in r.json()
    for bad in ("1.5", "-0.1", "half"):
        r = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28)), data={"threshold": bad})
        assert r.status_code == 422, bad
    assert row_counts(settings.database_url) == before


def test_a_stored_calibration_is_decoded_once_per_row(monkeypatch):
    from app import calibration as appcal

    calls = []
    real = Calibration.from_dict
    monkeypatch.setattr(Calibration, "from_dict", classmethod(lambda cls, d: calls.append(d) or real(d)))
    monkeypatch.setattr(appcal, "_DECODED", LoadingLRU(appcal.DECODED_CACHE_SIZE))
    d = fixed(1.0)
    key = ("set", uuid.uuid4())
    first = appcal.decoded(d, key)
    assert appcal.decoded(d, key) is first and len(calls) == 1  # the same row: decoded once
    assert appcal.decoded(d, ("checkpoint", key[1])) is not first and len(calls) == 2  # another row
    assert appcal.decoded(d, None) is not appcal.decoded(d, None) and len(calls) == 4  # no key: never kept
    appcal._DECODED.size = 2
    for k in range(3):
        appcal.decoded(d, ("set", k))
    assert len(appcal._DECODED) == 2 and key not in appcal._DECODED  # bounded: the oldest goes


def test_rerank_templates_adds_template_matchings_window_to_the_second_look(client, settings):
    """``rerank=templates``: ``auto``'s second look with one more candidate, the window template matching finds with
    the set's crops (kept at their uploaded size in the calibration), taken only if its confidence reaches
    ``TEMPLATE_BAR``. The answers equal that rule computed here from the same server's answers, candidates and the
    window's NCC. ``max_instances=2`` (the route's second call, as with ``QLOC_INFERENCE=workers`` or a GPU: the
    route matches the templates and the call carries the windows, ``LocalizeCall.extra_boxes``) and
    ``max_instances=4`` (every image's candidates at once) answer the same, the window never listed."""
    import io

    import numpy as np

    from app.calibration import TEMPLATE_BAR

    n = 8
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(io.BytesIO(png_bytes(seed=i))).convert("L"),
                                                      dtype=np.float32) / 255)[None] for i in range(n)])

    def state(sid: str) -> tuple[list, list, Templates]:
        agent = localize(client, sid, "?rerank=false", n=n)
        candidates = localize(client, sid, "?rerank=false&max_instances=4", n=n)
        with Session(create_engine(settings.database_url)) as s:
            t = Templates.from_dict(s.get_one(ExemplarSet, uuid.UUID(sid)).calibration["templates"])
        return agent, candidates, t

    def logit_inverse(p: float, centre: float, slope: float) -> float:
        return centre + math.log(p / (1 - p)) / slope

    agent, candidates, t = state(ncc_fitted_set(client, settings, 3, 0.17, 60.0))
    assert t.crops is not None and [tuple(c.shape) for c in t.crops] == [(1, 28, 28)] * 3
    windows = t.match(images, torch.ones(n, 2))
    assert not windows.isnan().any()
    window_ncc = t.ncc(images, windows[:, None])[0][:, 0].tolist()
    best_ncc = [max([logit_inverse(a["confidence"], 0.17, 60.0)]
                    + [logit_inverse(i["confidence"], 0.17, 60.0) for i in c["instances"]])
                for a, c in zip(agent, candidates, strict=True)]
    # a fit under which one image's window is likely (>= 0.9), and its answer and candidates not (< 0.1)
    k = max(range(n), key=lambda i: window_ncc[i] - best_ncc[i])
    hi, lo = window_ncc[k], best_ncc[k]
    assert hi > lo + 1e-3
    centre, slope = (hi + lo) / 2, 2 * 2.3 / (hi - lo)
    sid = ncc_fitted_set(client, settings, 3, centre, slope)
    agent, candidates, _ = state(sid)
    chosen = localize(client, sid, "?rerank=templates", n=n)
    auto = localize(client, sid, "?rerank=auto", n=n)
    assert localize(client, sid, n=n) == chosen  # the default
    two = localize(client, sid, "?rerank=templates&max_instances=2", n=n)
    four = localize(client, sid, "?rerank=templates&max_instances=4", n=n)
    switched = 0
    for i, (a, c, r, w, f) in enumerate(zip(agent, candidates, chosen, two, four, strict=True)):
        window = 1 / (1 + math.exp(-slope * (window_ncc[i] - centre)))
        pool = [(x["confidence"], x["box"]) for x in c["instances"][:4]]
        pool += [(window, windows[i].tolist())] if window >= TEMPLATE_BAR else []
        best = max(pool, key=lambda p: p[0], default=None)
        if a["confidence"] < 0.25 and best is not None and best[0] >= 0.5:
            assert r["box"] == pytest.approx(best[1], abs=1e-3) and r["reranked"] is True
            switched += best[1] == windows[i].tolist()
        else:
            assert r["box"] == pytest.approx(a["box"]) and "reranked" not in r
        assert "instances" not in r
        for other in (w, f):  # the route's second call, every image's candidates: the same answer
            assert other["box"] == pytest.approx(r["box"], abs=1e-3) and other.get("reranked") == r.get("reranked")
        listed = [v for x in f["instances"] for v in x["box"]]
        assert listed == pytest.approx([v for x in c["instances"] for v in x["box"]])  # the window not listed
        assert len(w["instances"]) <= 2
    assert switched >= 1 and chosen[k]["box"] == pytest.approx(windows[k].tolist(), abs=1e-3)
    assert auto[k]["box"] != pytest.approx(windows[k].tolist(), abs=1e-3)  # auto has no such candidate


@pytest.mark.parametrize(("window", "switched"), [(0.85, True), (0.70, False)])
def test_a_template_window_answers_only_past_its_bar_and_is_never_listed(window, switched):
    """``judge`` with a template-matching window among the instances (``Instance.template``): with ``template_bar``
    it is a candidate only if it reaches the bar (the others: the threshold); it never shows among the instances;
    without ``template_bar`` it is ignored."""
    from app.calibration import TEMPLATE_BAR

    assert TEMPLATE_BAR == 0.8
    logit = [math.log(p / (1 - p)) for p in (0.2, 0.45, window)]
    templates = Templates(torch.zeros(1, 16, 16, dtype=torch.uint8), None, 84, 1, (0.0,))
    cal = Calibration(PlattFit(["log_score"], [0.0], [1.0], [0.0], 0.0), None, 0.5, {},
                      PlattFit(["log_score", "ncc"], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0], 0.0), None,
                      templates).to_dict()
    boxes = [(0.0, 0.0, 10.0, 10.0), (20.0, 20.0, 30.0, 30.0), (40.0, 40.0, 50.0, 50.0)]
    result = Localization(boxes[0], 1.0, instances=[Instance(boxes[1], 1.0), Instance(boxes[2], 1.0, template=True)])
    ncc = (torch.tensor([logit[:1] + logit[1:]], dtype=torch.float64), None)  # the answer, a candidate, the window
    args = dict(threshold=0.5, min_confidence=None, loaded=None, prototype=b"", negatives=None, rerank="auto", ncc=ncc)
    [j] = judge([result], [Image.new("L", (84, 84))], cal, **args, template_bar=TEMPLATE_BAR)
    assert j.box == (boxes[2] if switched else boxes[0]) and j.reranked == switched
    assert [i.box for i in j.instances] == [boxes[1]]  # the window is not an instance
    [j] = judge([result], [Image.new("L", (84, 84))], cal, **args)
    assert j.box == boxes[0] and not j.reranked


@pytest.mark.parametrize("decoded_scale", [1.0, 2.0, 3.0])
def test_template_windows_match_the_crops_at_their_size_in_the_decoded_pixels(decoded_scale):
    """An upload larger than ``QLOC_DECODE_MAX_SIDE`` is decoded downscaled, while the set's crops were cut at full
    resolution: ``rerank=templates``' window (``matched_windows``, the route's; the engine's by the same
    ``Templates.match`` scales) sizes each crop by the image's full / decoded scale, and finds the object at its
    place in the decoded pixels. Without that scale (1.0 for every image) a crop 2-3x too large matches elsewhere."""
    from app.calibration import matched_windows
    from models.core.boxes import paired_iou
    from models.core.templates import make_templates, match_crops

    g = torch.Generator().manual_seed(5)
    pattern = torch.rand(1, 24, 30, generator=g)  # the object as the crop shows it (full resolution)
    full_side, at = round(84 * decoded_scale), (round(20 * decoded_scale), round(45 * decoded_scale))
    image = torch.rand(1, full_side, full_side, generator=g) * 0.3
    big = torch.nn.functional.interpolate(pattern[None], scale_factor=decoded_scale, mode="bilinear")[0]
    image[:, at[1]:at[1] + big.shape[1], at[0]:at[0] + big.shape[2]] = big
    decoded = Image.fromarray((image[0] * 255).round().byte().numpy()).resize((84, 84), Image.Resampling.LANCZOS)
    crop = big  # cut from the full image
    kept, sizes = match_crops([crop])
    t = Templates(make_templates([crop]), None, 84, 1, (0.0,), crops=kept, crop_sizes=sizes)
    truth = torch.tensor([[20.0, 45.0, 50.0, 69.0]])  # in the decoded pixels
    right = matched_windows(t, [decoded], [(decoded_scale, decoded_scale)])
    assert right[0] is not None and float(paired_iou(torch.tensor(right), truth)[0]) > 0.8
    if decoded_scale > 1:
        wrong = matched_windows(t, [decoded], [(1.0, 1.0)])
        assert wrong[0] is None or float(paired_iou(torch.tensor(wrong), truth)[0]) < 0.5


def test_rerank_templates_on_uploads_decoded_downscaled_finds_the_object_on_every_path(tmp_path, bundle_dir):
    """Uploads twice ``QLOC_DECODE_MAX_SIDE`` (decoded at half size) and crops cut at full resolution: the engine's
    second look (``rerank=templates``), the route's second call (``max_instances=2``) and every image's candidates
    (``max_instances=4``) all take template matching's window on the object (the crops sized by the image's full /
    decoded scale), in full-image pixels."""
    import io

    from fastapi.testclient import TestClient
    from service_fixtures import make_test_settings, migrate

    from app.main import create_app
    from models.core.boxes import paired_iou

    s = make_test_settings(tmp_path, bundle_dir, decode_max_side=84)
    migrate(s.database_url)
    g = torch.Generator().manual_seed(11)

    def png(t: torch.Tensor) -> bytes:
        buf = io.BytesIO()
        Image.fromarray((t[0] * 255).round().byte().numpy()).save(buf, "PNG")
        return buf.getvalue()

    pattern = torch.rand(1, 48, 56, generator=g)  # the object at full resolution (168 x 168 uploads)
    crops = [pattern, pattern[:, 1:, 1:], pattern[:, :-1, :-1]]
    scenes, truth = [], []
    for i in range(4):
        image = torch.rand(1, 168, 168, generator=g) * 0.3
        x, y = 20 + 25 * i, 100 - 20 * i
        image[:, y:y + 48, x:x + 56] = pattern
        scenes.append(png(image))
        truth.append([x, y, x + 56, y + 48])
    with TestClient(create_app(s)) as client:
        r = client.post("/v1/exemplar-sets", files=files(*[png(c) for c in crops]))
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        with Session(create_engine(s.database_url)) as db:  # NCC 0.7 -> 0.5: the pattern likely (~0.9), little else
            row = db.get_one(ExemplarSet, uuid.UUID(sid))
            cal = dict(row.calibration)
            assert cal.get("ncc") is not None
            cal["ncc"] = {"features": ["log_score", "ncc"], "mean": [0.0, 0.7], "std": [1.0, 1.0],
                          "weights": [0.0, 60.0], "bias": 0.0}
            row.calibration = cal
            db.commit()
        for query in ("?rerank=templates", "?rerank=templates&max_instances=2", "?rerank=templates&max_instances=4"):
            r = client.post(f"/v1/exemplar-sets/{sid}/localize{query}", files=files(*scenes))
            assert r.status_code == 200, r.text
            got = r.json()["results"]
            assert [(g["width"], g["height"]) for g in got] == [(168, 168)] * 4
            iou = paired_iou(torch.tensor([g["box"] for g in got]), torch.tensor(truth, dtype=torch.float32))
            assert bool((iou > 0.7).all()), (query, iou, got)
            assert all(g["found"] and g["reranked"] for g in got)
        agent = client.post(f"/v1/exemplar-sets/{sid}/localize?rerank=auto", files=files(*scenes)).json()["results"]
        assert not all(a["found"] for a in agent)  # the agent alone misses (else this test shows nothing)


@pytest.mark.parametrize("crops", [1, 3])
def test_what_the_engine_is_asked_for_follows_rerank_and_whether_the_set_has_an_ncc_fit(client, monkeypatch, crops):
    """The route's call to the model, by ``rerank``: the second look and template matching's window only on a set
    with an NCC fit (3 crops; 1 crop keeps the score's fit: every answer the agent's, whatever ``rerank`` says),
    ``rerank=true``'s candidates on any calibrated set, nothing more with ``rerank=false``."""
    from app.calibration import LOOK_THRESHOLD, RERANK_CANDIDATES, SECOND_LOOK_BELOW, TEMPLATE_BAR

    r = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=9 + k) for k in range(crops)]))
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    calls = []
    inference = client.app.state.inference
    real = inference.localize

    def recording(call):  # type: ignore[no-untyped-def]
        calls.append(call)
        return real(call)

    monkeypatch.setattr(inference, "localize", recording)
    seen = {}
    for rerank in ("templates", "auto", "false", "true"):
        calls.clear()
        r = client.post(f"/v1/exemplar-sets/{sid}/localize?rerank={rerank}", files=files(png_bytes(seed=3)))
        assert r.status_code == 200, r.text
        seen[rerank] = [(c.max_instances, c.second_look and (c.second_look.candidates, c.second_look.template_bar,
                                                             c.second_look.below), c.templates is not None)
                        for c in calls]
    ncc = crops > 1
    look = (RERANK_CANDIDATES, TEMPLATE_BAR, SECOND_LOOK_BELOW * LOOK_THRESHOLD)
    assert seen == {
        "templates": [(1, look if ncc else None, ncc)],
        "auto": [(1, (RERANK_CANDIDATES, None, look[2]) if ncc else None, ncc)],
        "false": [(1, None, ncc)],  # the NCC read for the verdict, no second look
        "true": [(RERANK_CANDIDATES, None, ncc)]}
    # the candidates asked for already (max_instances >= RERANK_CANDIDATES): no second look, whatever rerank says;
    # template matching's window joins them with rerank=templates only; the verdict chooses among them by the rule
    # asked for (templates: auto's), on a set with an NCC fit
    import app.routes.localize as route

    rules, real_judge = [], route.judge

    def judging(*args, **kwargs):  # type: ignore[no-untyped-def]
        rules.append(kwargs["rerank"])
        return real_judge(*args, **kwargs)

    monkeypatch.setattr(route, "judge", judging)
    for rerank in ("templates", "auto", "false", "true"):
        calls.clear()
        rules.clear()
        r = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"rerank": rerank,
                                                                    "max_instances": RERANK_CANDIDATES},
                        files=files(png_bytes(seed=3), png_bytes(seed=4)))
        assert r.status_code == 200, r.text
        assert [(c.max_instances, c.second_look, c.extra_boxes is not None) for c in calls] == [
            (RERANK_CANDIDATES, None, ncc and rerank == "templates")], rerank
        rule = ("auto" if ncc else "false") if rerank in ("templates", "auto") else rerank
        assert rules == [rule], rerank


def test_a_sets_kind_check_travels_with_its_call_and_the_engine_reads_it_for_every_image_at_once(client, monkeypatch):
    """A set matched to a kind its bundle's verifier knows (two crops: the check needs the NCC fits): the route's
    call carries the set's check, the engine reads it on every image of the request in one verifier pass, and each
    answer's confidence is the check's probability of its box, not read again by the route."""
    import io

    from service_fixtures import square_verifier

    from models.inference import pil_to_tensor
    from models.verifier import KindCheck

    seeds = (9, 10)
    v = square_verifier(monkeypatch, seeds)
    es = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=k) for k in seeds])).json()
    assert es["kind"] == "square"
    with client.app.state.session_factory() as s:
        check = s.get_one(ExemplarSet, uuid.UUID(es["id"])).calibration["kind"]

    inference = client.app.state.inference
    calls, answers, passes = [], [], []
    real_localize, real_embed = inference.localize, v.embed_boxes

    def recording(call):  # type: ignore[no-untyped-def]
        calls.append(call)
        answers.append(real_localize(call))
        return answers[-1]

    def embedding(images01, boxes):  # type: ignore[no-untyped-def]
        passes.append(images01.shape[0])
        return real_embed(images01, boxes)

    monkeypatch.setattr(inference, "localize", recording)
    monkeypatch.setattr(v, "embed_boxes", embedding)
    blobs = [png_bytes(seed=1), png_bytes(seed=2)]
    r = client.post(f"/v1/exemplar-sets/{es['id']}/localize", params={"rerank": "false"}, files=files(*blobs))
    assert r.status_code == 200, r.text
    assert [c.kind.to_dict() if c.kind is not None else None for c in calls] == [check]
    assert answers[0].kind is not None and answers[0].kind.shape[0] == 2  # read by the engine
    assert passes == [2]  # once, for both images
    for blob, res in zip(blobs, r.json()["results"], strict=True):
        image = pil_to_tensor(Image.open(io.BytesIO(blob)), 1, (0.0,))[None]  # 84 x 84: the input size
        expected = KindCheck.from_dict(check).probability(real_embed(image, torch.tensor([[res["box"]]])))
        assert res["confidence"] == pytest.approx(float(expected), abs=1e-6)
        assert res["found"] == (res["confidence"] >= 0.5)
