"""The localize path's read of a set and its active checkpoint (``crud.get_exemplar_set_and_active``): one query,
the calibrations read as text and parsed once per distinct text, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import uuid

from sqlalchemy import inspect, update

from app import crud
from app.db import make_engine, make_sessionmaker
from app.tables import Checkpoint, ExemplarSet

CALIBRATION = {"version": 2, "fit": {"a": -3.25, "b": 1.5}, "templates": {"crops": [[0, 255, 17]] * 40},
               "kind": {"kind": "4", "others": ["0", "9"]}, "note": "caf\u00e9 \u2713"}


def _rows(session, calibration: dict | None) -> tuple[uuid.UUID, uuid.UUID]:  # type: ignore[no-untyped-def]
    es = ExemplarSet(owner="k", name="s", bundle="b", prototype=b"\0" * 8, prototype_dim=2, num_exemplars=1,
                     calibration=calibration)
    session.add(es)
    session.flush()
    ckpt = Checkpoint(exemplar_set_id=es.id, kind="base", iteration=0, sha256="0" * 64, metrics={"m": 1})
    session.add(ckpt)
    session.flush()
    es.active_checkpoint_id = ckpt.id
    return es.id, ckpt.id


def test_the_set_and_its_active_checkpoint_come_back_with_their_calibrations_parsed_once(db_settings):
    engine = make_engine(db_settings.database_url)
    factory = make_sessionmaker(engine)
    with factory.begin() as s:
        set_id, ckpt_id = _rows(s, CALIBRATION)
        bare_id, _ = _rows(s, None)

    with factory() as s:
        es, active = crud.get_exemplar_set_and_active(s, set_id=set_id, owner="k")
        # loaded with the row: reading them after the session ends costs no query (and cannot fail)
        assert "calibration" not in inspect(es).unloaded and "calibration" not in inspect(active).unloaded
    assert es.calibration == CALIBRATION and es.kind == "4" and es.calibrated
    assert active.id == ckpt_id and active.calibration is None and active.metrics == {"m": 1}
    assert not inspect(es).modified  # set as the stored value, not as a change to write back

    with factory() as s:
        again, _ = crud.get_exemplar_set_and_active(s, set_id=set_id, owner="k")
    assert again is not es and again.calibration is es.calibration  # the same text: parsed once, shared

    with factory() as s:
        bare, _ = crud.get_exemplar_set_and_active(s, set_id=bare_id, owner=None)
        assert crud.get_exemplar_set_and_active(s, set_id=set_id, owner="another key") is None
        assert crud.get_exemplar_set_and_active(s, set_id=uuid.uuid4(), owner=None) is None
    assert bare.calibration is None and not bare.calibrated

    # a job calibrates the checkpoint later (worker.jobs writes it once): the next read sees it, no stale value
    refreshed = {**CALIBRATION, "fit": {"a": -1.0, "b": 2.0}}
    with factory.begin() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == ckpt_id).values(calibration=refreshed))
    with factory() as s:
        es2, active2 = crud.get_exemplar_set_and_active(s, set_id=set_id, owner="k")
    assert active2.calibration == refreshed and es2.calibration == CALIBRATION
    engine.dispose()
