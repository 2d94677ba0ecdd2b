"""``app.routes.localize`` by value, below HTTP: the checkpoint a request names, the refusals of options its format
would drop, each result's instances kept apart, the answer in each format, and a wait that hands its turn back.
Through HTTP, with real bundles: ``test_app_exemplar_sets.py``, ``test_app_instances.py``, ``test_app_calibration.py``,
``test_app_export.py`` and ``test_app_batching.py``."""

from __future__ import annotations

import json
import threading
import uuid

import pytest
from service_fixtures import new_set, refusal
from sqlalchemy import select

from app.calibration import Judged
from app.export import AnswerOptions
from app.routes.localize import (
    KEPT_HEADER,
    Localized,
    _checkpoint_name,
    apart,
    check_format_options,
    formatted,
    resolve_checkpoint,
    without_turn,
)
from app.schemas import InstanceResult, LocalizationResult
from app.tables import Checkpoint, ExemplarSet

CHECKPOINT_WORDS = ("checkpoint is `active`, `base` or a checkpoint id of this set (a UUID, as "
                    "GET /v1/exemplar-sets/{id}/checkpoints lists them)")


def test_a_checkpoint_is_named_active_base_or_by_its_id_in_any_spelling():
    some = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0")
    assert _checkpoint_name("ACTIVE") == "active" and _checkpoint_name("Base") == "base"
    assert _checkpoint_name("active") == "active" and _checkpoint_name("base") == "base"
    for spelling in (str(some), str(some).upper(), some.hex, "{" + str(some) + "}", "urn:uuid:" + str(some)):
        assert _checkpoint_name(spelling) == "12345678-9abc-def0-1234-56789abcdef0"
    assert _checkpoint_name(7) == 7  # not text: left to the field's own type check
    for bad in ("latest", "", "12345678-9abc-def0-1234-56789abcdef", "actives"):
        with pytest.raises(ValueError) as e:
            _checkpoint_name(bad)
        assert str(e.value) == CHECKPOINT_WORDS and e.value.__suppress_context__


def adapted(db, set_id: uuid.UUID) -> uuid.UUID:  # type: ignore[no-untyped-def]
    with db.begin() as s:
        base = s.scalars(select(Checkpoint).where(Checkpoint.exemplar_set_id == set_id)).one()
        c = Checkpoint(exemplar_set_id=set_id, parent_id=base.id, job_id=None, kind="adapted", iteration=5,
                       sha256="c" * 64, blob="ck")
        s.add(c)
        s.flush()
        return c.id


def test_the_checkpoint_a_request_names_is_found_in_its_set_and_nowhere_else(db):
    set_id, other = new_set(db), new_set(db)
    ckpt, elsewhere = adapted(db, set_id), adapted(db, other)
    with db() as s:
        es = s.get_one(ExemplarSet, set_id)
        base_id = es.active_checkpoint_id
        base = s.get_one(Checkpoint, base_id)
        assert base.kind == "base"
        assert resolve_checkpoint(s, es, "active").id == base_id
        assert resolve_checkpoint(s, es, "base").id == base_id
        assert resolve_checkpoint(s, es, str(ckpt)).id == ckpt
        # the active checkpoint the caller read with the set is taken as it is (no query: a row not in the session)
        read = Checkpoint(id=base_id, exemplar_set_id=set_id, kind="base", iteration=0, sha256="r" * 64)
        assert resolve_checkpoint(s, es, "active", active=read) is read
        assert resolve_checkpoint(s, es, "base", active=read) is not read  # base is read, whatever is active
        stale = Checkpoint(id=ckpt, exemplar_set_id=set_id, kind="adapted", iteration=5, sha256="r" * 64)
        assert resolve_checkpoint(s, es, "active", active=stale).id == base_id  # not the set's active one: read

        es.active_checkpoint_id = ckpt  # activated
        assert resolve_checkpoint(s, es, "active").id == ckpt
        assert resolve_checkpoint(s, es, "base").id == base_id
        es.active_checkpoint_id = None  # none active: the base serves
        assert resolve_checkpoint(s, es, "active").id == base_id
        s.rollback()

        for which in (str(elsewhere), str(uuid.uuid4())):
            assert refusal(resolve_checkpoint, s, es, which) == (404, "checkpoint not found in this exemplar set")
        second = s.get_one(ExemplarSet, other)  # its base, not the first set's (made before it)
        assert resolve_checkpoint(s, second, "base").id == second.active_checkpoint_id != base_id
    with db.begin() as s:  # a set without its base checkpoint (deleted under the request)
        s.get_one(ExemplarSet, other).active_checkpoint_id = None
        s.delete(s.get_one(Checkpoint, elsewhere))
        s.flush()
        for c in s.scalars(select(Checkpoint).where(Checkpoint.exemplar_set_id == other)):
            s.delete(c)
    with db() as s:
        es = s.get_one(ExemplarSet, other)
        for which in ("active", "base"):
            assert refusal(resolve_checkpoint, s, es, which) == (404, "checkpoint not found in this exemplar set")


def test_options_the_asked_format_would_drop_are_refused_naming_each():
    assert refusal(check_format_options, AnswerOptions(), {"label", "image_ids", "category_id", "samples"},
                   trajectory=False) == (422, "category_id is for format=coco, image_ids is for format=coco, label is "
                                              "for format=labelstudio: not used with format=json (drop it, or ask "
                                              "for that format)")
    assert refusal(check_format_options, AnswerOptions(format="coco"), {"label"}, trajectory=False) == (
        422, "label is for format=labelstudio: not used with format=coco (drop it, or ask for that format)")
    assert refusal(check_format_options, AnswerOptions(format="labelstudio"), {"image_ids", "category_id"},
                   trajectory=False)[1].startswith("category_id is for format=coco, image_ids is for format=coco: "
                                                    "not used with format=labelstudio")
    for fmt in ("coco", "labelstudio"):
        assert refusal(check_format_options, AnswerOptions(format=fmt), set(), trajectory=True) == (
            422, f"trajectory=true is answered only with format=json: format={fmt} has no place for it")
    assert refusal(check_format_options, AnswerOptions(format="coco", image_ids="3,1,3,2,1,3"), {"image_ids"},
                   trajectory=False) == (422, "image_ids repeats 1, 3: COCO image ids must be unique, one per file")
    # what each format takes passes
    check_format_options(AnswerOptions(), {"samples", "max_instances"}, trajectory=True)
    check_format_options(AnswerOptions(format="coco", image_ids="3,1,2", category_id=4), {"image_ids", "category_id"},
                         trajectory=False)
    check_format_options(AnswerOptions(format="labelstudio", label="cat"), {"label"}, trajectory=False)
    # not coco's: unread
    check_format_options(AnswerOptions(format="labelstudio", image_ids="1,1"), set(), trajectory=False)


def judged(*boxes: tuple[float, float, float, float] | None) -> Judged:
    """A verdict whose instances have ``boxes`` (``None`` as the only argument: no instances)."""
    if boxes == (None,):
        return Judged((0, 0, 10, 10), 1.0, None, True)
    return Judged(boxes[0], 1.0, None, True,  # type: ignore[arg-type]
                  instances=[Judged(b, float(k), 0.5, True) for k, b in enumerate(boxes)])  # type: ignore[arg-type]


def test_instances_mostly_inside_or_around_a_better_one_are_left_out_image_by_image():
    whole = (0.0, 0.0, 40.0, 40.0)
    part = (0.0, 0.0, 20.0, 30.0)  # 600 of its 600 inside the whole: a part found again
    half_out = (20.0, 20.0, 60.0, 60.0)  # 400 of 1600 inside: another object beside it
    around = (0.0, 0.0, 80.0, 80.0)  # the whole inside it
    edge = (0.0, 0.0, 20.0, 60.0)  # 800 of its 1200 inside the whole: 0.67 > 0.6
    below = (0.0, 30.0, 40.0, 96.0)  # 400 of the whole's 1600 (the smaller) inside both: 0.25
    rows = [judged(whole, part, half_out, around), judged(None), judged(half_out, whole),
            judged(whole, edge, below), judged(part)]
    apart(rows)
    assert [i.box for i in rows[0].instances] == [whole, half_out]
    assert rows[1].instances is None
    assert [i.box for i in rows[2].instances] == [half_out, whole]
    assert [i.box for i in rows[3].instances] == [whole, below]
    assert [i.box for i in rows[4].instances] == [part]
    assert [i.score for i in rows[0].instances] == [0.0, 2.0]  # the verdicts themselves, in their order
    nothing = [judged(None), judged(None)]
    apart(nothing)  # no instances anywhere: left as they are
    assert [j.instances for j in nothing] == [None, None]


def result(name: str, box: list[float], *, found: bool = True, confidence: float | None = 0.9,
           instances: list[InstanceResult] | None = None) -> LocalizationResult:
    return LocalizationResult(filename=name, width=100, height=50, box=box, score=0.25, confidence=confidence,
                              found=found, instances=instances)


def done(results: list[LocalizationResult], *, kept: list[uuid.UUID] | None = None, name: str | None = "fours"
         ) -> Localized:
    es = ExemplarSet(id=uuid.UUID(int=1), name=name, bundle="mnist-general")
    ckpt = Checkpoint(id=uuid.UUID(int=2), kind="base")
    return Localized(es, ckpt, samples=3, nearest=True, results=results, kept=kept, refined=True)


def test_a_json_answer_is_the_response_model_without_nulls():
    answer = formatted(done([result("a.png", [1.0, 2.0, 30.0, 40.0]),
                             result("b.png", [0.0, 0.0, 5.0, 5.0], found=False, confidence=None)]), AnswerOptions())
    assert answer.media_type == "application/json" and KEPT_HEADER not in answer.headers
    assert json.loads(answer.body) == {
        "exemplar_set_id": str(uuid.UUID(int=1)), "checkpoint_id": str(uuid.UUID(int=2)), "bundle": "mnist-general",
        "samples": 3, "nearest": True, "refined": True,
        "results": [{"filename": "a.png", "width": 100, "height": 50, "box": [1.0, 2.0, 30.0, 40.0], "score": 0.25,
                     "confidence": 0.9, "found": True},
                    {"filename": "b.png", "width": 100, "height": 50, "box": [0.0, 0.0, 5.0, 5.0], "score": 0.25,
                     "found": False}]}
    kept = [uuid.UUID(int=7), uuid.UUID(int=8)]
    answer = formatted(done([result("a.png", [1.0, 2.0, 30.0, 40.0])], kept=kept), AnswerOptions())
    assert json.loads(answer.body)["kept"] == [str(k) for k in kept] and KEPT_HEADER not in answer.headers


def test_coco_and_label_studio_answers_carry_the_kept_ids_in_a_header():
    kept = [uuid.UUID(int=7), uuid.UUID(int=8)]
    rows = [result("a.png", [10.0, 5.0, 30.0, 25.0]), result("b.png", [0.0, 0.0, 50.0, 25.0], found=False)]
    coco = formatted(done(rows, kept=kept), AnswerOptions(format="coco", image_ids="4,9", category_id=3))
    assert coco.headers[KEPT_HEADER] == f"{kept[0]},{kept[1]}"
    body = json.loads(coco.body)
    assert body["images"] == [{"id": 4, "file_name": "a.png", "width": 100, "height": 50},
                              {"id": 9, "file_name": "b.png", "width": 100, "height": 50}]
    assert body["categories"] == [{"id": 3, "name": "fours"}]
    assert [(a["image_id"], a["category_id"], a["bbox"]) for a in body["annotations"]] == [
        (4, 3, [10.0, 5.0, 20.0, 20.0]), (9, 3, [0.0, 0.0, 50.0, 25.0])]  # min_confidence not asked: every answer
    only = json.loads(formatted(done(rows), AnswerOptions(format="coco", min_confidence=0.5)).body)
    assert [a["image_id"] for a in only["annotations"]] == [1]  # ids 1..N by default; the answer not found left out
    unnamed = json.loads(formatted(done(rows, name=None), AnswerOptions(format="coco")).body)
    assert unnamed["categories"][0]["name"] == "object"
    assert KEPT_HEADER not in formatted(done(rows), AnswerOptions(format="coco")).headers

    ls = formatted(done(rows, kept=kept), AnswerOptions(format="labelstudio"))
    assert ls.headers[KEPT_HEADER] == f"{kept[0]},{kept[1]}"
    tasks = json.loads(ls.body)
    assert [t["predictions"][0]["model_version"] for t in tasks] == [str(uuid.UUID(int=2))] * 2
    region = tasks[0]["predictions"][0]["result"][0]
    assert (region["from_name"], region["to_name"], region["value"]["rectanglelabels"]) == ("label", "image", ["fours"])
    assert tasks[1]["predictions"][0]["result"] == []  # not found: nothing to pre-annotate
    for name, label, want in (("fours", "cat", "cat"), (None, None, "object"), ("fours", None, "fours")):
        t = json.loads(formatted(done(rows, name=name), AnswerOptions(format="labelstudio", label=label)).body)
        assert t[0]["predictions"][0]["result"][0]["value"]["rectanglelabels"] == [want]


def test_a_wait_hands_its_turn_back_and_takes_it_again_after_even_when_it_fails():
    def call(x: int, *, y: int) -> int:
        return x + y

    assert without_turn(None, call) is call  # no turns: the call itself
    turns = threading.BoundedSemaphore(1)
    turns.acquire()  # the caller's turn
    seen = []

    def wait(x: int, *, y: int) -> int:
        seen.append(turns.acquire(blocking=False))  # free while it waits: another request may take it
        turns.release()
        if x < 0:
            raise RuntimeError("no worker answered")
        return x + y

    assert without_turn(turns, wait)(2, y=3) == 5
    assert turns.acquire(blocking=False) is False  # taken back
    with pytest.raises(RuntimeError, match="no worker answered"):
        without_turn(turns, wait)(-1, y=0)
    assert turns.acquire(blocking=False) is False and seen == [True, True]
    turns.release()
    with pytest.raises(ValueError):
        turns.release()  # held exactly once: nothing released twice
