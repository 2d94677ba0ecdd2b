"""``app.routes.checkpoints`` by value, on SQLite and PostgreSQL with a real ``BlobStore``: what a checkpoint is
shown as, each route's body (list, read, activate, delete: another key's 404s, the 409 of one in use, what a deletion
removes) and the 404 a set deleted under a checkpoint call answers. Through HTTP with real jobs:
``test_app_adaptations.py``, ``test_app_exemplar_sets.py``, ``tests/worker/test_worker_jobs.py`` and the worker's
activation tests."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from service_fixtures import new_set, refusal
from sqlalchemy import delete

from app.deps import Caller
from app.routes.checkpoints import activated, checkpoint_of, checkpoints_of, locked, removed, to_public
from app.storage import BlobStore, checkpoint_key
from app.tables import Checkpoint, ExemplarSet


def checkpoint(metrics: dict | None) -> Checkpoint:
    return Checkpoint(id=uuid.uuid4(), exemplar_set_id=uuid.uuid4(), parent_id=uuid.uuid4(), job_id=uuid.uuid4(),
                      kind="adapted", iteration=25, sha256="a" * 64, metrics=metrics,
                      created_at=datetime(2026, 12, 7, 3, 0, tzinfo=UTC))


def test_a_checkpoint_is_shown_with_its_lineage_metrics_and_whether_it_is_the_active_one():
    row = checkpoint({"answers": "paired with its start", "probe_corloc": 81.25})
    shown = to_public(row, row.id)
    assert shown.model_dump() == {
        "id": row.id, "exemplar_set_id": row.exemplar_set_id, "parent_id": row.parent_id, "job_id": row.job_id,
        "kind": "adapted", "iteration": 25, "sha256": "a" * 64,
        "metrics": {"answers": "paired with its start", "probe_corloc": 81.25}, "active": True,
        "created_at": datetime(2026, 12, 7, 3, 0, tzinfo=UTC)}
    assert to_public(row, uuid.uuid4()).active is False and to_public(row, None).active is False
    assert to_public(checkpoint(None), None).metrics == {}  # a row written before metrics were kept


def test_a_set_deleted_under_a_checkpoint_call_is_the_checkpoints_404(db):
    with db() as s:
        assert refusal(locked, s, uuid.uuid4()) == (404, "checkpoint not found")
    set_id = new_set(db)
    with db() as s:
        locked(s, set_id)  # there: its row lock is taken, nothing raised
        s.rollback()


def adapted(db, store: BlobStore, set_id: uuid.UUID, parent: uuid.UUID, iteration: int) -> uuid.UUID:  # type: ignore[no-untyped-def]
    """An adapted checkpoint of ``set_id`` with its file -> its id."""
    blob = checkpoint_key(set_id, "job", iteration)
    store.put(blob, b"weights %d" % iteration)
    with db.begin() as s:
        c = Checkpoint(exemplar_set_id=set_id, parent_id=parent, job_id=None, kind="adapted", iteration=iteration,
                       sha256=f"{iteration:064d}", metrics={"probe_corloc": float(iteration)}, blob=blob)
        s.add(c)
        s.flush()
        return c.id


def lineage(db, store: BlobStore) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID, uuid.UUID]:  # type: ignore[no-untyped-def]
    """A set with its base checkpoint (active) and two adapted ones after it -> (set, base, two, four)."""
    set_id = new_set(db)
    with db() as s:
        base = s.get_one(ExemplarSet, set_id).active_checkpoint_id
    two = adapted(db, store, set_id, base, 2)
    return set_id, base, two, adapted(db, store, set_id, two, 4)


def test_each_checkpoint_routes_body_answers_its_owner_and_refuses_another_key(db, store):
    owner, other = Caller("k"), Caller("someone-else")
    set_id, base, two, four = lineage(db, store)
    with db() as s:
        page = checkpoints_of(set_id, s, owner, 50, 0)
        assert [(c.id, c.kind, c.active) for c in page.data] == [(base, "base", True), (two, "adapted", False),
                                                                  (four, "adapted", False)]
        assert (page.count, page.limit, page.offset) == (3, 50, 0)
        later = checkpoints_of(set_id, s, owner, 1, 1)
        assert [c.id for c in later.data] == [two] and (later.count, later.limit, later.offset) == (3, 1, 1)
        assert refusal(checkpoints_of, set_id, s, other, 50, 0) == (404, "exemplar set not found")
        assert refusal(checkpoints_of, uuid.uuid4(), s, owner, 50, 0) == (404, "exemplar set not found")
        shown = checkpoint_of(four, s, owner)
        assert (shown.id, shown.parent_id, shown.iteration, shown.active, shown.metrics) == (
            four, two, 4, False, {"probe_corloc": 4.0})
        assert checkpoint_of(base, s, owner).active is True
        assert refusal(checkpoint_of, four, s, other) == (404, "checkpoint not found")
        # auth off (no scope): every row is visible
        assert checkpoint_of(four, s, Caller(None)).id == four
    with db() as s:
        assert refusal(activated, four, s, other) == (404, "checkpoint not found")
    with db() as s:
        shown = activated(four, s, owner)
        assert shown.id == set_id and shown.active_checkpoint_id == four
    with db() as s:
        assert s.get_one(ExemplarSet, set_id).active_checkpoint_id == four  # committed
        assert [c.active for c in checkpoints_of(set_id, s, owner, 50, 0).data] == [False, False, True]


def test_a_checkpoint_is_deleted_row_then_file_unless_in_use_and_only_by_its_owner(db, store):
    owner = Caller("k")
    set_id, base, two, four = lineage(db, store)
    with db() as s:
        blob_two = s.get_one(Checkpoint, two).blob
        activated(four, s, owner)
    for cid, why in ((base, "it is the set's base policy"), (four, "it is the set's active checkpoint")):
        with db() as s:
            status, detail = refusal(removed, cid, s, owner, store)
            assert status == 409 and detail.startswith(f"checkpoint {cid} cannot be deleted: {why}"), detail
    with db() as s:
        assert refusal(removed, two, s, Caller("someone-else"), store) == (404, "checkpoint not found")
        assert refusal(removed, uuid.uuid4(), s, owner, store) == (404, "checkpoint not found")
    assert store.exists(blob_two)
    with db() as s:
        removed(two, s, owner, store)
    with db() as s:
        assert s.get(Checkpoint, two) is None and s.get_one(Checkpoint, four).parent_id == base
        assert refusal(checkpoint_of, two, s, owner) == (404, "checkpoint not found")
    assert not store.exists(blob_two)


def test_a_checkpoint_deleted_before_an_activation_takes_the_lock_is_a_404_that_changes_nothing(db, store, monkeypatch):
    import app.routes.checkpoints as routes

    owner = Caller("k")
    set_id = new_set(db)
    with db() as s:
        base = s.get_one(ExemplarSet, set_id).active_checkpoint_id
    two = adapted(db, store, set_id, base, 2)
    def read_then_deleted(session, *, checkpoint_id, owner):  # noqa: ANN001, ANN202 -- read, then deleted by another
        with db() as other:
            row = other.get_one(Checkpoint, checkpoint_id)
            other.expunge(row)
        with db.begin() as other:
            other.execute(delete(Checkpoint).where(Checkpoint.id == checkpoint_id))
        return row

    monkeypatch.setattr(routes.crud, "get_checkpoint", read_then_deleted)
    with db() as s:
        assert refusal(activated, two, s, owner) == (404, "checkpoint not found")
    with db() as s:
        assert s.get_one(ExemplarSet, set_id).active_checkpoint_id == base
