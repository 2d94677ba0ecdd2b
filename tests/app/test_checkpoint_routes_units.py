"""``app.routes.checkpoints``' helpers by value: what a checkpoint is shown as, and the 404 a set deleted under a
checkpoint call answers (on SQLite and PostgreSQL). The routes themselves are checked through HTTP in
``test_app_adaptations.py``, ``test_app_exemplar_sets.py`` and the worker's activation tests."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from service_fixtures import new_set, refusal

from app.routes.checkpoints import locked, to_public
from app.tables import Checkpoint


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
