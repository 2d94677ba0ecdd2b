"""``app.jobstates``: the job states, declared once and enforced by the database, and each transition's
guard, on SQLite and PostgreSQL (migrated databases: the schema under test is the migrations')."""

import uuid
from datetime import timedelta

import pytest
from service_fixtures import db_settings  # noqa: F401 -- a fixture, used by name
from sqlalchemy import inspect, update
from sqlalchemy.exc import IntegrityError

from app import jobstates
from app.db import make_engine, make_sessionmaker
from app.jobstates import JOB_STATES, JobState
from app.tables import AdaptationJob, Base, Checkpoint, ExemplarSet, utcnow

STATUS_CHECK = "ck_adaptation_jobs_status"


@pytest.fixture
def db(db_settings):  # noqa: F811 -- the fixture imported above
    engine = make_engine(db_settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def new_set(db):
    with db.begin() as s:
        es = ExemplarSet(bundle="b", prototype=b"\0" * 4, prototype_dim=1, num_exemplars=1)
        s.add(es)
        s.flush()
        return es.id


def new_checkpoint(db, set_id):
    with db.begin() as s:
        ckpt = Checkpoint(exemplar_set_id=set_id, kind="adapted", iteration=1, sha256="0" * 64, metrics={})
        s.add(ckpt)
        s.flush()
        return ckpt.id


def set_active(db, set_id, checkpoint_id):
    with db.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == set_id).values(active_checkpoint_id=checkpoint_id))


def active(db, set_id):
    with db() as s:
        return s.get_one(ExemplarSet, set_id).active_checkpoint_id


def new_job(db, set_id, **values):
    with db.begin() as s:
        job = AdaptationJob(exemplar_set_id=set_id, request_sha256="0" * 64, iterations=4, learning_rate=1e-3,
                            seed=0, num_images=1, **values)
        s.add(job)
        s.flush()
        return job.id


def row(db, job_id):
    with db() as s:
        return s.get_one(AdaptationJob, job_id)


def apply(db, transition, **kw):
    with db.begin() as s:
        return transition(s, **kw)


# --- the states


def test_the_states_are_declared_once_in_their_lifecycle_order():
    assert JOB_STATES == ("queued", "running", "succeeded", "failed", "canceled")
    assert jobstates.FINISHED_STATES == ("succeeded", "failed", "canceled")
    assert AdaptationJob.__table__.c.status.default.arg == JobState.QUEUED


def test_the_database_refuses_a_status_that_is_not_a_job_state(db):
    set_id = new_set(db)
    for state in JOB_STATES:  # every declared state is accepted
        assert row(db, new_job(db, set_id, status=state)).status == state
    with pytest.raises(IntegrityError):
        new_job(db, set_id, status="done")
    job_id = new_job(db, set_id)
    with pytest.raises(IntegrityError), db.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(status="Queued"))
    assert row(db, job_id).status == "queued"


def test_the_migrations_and_the_tables_declare_the_same_status_check(db_settings, tmp_path):  # noqa: F811
    def checks(url):
        engine = make_engine(url)
        try:
            return {c["name"]: c["sqltext"] for c in inspect(engine).get_check_constraints("adaptation_jobs")}
        finally:
            engine.dispose()

    migrated = checks(db_settings.database_url)
    created_url = f"sqlite:///{tmp_path}/created.db"
    engine = make_engine(created_url)
    Base.metadata.create_all(engine)
    engine.dispose()
    created = checks(created_url)
    assert set(migrated) == set(created) == {STATUS_CHECK, "ck_adaptation_jobs_activate", "ck_adaptation_jobs_verdict"}
    if db_settings.database_url.startswith("sqlite"):  # PostgreSQL rewrites the expression it reports
        assert migrated == created


# --- each transition's guard


def test_claim_takes_a_queued_job_or_a_run_whose_heartbeat_stopped(db):
    job_id = new_job(db, new_set(db))
    now = utcnow()
    assert apply(db, jobstates.claim, job_id=job_id, worker="a", stale_before=now - timedelta(seconds=9), now=now) == 1
    job = row(db, job_id)
    assert (job.status, job.attempts, job.worker, job.started_at, job.phase) == ("running", 1, "a", now, "setup")
    assert apply(db, jobstates.claim, job_id=job_id, worker="b", stale_before=now, now=now) is None  # beating
    later = now + timedelta(seconds=10)
    assert apply(db, jobstates.claim, job_id=job_id, worker="b", stale_before=later - timedelta(seconds=9),
                 now=later) == 2
    job = row(db, job_id)
    assert (job.status, job.attempts, job.worker, job.started_at) == ("running", 2, "b", now)  # first start kept
    assert apply(db, jobstates.finish_run, job_id=job_id, attempt=2, outcome=JobState.SUCCEEDED,
                 progress_iteration=4, mean_reward=None)
    assert apply(db, jobstates.claim, job_id=job_id, worker="c", stale_before=later + timedelta(hours=1)) is None


def test_a_run_finishes_or_fails_only_under_its_own_fencing_token(db):
    set_id = new_set(db)
    done, failed = new_job(db, set_id, status="running", attempts=2), new_job(db, set_id, status="running", attempts=2)
    finish = dict(outcome=JobState.SUCCEEDED, progress_iteration=4, mean_reward=0.5)
    assert not apply(db, jobstates.finish_run, job_id=done, attempt=1, **finish)  # an older run
    assert not apply(db, jobstates.fail_run, job_id=failed, attempt=3, error="x")  # no such run
    assert row(db, done).status == row(db, failed).status == "running"

    ckpt = new_checkpoint(db, set_id)
    with db.begin() as s:  # the run's phase, and the checkpoint its last sync recorded
        s.execute(update(AdaptationJob).where(AdaptationJob.id.in_([done, failed]))
                  .values(phase="adapting", checkpoint_id=ckpt))
    assert apply(db, jobstates.finish_run, job_id=done, attempt=2, **finish)  # no checkpoint_id, no verdict
    job = row(db, done)
    assert (job.status, job.progress_iteration, job.mean_reward, job.error) == ("succeeded", 4, 0.5, None)
    assert job.finished_at is not None and job.heartbeat_at == job.finished_at
    assert (job.phase, job.checkpoint_id, job.verdict, job.validation) == (None, ckpt, None, None)  # the row's kept
    assert apply(db, jobstates.fail_run, job_id=failed, attempt=2, error="e" * 3000)
    job = row(db, failed)
    assert (job.status, job.error, job.phase) == ("failed", "e" * 2000, None) and job.finished_at is not None
    # a run's checkpoint and its guard's verdict are recorded when given
    judged = new_job(db, set_id, status="running", attempts=1)
    last = new_checkpoint(db, set_id)
    assert apply(db, jobstates.finish_run, job_id=judged, attempt=1, checkpoint_id=last, verdict="improved",
                 validation={"probes": 8}, **finish)
    job = row(db, judged)
    assert (job.checkpoint_id, job.verdict, job.validation) == (last, "improved", {"probes": 8})

    for job_id in (done, failed):  # a finished job stays as it finished
        assert not apply(db, jobstates.finish_run, job_id=job_id, attempt=2, **finish)
        assert not apply(db, jobstates.fail_run, job_id=job_id, attempt=2, error="late")
    assert row(db, failed).error == "e" * 2000
    with pytest.raises(ValueError, match="fail_run"):
        apply(db, jobstates.finish_run, job_id=done, attempt=2, **{**finish, "outcome": JobState.FAILED})


def test_fail_unsent_fails_only_a_queued_job_whose_task_was_never_sent(db):
    set_id = new_set(db)
    unsent, sent = new_job(db, set_id, idempotency_key="k1"), new_job(db, set_id, enqueued_at=utcnow())
    assert not apply(db, jobstates.fail_unsent, job_id=sent, error="broker down")
    assert row(db, sent).status == "queued"
    now = utcnow() - timedelta(minutes=1)
    assert apply(db, jobstates.fail_unsent, job_id=unsent, error="broker down", now=now)
    job = row(db, unsent)
    # the key freed: the client's retry with it makes a new job, not this failed one
    assert (job.status, job.error, job.finished_at, job.idempotency_key) == ("failed", "broker down", now, None)
    assert not apply(db, jobstates.fail_unsent, job_id=unsent, error="again")


def test_cancel_ends_a_queued_job_flags_a_running_one_and_leaves_a_finished_one(db):
    set_id = new_set(db)
    queued, running = new_job(db, set_id), new_job(db, set_id, status="running", attempts=1)
    finished = {state: new_job(db, set_id, status=state) for state in jobstates.FINISHED_STATES}

    assert not apply(db, jobstates.flag_cancel, job_id=queued)
    assert not apply(db, jobstates.cancel_queued, job_id=running)
    assert apply(db, jobstates.request_cancel, job_id=queued)
    job = row(db, queued)
    assert (job.status, job.cancel_requested, job.error) == ("canceled", True, jobstates.CANCELED_ON_REQUEST)
    assert job.finished_at is not None
    assert apply(db, jobstates.request_cancel, job_id=running)
    job = row(db, running)
    assert (job.status, job.cancel_requested, job.finished_at) == ("running", True, None)  # the run stops itself
    for state, job_id in finished.items():
        assert not apply(db, jobstates.request_cancel, job_id=job_id)
        assert (row(db, job_id).status, row(db, job_id).cancel_requested) == (state, False)


def test_the_reaper_requeues_or_fails_only_a_run_still_abandoned(db):
    set_id = new_set(db)
    now = utcnow()
    stale_before = now - timedelta(seconds=60)
    dead = dict(status="running", attempts=1, worker="w", heartbeat_at=now - timedelta(seconds=61),
                enqueued_at=now - timedelta(hours=1), phase="adapting")
    requeued, failed, beating = (new_job(db, set_id, **dead) for _ in range(3))
    never_beat = new_job(db, set_id, **{**dead, "heartbeat_at": None})
    with db.begin() as s:  # the run beat again after the reaper read it
        s.execute(update(AdaptationJob).where(AdaptationJob.id == beating).values(heartbeat_at=now))

    for job_id in (requeued, failed, beating, never_beat):  # a token the reaper did not read
        assert not apply(db, jobstates.requeue_abandoned, job_id=job_id, attempt=2, stale_before=stale_before)
    assert not apply(db, jobstates.requeue_abandoned, job_id=beating, attempt=1, stale_before=stale_before)
    at_bound = new_job(db, set_id, **{**dead, "heartbeat_at": stale_before})  # exactly at the bound: not stale yet
    assert not apply(db, jobstates.requeue_abandoned, job_id=at_bound, attempt=1, stale_before=stale_before)
    assert not apply(db, jobstates.fail_abandoned, job_id=at_bound, attempt=1, stale_before=stale_before, error="x")
    assert not apply(db, jobstates.fail_abandoned, job_id=beating, attempt=1, stale_before=stale_before, error="x")
    assert row(db, beating).status == "running"

    assert apply(db, jobstates.requeue_abandoned, job_id=requeued, attempt=1, stale_before=stale_before)
    assert apply(db, jobstates.requeue_abandoned, job_id=never_beat, attempt=1, stale_before=stale_before)
    for job_id in (requeued, never_beat):
        job = row(db, job_id)
        assert (job.status, job.attempts, job.worker, job.enqueued_at, job.phase) == ("queued", 1, None, None, None)
    assert apply(db, jobstates.fail_abandoned, job_id=failed, attempt=1, stale_before=stale_before, error="lost",
                 now=now)
    job = row(db, failed)
    assert (job.status, job.error, job.finished_at, job.phase) == ("failed", "lost", now, None)
    assert row(db, beating).phase == "adapting"
    assert not apply(db, jobstates.requeue_abandoned, job_id=failed, attempt=1, stale_before=stale_before)


def test_the_reaper_cancels_an_abandoned_run_whose_cancel_was_asked_and_only_that(db):
    set_id = new_set(db)
    now = utcnow()
    stale_before = now - timedelta(seconds=60)
    dead = dict(status="running", attempts=1, worker="w", heartbeat_at=now - timedelta(seconds=61), phase="adapting")
    asked, not_asked = new_job(db, set_id, cancel_requested=True, **dead), new_job(db, set_id, **dead)
    beating = new_job(db, set_id, cancel_requested=True, **{**dead, "heartbeat_at": now})
    assert not apply(db, jobstates.cancel_abandoned, job_id=not_asked, attempt=1, stale_before=stale_before)
    assert not apply(db, jobstates.cancel_abandoned, job_id=beating, attempt=1, stale_before=stale_before)
    assert not apply(db, jobstates.cancel_abandoned, job_id=asked, attempt=2, stale_before=stale_before)
    assert (row(db, not_asked).status, row(db, beating).status, row(db, asked).status) == ("running",) * 3
    assert apply(db, jobstates.cancel_abandoned, job_id=asked, attempt=1, stale_before=stale_before, now=now)
    job = row(db, asked)
    assert (job.status, job.error, job.finished_at, job.phase) == ("canceled", jobstates.CANCELED_ON_REQUEST, now,
                                                                     None)
    assert not apply(db, jobstates.cancel_abandoned, job_id=asked, attempt=1, stale_before=stale_before)


def test_a_job_result_is_activated_only_where_the_set_still_holds_the_jobs_base(db):
    set_id = new_set(db)
    base, rollback, result = (new_checkpoint(db, set_id) for _ in range(3))
    set_active(db, set_id, rollback)  # the user activated another checkpoint while the job ran: it stands
    assert not apply(db, jobstates.activate_job_result, set_id=set_id, checkpoint_id=result, base_checkpoint_id=base)
    assert active(db, set_id) == rollback
    set_active(db, set_id, base)
    assert apply(db, jobstates.activate_job_result, set_id=set_id, checkpoint_id=result, base_checkpoint_id=base)
    assert active(db, set_id) == result
    assert not apply(db, jobstates.activate_job_result, set_id=uuid.uuid4(), checkpoint_id=result,
                     base_checkpoint_id=base)  # no such set

    # a job created while its set had no active checkpoint: NULL compares as a value
    empty, other_empty = new_set(db), new_set(db)
    first, second = new_checkpoint(db, empty), new_checkpoint(db, empty)
    assert apply(db, jobstates.activate_job_result, set_id=empty, checkpoint_id=first, base_checkpoint_id=None)
    assert not apply(db, jobstates.activate_job_result, set_id=empty, checkpoint_id=second, base_checkpoint_id=None)
    assert active(db, empty) == first
    assert active(db, other_empty) is None  # only the job's own set moves
