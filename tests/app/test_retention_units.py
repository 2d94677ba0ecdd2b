"""``app.retention`` by value, on SQLite and PostgreSQL with a real ``BlobStore``: which checkpoints and files go and
which stay. A bug here loses data (a head file a checkpoint still needs, a checkpoint a job starts from) or leaks
storage, and the routes' and jobs' tests reach it only through real jobs (``test_worker_jobs.py``,
``test_worker_reward_repair.py``): these pin each rule in milliseconds (``scripts/mutation.py``'s ``retention``)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import timedelta

import torch
from service_fixtures import new_job, new_set
from sqlalchemy import select, update

from app import retention
from app.jobstates import JobState
from app.storage import BlobStore, checkpoint_key, head_key, heads_prefix
from app.tables import AdaptationJob, Checkpoint, ExemplarSet, utcnow


def head(store: BlobStore, set_id: uuid.UUID, name: str, *, age_s: float = 0.0) -> str:
    """A head file stored apart (its content does not matter here), written ``age_s`` seconds ago -> its key."""
    key = head_key(set_id, name)
    store.put(key, b"head " + name.encode())
    then = time.time() - age_s
    os.utime(store.path(key), (then, then))
    return key


def new_checkpoint(db, store: BlobStore, set_id: uuid.UUID, job_id: uuid.UUID | None, iteration: int, *,  # type: ignore[no-untyped-def]
                   heads: tuple[str, ...] = ()) -> uuid.UUID:
    """An adapted checkpoint whose file refers to ``heads`` (the reward's, then its start's, as format 6 does)."""
    blob = checkpoint_key(set_id, job_id or "none", iteration)
    reward = {"head_ref": {"key": head_key(set_id, heads[0]), "sha256": heads[0]}} if heads else {}
    if len(heads) > 1:
        reward["start"] = {"head_ref": {"key": head_key(set_id, heads[1]), "sha256": heads[1]}}
    path = store.path(blob)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format_version": 6, "reward": reward or None}, path)
    with db.begin() as s:
        c = Checkpoint(exemplar_set_id=set_id, parent_id=None, job_id=job_id, kind="adapted", iteration=iteration,
                       sha256="c" * 64, metrics={}, blob=blob)
        s.add(c)
        s.flush()
        return c.id


def checkpoints(db, set_id: uuid.UUID) -> set[int]:  # type: ignore[no-untyped-def]
    with db() as s:
        return set(s.scalars(select(Checkpoint.iteration).where(Checkpoint.exemplar_set_id == set_id,
                                                                Checkpoint.kind == "adapted")))


def remove(db, store: BlobStore, set_id: uuid.UUID, ids: list[uuid.UUID]) -> int:  # type: ignore[no-untyped-def]
    with db() as s:
        rows = [s.get_one(Checkpoint, i) for i in ids]
        return retention.remove_checkpoints(s, store, set_id, rows)


def heads_left(store: BlobStore, set_id: uuid.UUID) -> set[str]:
    folder = store.path(heads_prefix(set_id))
    return {p.stem for p in folder.glob("*.pt")} if folder.is_dir() else set()


def test_removed_checkpoints_go_with_their_files_and_the_heads_no_other_checkpoint_names(db, store):
    sid, other = new_set(db), new_set(db)
    for name in ("shared", "mine", "start", "stray"):
        head(store, sid, name)
    head(store, other, "mine")  # another set's head of the same name
    one = new_checkpoint(db, store, sid, None, 1, heads=("mine", "shared"))
    two = new_checkpoint(db, store, sid, None, 2, heads=("shared", "start"))
    three = new_checkpoint(db, store, sid, None, 3, heads=("start",))
    theirs = new_checkpoint(db, store, other, None, 1, heads=("mine",))
    with db() as s:
        blob_of = {c: s.get_one(Checkpoint, c).blob for c in (one, two, three, theirs)}

    assert remove(db, store, sid, [one]) == 1
    assert checkpoints(db, sid) == {2, 3} and checkpoints(db, other) == {1}
    assert not store.exists(blob_of[one]) and store.exists(blob_of[two]) and store.exists(blob_of[three])
    assert heads_left(store, sid) == {"shared", "start"}  # "mine" was only one's; "stray" no checkpoint's
    assert heads_left(store, other) == {"mine"} and store.exists(blob_of[theirs])

    assert remove(db, store, sid, [two, three]) == 2
    assert checkpoints(db, sid) == set() and heads_left(store, sid) == set()
    assert remove(db, store, sid, []) == 0


def test_rows_are_committed_before_any_file_is_deleted(db, store):
    sid = new_set(db)
    ckpt = new_checkpoint(db, store, sid, None, 1)
    seen = []
    real_delete = BlobStore.delete

    def delete(self, key):  # noqa: ANN001, ANN202
        with db() as other:  # another connection sees the row gone already
            seen.append((key, other.get(Checkpoint, ckpt)))
        real_delete(self, key)

    store.delete = delete.__get__(store)
    assert remove(db, store, sid, [ckpt]) == 1
    assert seen == [(checkpoint_key(sid, "none", 1), None)]


def test_a_checkpoint_without_a_file_key_deletes_no_file(db, store):
    sid = new_set(db)
    ckpt = new_checkpoint(db, store, sid, None, 1)
    with db.begin() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == ckpt).values(blob=""))
    deleted = []
    store.delete = deleted.append
    assert remove(db, store, sid, [ckpt]) == 1 and deleted == [] and checkpoints(db, sid) == set()


def test_heads_written_since_an_unfinished_job_began_are_kept_with_a_clock_margin(db, store):
    """A running job's checkpoint may not name the head it just wrote yet: heads written after the set's oldest
    unfinished job was created (less ``HEAD_CLOCK_MARGIN_S``) stay; older unused ones go."""
    sid, other = new_set(db), new_set(db)
    assert retention.HEAD_CLOCK_MARGIN_S == 60.0
    done = new_job(db, sid, status=JobState.SUCCEEDED)  # finished jobs do not hold heads, however long ago they began
    with db.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == done)
                  .values(created_at=utcnow() - timedelta(hours=2)))
    ckpt = new_checkpoint(db, store, sid, done, 1)
    new_job(db, other)  # nor do another set's unfinished ones
    head(store, sid, "old", age_s=3600)
    assert remove(db, store, sid, [ckpt]) == 1 and heads_left(store, sid) == set()

    ckpt = new_checkpoint(db, store, sid, done, 2)
    job = new_job(db, sid, status=JobState.RUNNING)
    with db.begin() as s:  # the unfinished job began ten minutes ago
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job)
                  .values(created_at=utcnow() - timedelta(seconds=600)))
    head(store, sid, "before_the_job", age_s=600 + 120)  # written two minutes before it: unused, goes
    head(store, sid, "within_the_margin", age_s=600 + 30)  # 30 s before it: another clock's "after"
    head(store, sid, "during_the_job", age_s=10)
    assert remove(db, store, sid, [ckpt]) == 1
    assert heads_left(store, sid) == {"within_the_margin", "during_the_job"}


def test_drop_unused_heads_on_its_own(db, store, caplog):
    sid = new_set(db)
    retention.drop_unused_heads(store, sid, [])  # no heads folder: nothing to do, no error
    for name in ("a", "b", "c"):
        head(store, sid, name, age_s=100)
    notes = store.path(heads_prefix(sid)) / "README.txt"
    notes.write_text("not a head")
    used = new_checkpoint(db, store, sid, None, 1, heads=("a",))
    with db() as s:
        blob = s.get_one(Checkpoint, used).blob
    retention.drop_unused_heads(store, sid, [blob], before=time.time() - 1000)  # all written after: kept
    assert heads_left(store, sid) == {"a", "b", "c"}
    retention.drop_unused_heads(store, sid, [blob], before=time.time() - 50)  # written before it, unused: go
    assert heads_left(store, sid) == {"a"} and notes.exists()  # only heads are collected
    head(store, sid, "on_the_second")
    os.utime(store.path(head_key(sid, "on_the_second")), (1_000_000, 1_000_000))
    retention.drop_unused_heads(store, sid, [blob], before=1_000_000.0)  # not written *before* it: kept
    assert heads_left(store, sid) == {"a", "on_the_second"}
    store.delete(head_key(sid, "on_the_second"))

    head(store, sid, "b")
    store.path(blob).write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING, logger="app.retention"):
        retention.drop_unused_heads(store, sid, [blob])
    assert heads_left(store, sid) == {"a", "b"}  # an unreadable checkpoint: every head is kept
    assert f"checkpoint file {blob} unreadable" in caplog.text
    store.delete(blob)
    retention.drop_unused_heads(store, sid, [blob])  # a missing one too
    assert heads_left(store, sid) == {"a", "b"}


def test_keep_only_keeps_what_was_chosen_and_what_is_in_use(db, store, caplog):
    sid = new_set(db)
    job = new_job(db, sid, status=JobState.SUCCEEDED)
    earlier = new_job(db, sid, status=JobState.SUCCEEDED)
    for name in ("h2", "h4", "h6", "h8"):
        head(store, sid, name, age_s=3600)
    mine = {i: new_checkpoint(db, store, sid, job, i, heads=(f"h{i}",)) for i in (2, 4, 6, 8)}
    new_checkpoint(db, store, sid, earlier, 1)
    with db.begin() as s:  # 4 made active meanwhile; a queued job starts from 6
        s.execute(update(ExemplarSet).where(ExemplarSet.id == sid).values(active_checkpoint_id=mine[4]))
    queued = new_job(db, sid)
    with db.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == queued).values(base_checkpoint_id=mine[6]))

    with caplog.at_level(logging.INFO, logger="app.retention"):
        retention.keep_only(db, store, set_id=sid, job_id=job, chosen={mine[8]})
    assert checkpoints(db, sid) == {1, 4, 6, 8}  # 2 went; the other job's is not this job's to delete
    assert not store.exists(checkpoint_key(sid, job, 2)) and store.exists(checkpoint_key(sid, job, 8))
    assert heads_left(store, sid) == {"h4", "h6", "h8"}  # the deleted one's head went with it
    assert f"job {job}: 1 of its checkpoints deleted (QLOC_JOB_CHECKPOINTS=chosen), 3 kept" in caplog.text


def test_keep_only_never_raises(db, store, caplog, monkeypatch):
    sid = new_set(db)
    job = new_job(db, sid, status=JobState.SUCCEEDED)
    new_checkpoint(db, store, sid, job, 2)
    retention.keep_only(db, store, set_id=uuid.uuid4(), job_id=job, chosen=set())  # a set deleted meanwhile
    assert checkpoints(db, sid) == {2}

    def broken(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError("disk gone")

    monkeypatch.setattr(retention, "remove_checkpoints", broken)
    with caplog.at_level(logging.ERROR, logger="app.retention"):
        retention.keep_only(db, store, set_id=sid, job_id=job, chosen=set())  # logged, not raised
    assert f"job {job}: its unchosen checkpoints were not deleted" in caplog.text
    assert checkpoints(db, sid) == {2}
