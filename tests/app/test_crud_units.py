"""``app.crud`` by value, on SQLite and PostgreSQL (migrated databases, one per module and backend: each test makes
its own sets, and counts across the database are read as differences). One session at a time: a SQLite session
takes the write lock when it begins (``app.db``).

The routes' tests reach every function here through HTTP; these pin what each returns and writes -- the owner's
scope, the orders and pages of the listings, what a deletion leaves of the set's other rows and of other sets, a
checkpoint's lineage after one is deleted -- where a mutant would pass the routes' coarser checks (and in seconds per
mutant instead of minutes: ``scripts/mutation.py``'s ``crud``)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from service_fixtures import blob, new_set
from sqlalchemy import func, select, update

from app import crud
from app.tables import (
    AdaptationJob,
    Checkpoint,
    Exemplar,
    ExemplarSet,
    JobImage,
    LabelStudioSetup,
    PoolImage,
    utcnow,
)


def base_of(db, set_id: uuid.UUID) -> uuid.UUID:  # type: ignore[no-untyped-def]
    with db() as s:
        return s.scalars(select(Checkpoint.id).where(Checkpoint.exemplar_set_id == set_id,
                                                     Checkpoint.kind == "base")).one()


def new_checkpoint(db, set_id: uuid.UUID, *, parent: uuid.UUID | None = None, iteration: int = 1,  # type: ignore[no-untyped-def]
                   created=None, id_: uuid.UUID | None = None) -> uuid.UUID:
    with db.begin() as s:
        c = Checkpoint(id=id_ or uuid.uuid4(), exemplar_set_id=set_id, parent_id=parent, kind="adapted",
                       iteration=iteration, sha256="c" * 64, metrics={"i": iteration}, blob=f"ck/{uuid.uuid4().hex}",
                       **({} if created is None else {"created_at": created}))
        s.add(c)
        s.flush()
        return c.id


def new_job(db, set_id: uuid.UUID, *, owner: str = "k", key: str | None = None, images: int = 0,  # type: ignore[no-untyped-def]
            **values) -> uuid.UUID:
    job_id = uuid.uuid4()
    with db.begin() as s:
        es = s.get_one(ExemplarSet, set_id)
        crud.create_job(s, job_id=job_id, exemplar_set=es, owner=owner, idempotency_key=key,
                        request_sha256="r" * 64, iterations=7, learning_rate=0.25, seed=3, activate="false",
                        images=[blob(i) for i in range(images)])
        if values:
            s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(**values))
    return job_id


def test_a_new_set_holds_its_exemplars_labeled_examples_and_base_checkpoint_made_active(db):
    exemplars = [blob(0), blob(1, box=(1.0, 2.0, 30.5, 20.0)), blob(2, name=None), blob(3, box=(0.0, 0.0, 4.0, 4.0))]
    set_id = new_set(db, exemplars=exemplars, calibration={"fit": {"a": 1.0}}, threshold=0.25,
                     negatives=b"\2" * 16, num_negatives=2)
    plain = new_set(db)
    with db() as s:
        es = s.get_one(ExemplarSet, set_id)
        assert (es.owner, es.name, es.bundle, es.bundle_sha256, es.prototype, es.prototype_dim) == (
            "k", "s", "b", "a" * 64, b"\1" * 8, 2)
        assert (es.num_exemplars, es.num_labeled, es.calibration, es.threshold, es.negatives, es.num_negatives) == (
            4, 2, {"fit": {"a": 1.0}}, 0.25, b"\2" * 16, 2)
        rows = s.scalars(select(Exemplar).where(Exemplar.exemplar_set_id == set_id).order_by(Exemplar.position)).all()
        assert [(r.position, r.filename, r.content_type, r.width, r.height, r.sha256, r.blob) for r in rows] == [
            (e.position, e.filename, e.content_type, e.width, e.height, e.sha256, e.blob) for e in exemplars]
        assert [(r.box_x1, r.box_y1, r.box_x2, r.box_y2) for r in rows] == [
            (None,) * 4, (1.0, 2.0, 30.5, 20.0), (None,) * 4, (0.0, 0.0, 4.0, 4.0)]
        base = s.get_one(Checkpoint, es.active_checkpoint_id)
        assert (base.exemplar_set_id, base.parent_id, base.job_id, base.kind, base.iteration, base.sha256,
                base.metrics, base.blob) == (set_id, None, None, "base", 0, "a" * 64, {}, None)
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.exemplar_set_id == set_id)) == 1
        # defaults: no calibration, the default threshold, no negatives, no labeled examples
        other = s.get_one(ExemplarSet, plain)
        assert (other.num_labeled, other.calibration, other.threshold, other.negatives, other.num_negatives) == (
            0, None, 0.5, None, 0)
        # labeled examples: the rows with a box, by position (by keyword or by position)
        assert [r.position for r in crud.labeled_examples(s, set_id)] == [1, 3]
        assert [r.box for r in crud.labeled_examples(s, set_id=set_id)] == [(1.0, 2.0, 30.5, 20.0),
                                                                            (0.0, 0.0, 4.0, 4.0)]
        assert crud.labeled_examples(s, plain) == []


def test_labeled_examples_come_in_position_order_whatever_order_they_were_written_in(db):
    set_id = new_set(db, exemplars=[blob(2, box=(0, 0, 3, 3)), blob(0, box=(0, 0, 1, 1)), blob(1, box=(0, 0, 2, 2))])
    with db() as s:
        assert [(r.position, r.box_x2) for r in crud.labeled_examples(s, set_id)] == [(0, 1), (1, 2), (2, 3)]


def seen_by_its_owner_only(db, read, row_id: uuid.UUID) -> None:  # type: ignore[no-untyped-def]
    """``read(session, id, owner)`` finds ``row_id`` (alice's) for alice and with auth off (``None``), not for bob,
    and no unknown id."""
    with db() as s:
        assert read(s, row_id, "alice").id == row_id
        assert read(s, row_id, None).id == row_id
        assert read(s, row_id, "bob") is None
        assert read(s, uuid.uuid4(), None) is None


def test_a_set_a_checkpoint_and_a_job_are_seen_by_their_owner_and_with_auth_off_only(db):
    set_id = new_set(db, owner="alice")
    seen_by_its_owner_only(db, lambda s, i, o: crud.get_exemplar_set(s, set_id=i, owner=o), set_id)
    seen_by_its_owner_only(db, lambda s, i, o: crud.get_checkpoint(s, checkpoint_id=i, owner=o),
                           new_checkpoint(db, set_id))  # through its set's owner
    seen_by_its_owner_only(db, lambda s, i, o: crud.get_job(s, job_id=i, owner=o), new_job(db, set_id, owner="alice"))


def test_a_set_without_an_active_checkpoint_comes_back_with_none(db):
    set_id = new_set(db)
    with db.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=None))
    with db() as s:
        es, active = crud.get_exemplar_set_and_active(s, set_id=set_id, owner="k")
    assert es.id == set_id and active is None


def test_parsed_json_parses_once_per_text():
    key = uuid.uuid4().hex  # a text no earlier test parsed (the cache lives as long as the process)
    text = f'{{"a": [1, 2], "b": "caf\\u00e9", "k": "{key}"}}'
    first = crud.parsed_json(text)
    assert first == {"a": [1, 2], "b": "caf\u00e9", "k": key}
    assert crud.parsed_json(str(text)) is first and crud.parsed_json(text + " ") == first
    assert crud.parsed_json(text + " ") is not first
    assert crud.parsed_json(None) is None


def test_sets_are_listed_by_owner_oldest_first_in_pages_with_their_count(db):
    owner = f"lister-{uuid.uuid4().hex[:8]}"
    t0 = utcnow() - timedelta(days=1)
    ids = [new_set(db, owner=owner) for _ in range(4)]
    with db.begin() as s:  # made in the order 2, 0, 3, 1; the last two at the same moment (then by id)
        for i, minutes in zip(ids, (2, 4, 1, 4), strict=True):
            s.execute(update(ExemplarSet).where(ExemplarSet.id == i).values(created_at=t0 + timedelta(minutes=minutes)))
    tied = sorted([ids[1], ids[3]])
    new_set(db, owner="someone else")
    with db() as s:
        page, count = crud.list_exemplar_sets(s, owner=owner, limit=10, offset=0)
        assert count == 4 and [e.id for e in page] == [ids[2], ids[0], *tied]
        page, count = crud.list_exemplar_sets(s, owner=owner, limit=2, offset=1)
        assert count == 4 and [e.id for e in page] == [ids[0], tied[0]]
        everyone, total = crud.list_exemplar_sets(s, owner=None, limit=1000, offset=0)
        assert total == len(everyone) >= 5 and set(ids) < {e.id for e in everyone}
        assert crud.list_exemplar_sets(s, owner="nobody", limit=10, offset=0) == ([], 0)


def test_unfinished_jobs_are_the_sets_queued_and_running_ones_oldest_first(db):
    set_id, other = new_set(db), new_set(db)
    t0 = utcnow() - timedelta(hours=1)
    running = new_job(db, set_id, status="running", created_at=t0 + timedelta(minutes=2), cancel_requested=True)
    queued = new_job(db, set_id, created_at=t0 + timedelta(minutes=1))
    tied = sorted(new_job(db, set_id, created_at=t0 + timedelta(minutes=3)) for _ in range(3))  # then by id
    for status in ("succeeded", "failed", "canceled"):
        new_job(db, set_id, status=status, created_at=t0)
    new_job(db, other, created_at=t0)
    with db() as s:
        got = crud.unfinished_jobs(s, set_id=set_id)
    assert got == [(queued, False), (running, True), *((j, False) for j in tied)]
    assert all(type(c) is bool for _, c in got)


def _count(s, table, column, value) -> int:  # type: ignore[no-untyped-def]
    return s.scalar(select(func.count()).select_from(table).where(column == value))


def test_deleting_a_set_deletes_every_row_under_it_and_nothing_of_another_set(db):
    kept, gone = new_set(db, exemplars=[blob(0), blob(1, box=(0, 0, 5, 5))]), new_set(db)
    for set_id in (kept, gone):
        ckpt = new_checkpoint(db, set_id, parent=base_of(db, set_id))
        child = new_checkpoint(db, set_id, parent=ckpt, iteration=2)
        job = new_job(db, set_id, images=2, status="succeeded", checkpoint_id=child)
        with db.begin() as s:
            s.execute(update(Checkpoint).where(Checkpoint.id == child).values(job_id=job))
            s.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=child))
            s.add(PoolImage(exemplar_set_id=set_id, position=0, content_type="image/png", width=1, height=1, size=9,
                            sha256="p" * 64, blob="pool/x"))
            crud.put_labelstudio_setup(s, set_id=set_id, project="1", url=None, token=None, max_instances=1)

    def counts(s, set_id):  # type: ignore[no-untyped-def]
        jobs = select(AdaptationJob.id).where(AdaptationJob.exemplar_set_id == set_id)
        return (_count(s, ExemplarSet, ExemplarSet.id, set_id), _count(s, Exemplar, Exemplar.exemplar_set_id, set_id),
                _count(s, Checkpoint, Checkpoint.exemplar_set_id, set_id),
                _count(s, AdaptationJob, AdaptationJob.exemplar_set_id, set_id),
                s.scalar(select(func.count()).select_from(JobImage).where(JobImage.job_id.in_(jobs))),
                _count(s, PoolImage, PoolImage.exemplar_set_id, set_id),
                _count(s, LabelStudioSetup, LabelStudioSetup.exemplar_set_id, set_id))

    with db() as s:
        before = counts(s, kept)
    assert before == (1, 2, 3, 1, 2, 1, 1)
    with db.begin() as s:
        crud.delete_exemplar_set(s, set_id=gone)
    kept_base = base_of(db, kept)
    with db() as s:
        assert counts(s, gone) == (0,) * 7
        assert counts(s, kept) == before
        es = s.get_one(ExemplarSet, kept)
        job = s.scalars(select(AdaptationJob).where(AdaptationJob.exemplar_set_id == kept)).one()
        assert es.active_checkpoint_id is not None and job.checkpoint_id is not None
        assert job.base_checkpoint_id == kept_base
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.exemplar_set_id == kept,
                                                                           Checkpoint.parent_id.is_not(None))) == 2


def test_checkpoints_are_listed_oldest_first_then_by_iteration_then_id_in_pages(db):
    set_id = new_set(db)
    t0 = utcnow() + timedelta(days=1)  # after the base checkpoint
    low, high = sorted(uuid.uuid4() for _ in range(2))
    late = new_checkpoint(db, set_id, iteration=1, created=t0 + timedelta(minutes=5))
    second = new_checkpoint(db, set_id, iteration=8, created=t0, id_=low)  # a lower id, a later iteration
    first = new_checkpoint(db, set_id, iteration=4, created=t0, id_=high)
    tied = sorted(new_checkpoint(db, set_id, iteration=9, created=t0) for _ in range(3))
    new_checkpoint(db, new_set(db), created=t0)
    base = base_of(db, set_id)
    with db() as s:
        page, count = crud.list_checkpoints(s, set_id=set_id, limit=10, offset=0)
        assert count == 7 and [c.id for c in page] == [base, first, second, *tied, late]
        page, count = crud.list_checkpoints(s, set_id=set_id, limit=2, offset=1)
        assert count == 7 and [c.id for c in page] == [first, second]
        assert crud.list_checkpoints(s, set_id=uuid.uuid4(), limit=10, offset=0) == ([], 0)


def test_activating_a_checkpoint_makes_it_its_sets_active_one_unless_it_was_deleted(db):
    set_id, other = new_set(db), new_set(db)
    ckpt = new_checkpoint(db, set_id)
    other_base = base_of(db, other)
    with db.begin() as s:
        es = crud.activate_checkpoint(s, checkpoint=s.get_one(Checkpoint, ckpt))
        assert es is not None and es.id == set_id
    with db() as s:
        assert s.get_one(ExemplarSet, set_id).active_checkpoint_id == ckpt
        assert s.get_one(ExemplarSet, other).active_checkpoint_id == other_base
    gone = new_checkpoint(db, set_id)
    with db.begin() as s:
        row = s.get_one(Checkpoint, gone)
        s.execute(update(Checkpoint).where(Checkpoint.parent_id == gone).values(parent_id=None))
        s.delete(row)
        s.flush()
        assert crud.activate_checkpoint(s, checkpoint=row) is None
    with db() as s:
        assert s.get_one(ExemplarSet, set_id).active_checkpoint_id == ckpt


def test_deleting_a_checkpoint_reparents_its_children_and_jobs_forget_it(db):
    set_id = new_set(db)
    base = base_of(db, set_id)
    mid = new_checkpoint(db, set_id, parent=base)
    children = [new_checkpoint(db, set_id, parent=mid, iteration=i) for i in (2, 3)]
    grandchild = new_checkpoint(db, set_id, parent=children[0], iteration=4)
    sibling = new_checkpoint(db, set_id, parent=base, iteration=5)
    wrote = new_job(db, set_id, status="succeeded", checkpoint_id=mid)
    started = new_job(db, set_id, status="failed", base_checkpoint_id=mid)
    untouched = new_job(db, set_id, status="succeeded", checkpoint_id=sibling)
    with db.begin() as s:
        row = s.get_one(Checkpoint, mid)
        key = row.blob
        assert crud.delete_checkpoint(s, checkpoint=row) == key and key is not None
    with db() as s:
        assert s.get(Checkpoint, mid) is None
        parents = {c: s.get_one(Checkpoint, c).parent_id for c in (*children, grandchild, sibling, base)}
        assert parents == {children[0]: base, children[1]: base, grandchild: children[0], sibling: base, base: None}
        jobs = {j: (s.get_one(AdaptationJob, j).checkpoint_id, s.get_one(AdaptationJob, j).base_checkpoint_id)
                for j in (wrote, started, untouched)}
        assert jobs == {wrote: (None, base), started: (None, None), untouched: (sibling, base)}


def test_what_keeps_a_checkpoint_from_being_deleted(db):
    set_id = new_set(db)
    base = base_of(db, set_id)
    active = new_checkpoint(db, set_id)
    free = new_checkpoint(db, set_id)
    with db.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=active))
    with db() as s:
        reason = crud.checkpoint_in_use(s, checkpoint=s.get_one(Checkpoint, base))
        assert reason == "it is the set's base policy (the bundle's own); delete the exemplar set to remove it"
        reason = crud.checkpoint_in_use(s, checkpoint=s.get_one(Checkpoint, active))
        assert reason == ("it is the set's active checkpoint: activate another one first "
                          "(POST /v1/checkpoints/{id}/activate)")
        assert crud.checkpoint_in_use(s, checkpoint=s.get_one(Checkpoint, free)) is None

    # finished jobs that started from it or wrote it do not hold it
    new_job(db, set_id, status="succeeded", base_checkpoint_id=free)
    done = new_job(db, set_id, status="canceled")
    with db.begin() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == free).values(job_id=done))
    with db() as s:
        assert crud.checkpoint_in_use(s, checkpoint=s.get_one(Checkpoint, free)) is None

    # a queued job starting from it, a running one writing it: both named
    starts = new_job(db, set_id, base_checkpoint_id=free)
    writes = new_job(db, set_id, status="running")
    new_job(db, set_id, status="running")  # another running job: not named
    with db.begin() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == free).values(job_id=writes))
    with db() as s:
        reason = crud.checkpoint_in_use(s, checkpoint=s.get_one(Checkpoint, free))
    assert reason is not None and reason.startswith("job ") and reason.endswith(
        " (queued or running) starts from it or wrote it: wait for it to end, or cancel it")
    named = reason.removeprefix("job ").split(" (")[0].split(", ")
    assert sorted(named) == sorted([str(starts), str(writes)])


def test_a_new_job_is_queued_unsent_from_its_sets_active_checkpoint_with_its_images(db):
    set_id = new_set(db)
    ckpt = new_checkpoint(db, set_id)
    with db.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=ckpt))
    job_id = new_job(db, set_id, owner="k", key="idem", images=3)
    with db() as s:
        job = s.get_one(AdaptationJob, job_id)
        assert (job.exemplar_set_id, job.owner, job.idempotency_key, job.request_sha256, job.iterations,
                job.learning_rate, job.seed, job.activate, job.num_images, job.base_checkpoint_id) == (
            set_id, "k", "idem", "r" * 64, 7, 0.25, 3, "false", 3, ckpt)
        assert (job.status, job.progress_iteration, job.cancel_requested, job.attempts, job.enqueued_at,
                job.checkpoint_id) == ("queued", 0, False, 0, None, None)
        rows = s.scalars(select(JobImage).where(JobImage.job_id == job_id).order_by(JobImage.position)).all()
        assert [(r.position, r.filename, r.content_type, r.width, r.height, r.sha256, r.pool_image_id)
                for r in rows] == [(i, "f.png", "image/png", 40 + i, 30 + i, f"{i:064d}", None) for i in range(3)]
        assert all(r.blob.startswith("b/") for r in rows)


def test_a_job_is_found_by_its_owners_idempotency_key(db):
    set_id = new_set(db, owner="alice")
    key = f"key-{uuid.uuid4().hex[:8]}"
    job_id = new_job(db, set_id, owner="alice", key=key)
    new_job(db, set_id, owner="alice", key=key + "-other")
    with db() as s:
        assert crud.get_job_by_idempotency_key(s, owner="alice", key=key).id == job_id
        assert crud.get_job_by_idempotency_key(s, owner="bob", key=key) is None
        assert crud.get_job_by_idempotency_key(s, owner="alice", key="unknown") is None


def test_jobs_are_listed_oldest_first_in_pages_with_their_count(db):
    set_id = new_set(db)
    t0 = utcnow() - timedelta(hours=1)
    ids = [new_job(db, set_id, created_at=t0 + timedelta(minutes=m)) for m in (3, 1, 2)]
    tied = sorted(new_job(db, set_id, created_at=t0 + timedelta(minutes=4)) for _ in range(3))  # then by id
    new_job(db, new_set(db), created_at=t0)
    with db() as s:
        page, count = crud.list_jobs(s, set_id=set_id, limit=10, offset=0)
        assert count == 6 and [j.id for j in page] == [ids[1], ids[2], ids[0], *tied]
        page, count = crud.list_jobs(s, set_id=set_id, limit=1, offset=1)
        assert count == 6 and [j.id for j in page] == [ids[2]]
        assert crud.list_jobs(s, set_id=uuid.uuid4(), limit=10, offset=0) == ([], 0)


def test_mark_enqueued_dates_the_send_once_and_only_for_its_job(db):
    set_id = new_set(db)
    job_id, other = new_job(db, set_id), new_job(db, set_id)
    before = utcnow()
    with db.begin() as s:
        crud.mark_enqueued(s, job_id=job_id)
    with db() as s:
        first = s.get_one(AdaptationJob, job_id).enqueued_at
        assert first is not None and first >= before - timedelta(seconds=1)
        assert s.get_one(AdaptationJob, other).enqueued_at is None
    with db.begin() as s:
        crud.mark_enqueued(s, job_id=job_id)
    with db() as s:
        assert s.get_one(AdaptationJob, job_id).enqueued_at == first


def test_job_counts_and_durations_by_status(db):
    with db() as s:
        counts0, stats0 = crud.job_counts(s), crud.job_duration_stats(s)
    set_id = new_set(db)
    t0 = utcnow() - timedelta(days=3)
    hour = 3600.0  # long runs: a day's length off by a second shows
    for status, seconds in (("succeeded", 30 * hour), ("succeeded", 9 * hour), ("failed", 12.0), ("canceled", 6.0)):
        new_job(db, set_id, status=status, started_at=t0, finished_at=t0 + timedelta(seconds=seconds))
    new_job(db, set_id, status="canceled", finished_at=t0)  # canceled before it ran: no duration
    new_job(db, set_id, status="failed", started_at=t0)  # no end recorded: no duration
    new_job(db, set_id, status="running", started_at=t0, finished_at=t0 + timedelta(seconds=5))  # requeued, running
    new_job(db, set_id)
    with db() as s:
        counts, stats = crud.job_counts(s), crud.job_duration_stats(s)

    def grew(now: dict, then: dict, status: str):  # type: ignore[no-untyped-def]
        return now.get(status, 0) - then.get(status, 0)

    assert {st: grew(counts, counts0, st) for st in ("queued", "running", "succeeded", "failed", "canceled")} == {
        "queued": 1, "running": 1, "succeeded": 2, "failed": 2, "canceled": 2}
    assert "running" not in stats and "queued" not in stats
    for status, n, total in (("succeeded", 2, 39 * hour), ("failed", 1, 12.0), ("canceled", 1, 6.0)):
        n0, total0 = stats0.get(status, (0, 0.0))
        got_n, got_total = stats[status]
        assert type(got_n) is int and type(got_total) is float
        assert got_n - n0 == n and got_total - total0 == pytest.approx(total, abs=0.01)


def setup_of(s, set_id: uuid.UUID, project: str) -> tuple:  # type: ignore[no-untyped-def]
    """(url, token, max_instances) of the set's recorded Label Studio setup for ``project``."""
    r = crud.labelstudio_setup(s, set_id=set_id, project=project)
    return r.url, r.token, r.max_instances


def test_a_label_studio_setup_is_recorded_and_updated_in_place(db):
    set_id, other = new_set(db), new_set(db)
    with db() as s:
        assert crud.labelstudio_setup(s, set_id=set_id, project="7") is None
    with db.begin() as s:
        crud.put_labelstudio_setup(s, set_id=set_id, project="7", url="http://ls:8080", token="t1", max_instances=3)
        crud.put_labelstudio_setup(s, set_id=other, project="7", url="http://other", token="t9", max_instances=9)
    with db() as s:
        assert setup_of(s, set_id, "7") == ("http://ls:8080", "t1", 3)
        stamp = crud.labelstudio_setup(s, set_id=set_id, project="7").updated_at
    with db.begin() as s:  # a later /setup without url or token keeps them; max_instances replaces the last
        crud.put_labelstudio_setup(s, set_id=set_id, project="7", url=None, token=None, max_instances=1)
    with db() as s:
        assert setup_of(s, set_id, "7") == ("http://ls:8080", "t1", 1)
        assert crud.labelstudio_setup(s, set_id=set_id, project="7").updated_at >= stamp
    with db.begin() as s:  # given ones replace them
        crud.put_labelstudio_setup(s, set_id=set_id, project="7", url="http://new", token="t2", max_instances=2)
        crud.put_labelstudio_setup(s, set_id=set_id, project="8", url=None, token=None, max_instances=4)
    with db() as s:
        assert setup_of(s, set_id, "7") == ("http://new", "t2", 2)
        assert setup_of(s, set_id, "8") == (None, None, 4)
        assert setup_of(s, other, "7") == ("http://other", "t9", 9)
        assert _count(s, LabelStudioSetup, LabelStudioSetup.exemplar_set_id, set_id) == 2
