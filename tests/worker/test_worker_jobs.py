"""The job logic without Celery: claim, run ``models.adapt`` with checkpoints, resume, cancel, reap."""

import uuid
from datetime import timedelta

import pytest
import torch
from celery.exceptions import SoftTimeLimitExceeded
from service_fixtures import FAST_JOB, files, png_bytes
from sqlalchemy import select, update

import worker.jobs as jobs_module
from app.inference import read_checkpoint
from app.tables import AdaptationJob, Checkpoint, ExemplarSet, utcnow
from worker import jobs
from worker.context import WorkerContext
from worker.jobs import AdaptationRun, claim_job, run_adaptation_job
from worker.reaper import reap_abandoned_jobs


@pytest.fixture
def ctx(settings):
    c = WorkerContext.create(settings.model_copy(update=FAST_JOB))  # what is checked here needs no more probes
    yield c
    c.engine.dispose()


def new_job(client, set_id=None, **data):
    if set_id is None:
        set_id = client.post("/v1/exemplar-sets", files=files(png_bytes(28, 28, seed=9))).json()["id"]
    data = {"iterations": "5", "seed": "3", "activate": "true", **data}  # true: these tests follow the final checkpoint
    r = client.post(f"/v1/exemplar-sets/{set_id}/adaptations", data=data,
                    files=files(*[png_bytes(84, 84, seed=i) for i in range(3)], png_bytes(120, 90, seed=5)))
    assert r.status_code == 202, r.text
    return r.json()


def checkpoints_of(ctx, job_id):
    with ctx.session_factory() as s:
        return list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == uuid.UUID(job_id))
                              .order_by(Checkpoint.iteration)))


def job_row(ctx, job_id):
    with ctx.session_factory() as s:
        return s.get_one(AdaptationJob, uuid.UUID(job_id))


def test_job_succeeds_with_checkpoints_lineage_and_activation(client, ctx):
    job = new_job(client)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "succeeded" and polled["attempts"] == 1 and polled["error"] is None
    assert polled["progress"]["iteration"] == polled["progress"]["total"] == 5
    assert polled["progress"]["mean_reward"] is not None
    assert polled["started_at"] <= polled["finished_at"]
    assert polled["validation"]["message"].endswith(
        "; activate=true: the last checkpoint (iteration 5) is activated whatever the probes say")

    ckpts = checkpoints_of(ctx, job["id"])
    assert [c.iteration for c in ckpts] == [2, 4, 5]  # every checkpoint_every=2 iterations, and the end
    assert [c.parent_id for c in ckpts] == [uuid.UUID(job["params"]["base_checkpoint_id"]), ckpts[0].id, ckpts[1].id]
    assert polled["checkpoint_id"] == str(ckpts[-1].id)
    assert polled["validation"]["activated_iteration"] == 5
    assert polled["validation"]["activated_checkpoint_id"] == str(ckpts[-1].id)  # named, not only its iteration
    es = client.get(f"/v1/exemplar-sets/{job['exemplar_set_id']}").json()
    assert es["active_checkpoint_id"] == str(ckpts[-1].id)

    public = client.get(f"/v1/checkpoints/{ckpts[-1].id}").json()
    assert public["kind"] == "adapted" and public["active"] and public["job_id"] == job["id"]
    assert set(public["metrics"]) == {"mean_reward", "probe_corloc", "probe_mean_iou", "probe_held_corloc",
                                      "probe_gain", "probe_noise"}
    assert polled["progress"]["mean_reward"] == public["metrics"]["mean_reward"]  # one meaning, running or done
    loaded = ctx.bundles.get(es["bundle"]).bundle
    agent, meta = read_checkpoint(ctx.store, blob=ckpts[-1].blob, sha256=public["sha256"], bundle=loaded)
    assert meta["iteration"] == 5 and set(meta["resume"]) >= {"optimizer", "rng", "iteration"}

    r = client.post(f"/v1/exemplar-sets/{job['exemplar_set_id']}/localize", files=files(png_bytes()))
    assert r.status_code == 200 and r.json()["checkpoint_id"] == str(ckpts[-1].id)

    # a second job starts from the adapted policy: the lineage continues
    second = new_job(client, job["exemplar_set_id"], iterations="2", activate="false")
    assert second["params"]["base_checkpoint_id"] == str(ckpts[-1].id)
    assert run_adaptation_job(ctx, uuid.UUID(second["id"]), worker="test") == "succeeded"
    (only,) = checkpoints_of(ctx, second["id"])
    assert only.parent_id == ckpts[-1].id
    es = client.get(f"/v1/exemplar-sets/{job['exemplar_set_id']}").json()
    assert es["active_checkpoint_id"] == str(ckpts[-1].id)  # activate=false
    message = client.get(f"/v1/adaptations/{second['id']}").json()["validation"]["message"]
    assert message.endswith("; activate=false: nothing is activated")

    # rollback: activate the base checkpoint again
    base = job["params"]["base_checkpoint_id"]
    assert client.post(f"/v1/checkpoints/{base}/activate").json()["active_checkpoint_id"] == base
    r = client.post(f"/v1/exemplar-sets/{job['exemplar_set_id']}/localize", files=files(png_bytes()))
    assert r.json()["checkpoint_id"] == base


def test_a_checkpoint_activated_while_the_job_ran_stands_and_the_job_says_it_did_not_activate(client, ctx,
                                                                                                monkeypatch):
    """A user activates another checkpoint while a job (``activate=true``) runs: that choice stands, and the job's
    record says its checkpoint was not activated (``validation.activated_iteration`` null, the message says why)."""
    first = new_job(client, iterations="2")
    assert run_adaptation_job(ctx, uuid.UUID(first["id"]), worker="test") == "succeeded"
    set_id, (earlier,) = first["exemplar_set_id"], [c.id for c in checkpoints_of(ctx, first["id"])][-1:]
    job = new_job(client, set_id, iterations="2")  # starts from ``earlier``, the active one
    base = job["params"]["base_checkpoint_id"]
    finish = AdaptationRun.finish

    def the_user_rolls_back_first(run, *args, **kwargs):  # after the iterations, before the job's outcome
        assert client.post(f"/v1/checkpoints/{first['params']['base_checkpoint_id']}/activate").status_code == 200
        return finish(run, *args, **kwargs)

    monkeypatch.setattr(AdaptationRun, "finish", the_user_rolls_back_first)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    assert base == str(earlier)
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    es = client.get(f"/v1/exemplar-sets/{set_id}").json()
    assert es["active_checkpoint_id"] == first["params"]["base_checkpoint_id"]  # the rollback stands
    assert polled["validation"]["activated_iteration"] is None
    message = polled["validation"]["message"]
    assert ("; activate=true: the last checkpoint (iteration 2) was to be activated whatever the probes say, but not "
            "activated: the set's active checkpoint changed while the job ran") in message, message
    assert "is activated" not in message  # it was not
    (last,) = [c for c in checkpoints_of(ctx, job["id"]) if c.iteration == 2]
    assert not client.get(f"/v1/checkpoints/{last.id}").json()["active"]


def test_a_set_made_without_a_calibration_gets_its_kind_check_in_its_jobs_calibrations(client, ctx, monkeypatch):
    """A set made in workers mode has no calibration (the API fits none): its job's calibration refresh makes the set's
    known-kinds check with the bundle's verifier from the set's crops, as set creation does in local mode, so the
    checkpoint it serves judges ``found`` by it; a set with a stored calibration keeps its stored check."""
    from models.verifier import KindCheck

    made = []
    check = KindCheck([1.0, 0.0], [[0.0, 1.0]], "4", 0.99, "stub")

    class Verifier:
        def check(self, crops, negative_crops=None):
            made.append(len(crops))
            return check

    monkeypatch.setattr(ctx.bundles, "verifier", lambda name: Verifier())

    def three_crops():  # the NCC fits, which a kind check needs, take two exemplars or more
        r = client.post("/v1/exemplar-sets", files=files(*[png_bytes(28, 28, seed=9 + i) for i in range(3)]))
        return r.json()["id"]

    job = new_job(client, three_crops())
    with ctx.session_factory.begin() as s:  # as workers mode makes it
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(job["exemplar_set_id"]))
                  .values(calibration=None))
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    last = checkpoints_of(ctx, job["id"])[-1]
    assert made == [3] and last.calibration is not None, made
    assert last.calibration.get("kind") == check.to_dict(), sorted(last.calibration)
    made.clear()
    stored = new_job(client, three_crops())  # a set with its calibration (no kind: the API has no verifier)
    assert run_adaptation_job(ctx, uuid.UUID(stored["id"]), worker="test") == "succeeded"
    assert made == [] and "kind" not in checkpoints_of(ctx, stored["id"])[-1].calibration


def test_a_finished_job_is_never_run_again(client, ctx):
    job = new_job(client, iterations="2")
    job_id = uuid.UUID(job["id"])
    assert run_adaptation_job(ctx, job_id, worker="a") == "succeeded"
    assert run_adaptation_job(ctx, job_id, worker="b") == "skipped"
    assert len(checkpoints_of(ctx, job["id"])) == 1 and job_row(ctx, job["id"]).attempts == 1


def test_claim_is_exclusive_while_the_heartbeat_is_fresh(client, ctx):
    job_id = uuid.UUID(new_job(client)["id"])
    assert claim_job(ctx, job_id, worker="a") == 1
    assert claim_job(ctx, job_id, worker="b") is None
    with ctx.session_factory.begin() as s:  # the heartbeat goes stale: the job may be taken over
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id)
                  .values(heartbeat_at=utcnow() - timedelta(seconds=60)))
    assert claim_job(ctx, job_id, worker="b") == 2


class Crash(BaseException):
    """Stands for the process dying: nothing in the job code catches it."""


def test_resume_after_a_crash_continues_from_the_last_checkpoint(client, ctx, monkeypatch):
    job = new_job(client)
    job_id = uuid.UUID(job["id"])
    save = AdaptationRun.save_checkpoint

    def crash_after_the_first_checkpoint(self, iteration, state):
        save(self, iteration, state)
        raise Crash

    monkeypatch.setattr(AdaptationRun, "save_checkpoint", crash_after_the_first_checkpoint)
    with pytest.raises(Crash):
        run_adaptation_job(ctx, job_id, worker="dies")
    monkeypatch.setattr(AdaptationRun, "save_checkpoint", save)
    row = job_row(ctx, job["id"])
    assert row.status == "running" and row.attempts == 1
    assert [c.iteration for c in checkpoints_of(ctx, job["id"])] == [2]

    # nothing happens while the heartbeat is fresh; once stale, the reaper requeues the job
    assert reap_abandoned_jobs(ctx) == ([], [])
    later = utcnow() + timedelta(seconds=ctx.settings.heartbeat_timeout + 1)
    assert reap_abandoned_jobs(ctx, now=later) == ([job_id], [])
    assert job_row(ctx, job["id"]).status == "queued"

    with ctx.session_factory.begin() as s:  # the dead run had gone on past its last checkpoint
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(progress_iteration=3))
    shown = []  # what a client sees: when the rerun starts its setup, and at every progress write
    sync, prepare = AdaptationRun._sync, jobs_module.preprocess  # noqa: SLF001

    def recorded(self):  # noqa: ANN001, ANN202
        sync(self)
        shown.append(job_row(ctx, job["id"]).progress_iteration)

    def setup_starts(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        shown.append(job_row(ctx, job["id"]).progress_iteration)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(AdaptationRun, "_sync", recorded)
    monkeypatch.setattr(jobs_module, "preprocess", setup_starts)
    assert run_adaptation_job(ctx, job_id, worker="second") == "succeeded"
    assert shown[0] == 2 and shown == sorted(shown), shown  # from where it restarts, never backwards
    ckpts = checkpoints_of(ctx, job["id"])
    assert [c.iteration for c in ckpts] == [2, 4, 5]  # nothing lost, nothing written twice
    assert ckpts[1].parent_id == ckpts[0].id
    row = job_row(ctx, job["id"])
    assert row.attempts == 2 and row.checkpoint_id == ckpts[-1].id

    # the resumed run restored agent, optimizer and random state: same weights as an uninterrupted run
    ref = new_job(client, job["exemplar_set_id"], activate="false")
    with ctx.session_factory.begin() as s:  # start from the same policy as the first job
        s.execute(update(AdaptationJob).where(AdaptationJob.id == uuid.UUID(ref["id"]))
                  .values(base_checkpoint_id=uuid.UUID(job["params"]["base_checkpoint_id"])))
    assert run_adaptation_job(ctx, uuid.UUID(ref["id"]), worker="ref") == "succeeded"
    bundle = ctx.bundles.get(ctx.settings.default_bundle).bundle
    resumed = read_checkpoint(ctx.store, blob=ckpts[-1].blob, sha256=ckpts[-1].sha256, bundle=bundle)[0]
    ref_ckpt = checkpoints_of(ctx, ref["id"])[-1]
    straight = read_checkpoint(ctx.store, blob=ref_ckpt.blob, sha256=ref_ckpt.sha256, bundle=bundle)[0]
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_is_deleted_with_its_file_unless_it_is_in_use(client, ctx):
    """DELETE /v1/checkpoints/{id}: an adapted checkpoint and its file go, its child keeps its lineage through its
    parent, the job that wrote it forgets it; the base, the active one and one an unfinished job starts from: 409."""
    job = new_job(client)  # activate=true: its last checkpoint (iteration 5) becomes the active one
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "succeeded"
    two, four, five = checkpoints_of(ctx, job["id"])
    base_id = job["params"]["base_checkpoint_id"]
    for cid, why in ((base_id, "base policy"), (five.id, "active checkpoint")):
        r = client.delete(f"/v1/checkpoints/{cid}")
        assert r.status_code == 409 and why in r.json()["detail"], r.text
    assert client.delete(f"/v1/checkpoints/{uuid.uuid4()}").status_code == 404

    r = client.delete(f"/v1/checkpoints/{four.id}")
    assert r.status_code == 204, r.text
    assert not ctx.store.exists(four.blob) and ctx.store.exists(five.blob)
    assert client.get(f"/v1/checkpoints/{four.id}").status_code == 404
    assert client.get(f"/v1/checkpoints/{five.id}").json()["parent_id"] == str(two.id)  # lineage through its parent
    assert client.post(f"/v1/checkpoints/{four.id}/activate").status_code == 404
    assert client.post(f"/v1/exemplar-sets/{job['exemplar_set_id']}/localize", params={"checkpoint": str(four.id)},
                       files=files(png_bytes())).status_code == 404

    assert client.post(f"/v1/checkpoints/{two.id}/activate").status_code == 200
    assert client.delete(f"/v1/checkpoints/{five.id}").status_code == 204  # no longer active
    assert client.get(f"/v1/adaptations/{job['id']}").json()["checkpoint_id"] is None  # the job forgets it
    listed = client.get(f"/v1/exemplar-sets/{job['exemplar_set_id']}/checkpoints").json()["data"]
    assert [c["id"] for c in listed] == [base_id, str(two.id)]

    queued = new_job(client, job["exemplar_set_id"])  # it starts from the active checkpoint (two)
    assert client.post(f"/v1/checkpoints/{base_id}/activate").status_code == 200
    r = client.delete(f"/v1/checkpoints/{two.id}")  # not active any more, but an unfinished job's start
    assert r.status_code == 409 and queued["id"] in r.json()["detail"], r.text
    assert client.post(f"/v1/adaptations/{queued['id']}/cancel").status_code == 202
    assert client.delete(f"/v1/checkpoints/{two.id}").status_code == 204
    assert client.get(f"/v1/adaptations/{queued['id']}").json()["params"]["base_checkpoint_id"] is None


def test_job_checkpoints_chosen_keeps_what_the_outcome_names_and_deletes_the_rest_with_their_files(client, settings,
                                                                                                   monkeypatch):
    """QLOC_JOB_CHECKPOINTS=chosen: a succeeded job keeps its activated, best and last checkpoints (lineage through
    the deleted ones), the others go with their files; one the user activated meanwhile stays; ``all`` keeps all."""
    chosen = WorkerContext.create(settings.model_copy(update={**FAST_JOB, "job_checkpoints": "chosen"}))
    try:
        job = new_job(client, iterations="9", activate="auto")  # checkpoints at 2, 4, 6, 8 and 9
        sid = job["exemplar_set_id"]
        kept_by_hand = {}

        def the_user_activates_iteration_4(self, ckpt_ids):  # noqa: ANN001, ANN202 -- before the outcome
            four = self.checkpoint_ids[4]
            assert client.post(f"/v1/checkpoints/{four}/activate").status_code == 200
            kept_by_hand["id"] = four
            return {}
        monkeypatch.setattr(AdaptationRun, "_calibrations", the_user_activates_iteration_4)
        assert run_adaptation_job(chosen, uuid.UUID(job["id"]), worker="test") == "succeeded"
        monkeypatch.undo()
        polled = client.get(f"/v1/adaptations/{job['id']}").json()
        written = {c["iteration"] for c in polled["validation"]["checkpoints"]}
        assert written == {2, 4, 6, 8, 9}
        best = polled["validation"]["best"]["iteration"] if polled["validation"]["best"] else None
        want = {4, 9} | ({best} if best in written else set())  # the active one (the user's), the last, the best
        left = checkpoints_of(chosen, job["id"])
        assert {c.iteration for c in left} == want
        assert polled["checkpoint_id"] == str(left[-1].id) and left[-1].iteration == 9
        assert all(chosen.store.exists(c.blob) for c in left)
        files_of_job = {p.name for p in chosen.store.path(left[0].blob).parent.glob("*")}
        assert len(files_of_job) == len(left), files_of_job  # the deleted ones' files are gone
        assert left[0].parent_id == uuid.UUID(job["params"]["base_checkpoint_id"])  # lineage skips the deleted
        assert [c.parent_id for c in left[1:]] == [c.id for c in left[:-1]]
        assert client.get(f"/v1/exemplar-sets/{sid}").json()["active_checkpoint_id"] == str(kept_by_hand["id"])
        for c in left:  # each still serves (its repaired head, stored apart, kept)
            r = client.post(f"/v1/exemplar-sets/{sid}/localize", params={"checkpoint": str(c.id)},
                            files=files(png_bytes()))
            assert r.status_code == 200, r.text
    finally:
        chosen.engine.dispose()
    every = WorkerContext.create(settings.model_copy(update=FAST_JOB))  # the default: all
    try:
        second = new_job(client, sid, iterations="5", activate="false")
        assert run_adaptation_job(every, uuid.UUID(second["id"]), worker="test") == "succeeded"
        assert [c.iteration for c in checkpoints_of(every, second["id"])] == [2, 4, 5]
    finally:
        every.engine.dispose()


def test_cancel_is_honoured_between_iterations(client, ctx):
    job = new_job(client, iterations="50")
    job_id = uuid.UUID(job["id"])
    calls = []

    def cancel_at_iteration_3(iteration, total, mean_reward):
        calls.append(iteration)
        if iteration == 3:
            assert client.get(f"/v1/adaptations/{job['id']}").json()["progress"]["phase"] == "adapting"
            assert client.post(f"/v1/adaptations/{job['id']}/cancel").status_code == 202

    run = AdaptationRun  # cancel arrives through the API while the job runs
    original = run.on_progress

    def on_progress(self, iteration, total, mean_reward):
        cancel_at_iteration_3(iteration, total, mean_reward)
        self._last_sync = 0.0  # check the flag now rather than after progress_every_s
        original(self, iteration, total, mean_reward)

    run.on_progress = on_progress
    try:
        assert run_adaptation_job(ctx, job_id, worker="test") == "canceled"
    finally:
        run.on_progress = original
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "canceled" and polled["cancel_requested"] and calls[-1] < 50
    assert polled["error"] == "canceled on request"
    assert polled["validation"]["message"].endswith(f"; canceled at iteration {polled['progress']['iteration']}: "
                                                    "nothing is activated"), polled["validation"]["message"]
    assert polled["validation"]["activated_checkpoint_id"] is None
    assert [c.iteration for c in checkpoints_of(ctx, job["id"])] == [2]  # kept, but not activated
    es = client.get(f"/v1/exemplar-sets/{job['exemplar_set_id']}").json()
    assert es["active_checkpoint_id"] == job["params"]["base_checkpoint_id"]
    assert client.post(f"/v1/adaptations/{job['id']}/cancel").status_code == 409


def test_cancel_is_honoured_during_the_reward_repair(client, ctx, monkeypatch):
    """A cancel that arrives while the job repairs its reward (stage-1 training on the probes, tens of seconds with
    the service's defaults) stops that training at its next batch: no iteration runs, no checkpoint is written."""
    import models.train.embedding as training

    job = new_job(client, iterations="50")
    batches = []
    loss = training.triplet_loss
    monkeypatch.setattr(training, "triplet_loss", lambda *a, **k: batches.append(1) or loss(*a, **k))
    setup = AdaptationRun._setup

    def cancel_then_set_up(self, *args, **kwargs):
        running = client.get(f"/v1/adaptations/{job['id']}").json()
        assert running["status"] == "running" and running["progress"]["phase"] == "setup", running["progress"]
        assert client.post(f"/v1/adaptations/{job['id']}/cancel").status_code == 202  # the job runs: a request
        self._last_sync = 0.0  # read the flag at the next check rather than after progress_every_s
        return setup(self, *args, **kwargs)

    monkeypatch.setattr(AdaptationRun, "_setup", cancel_then_set_up)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "canceled"
    assert batches == []  # stopped before its first training batch
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "canceled" and polled["error"] == "canceled on request"
    assert polled["progress"]["iteration"] == 0 and checkpoints_of(ctx, job["id"]) == []
    assert polled["progress"]["phase"] is None and job_row(ctx, job["id"]).phase is None  # not running


def test_a_shutdown_that_breaks_a_database_call_is_a_lost_run_not_a_failed_job(client, ctx, monkeypatch):
    """A cold shutdown raised ``SystemExit`` inside psycopg; the cleanup then raised the driver's own error, which
    failed the job for good. The interruption behind it is raised instead: the job stays running (the worker's
    ``on_failure`` expires its lease, the reaper requeues it) and resumes from its last checkpoint."""
    job = new_job(client)
    save = AdaptationRun.save_checkpoint

    def shut_down(self, iteration, state):
        save(self, iteration, state)
        try:
            raise SystemExit(-241)
        except SystemExit:
            raise RuntimeError("can't change 'autocommit' now: connection in transaction status ACTIVE")  # noqa: B904

    monkeypatch.setattr(AdaptationRun, "save_checkpoint", shut_down)
    with pytest.raises(SystemExit):
        run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="stopping")
    row = job_row(ctx, job["id"])
    assert row.status == "running" and row.error is None
    assert [c.iteration for c in checkpoints_of(ctx, job["id"])] == [2]


def test_soft_time_limit_fails_the_job_and_keeps_checkpoints(client, ctx, monkeypatch):
    job = new_job(client)
    save = AdaptationRun.save_checkpoint

    def time_is_up(self, iteration, state):
        save(self, iteration, state)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(AdaptationRun, "save_checkpoint", time_is_up)
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "failed"
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "failed" and "time limit" in polled["error"] and polled["finished_at"]
    assert [c.iteration for c in checkpoints_of(ctx, job["id"])] == [2]


def test_a_run_that_lost_its_lease_writes_nothing(client, ctx):
    job = new_job(client)
    job_id = uuid.UUID(job["id"])
    assert claim_job(ctx, job_id, worker="slow") == 1
    later = utcnow() + timedelta(seconds=ctx.settings.heartbeat_timeout + 1)
    assert reap_abandoned_jobs(ctx, now=later) == ([job_id], [])
    assert claim_job(ctx, job_id, worker="new") == 2
    with pytest.raises(jobs.LeaseLost):
        AdaptationRun(ctx, job_id, attempt=1).execute()
    assert checkpoints_of(ctx, job["id"]) == []
    row = job_row(ctx, job["id"])
    assert row.status == "running" and row.worker == "new"


@pytest.mark.parametrize("attempts", [1, 3])
def test_a_job_whose_cancel_was_asked_before_its_worker_died_is_canceled_not_resumed(client, ctx, attempts):
    """The cancel was accepted while the job ran (202, ``cancel_requested``), then its worker died: the reaper marks
    it canceled rather than queueing it to resume (where it sat while no worker ran, holding its pool images) or
    failing it for the lost worker."""
    job = new_job(client)
    job_id = uuid.UUID(job["id"])
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(
            status="running", attempts=attempts, heartbeat_at=utcnow() - timedelta(hours=1)))
    assert client.post(f"/v1/adaptations/{job['id']}/cancel").json()["cancel_requested"] is True
    assert reap_abandoned_jobs(ctx) == ([], [])
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "canceled" and polled["error"] == "canceled on request" and polled["finished_at"]
    assert claim_job(ctx, job_id, worker="late") is None  # never run again


def test_jobs_abandoned_too_often_fail(client, ctx):
    job = new_job(client)
    job_id = uuid.UUID(job["id"])
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == job_id).values(
            status="running", attempts=ctx.settings.max_job_attempts, heartbeat_at=utcnow() - timedelta(hours=1)))
    assert reap_abandoned_jobs(ctx) == ([], [job_id])
    polled = client.get(f"/v1/adaptations/{job['id']}").json()
    assert polled["status"] == "failed" and "worker lost" in polled["error"]

    # a redelivered task past the attempt budget fails the job too
    other = uuid.UUID(new_job(client, job["exemplar_set_id"])["id"])
    with ctx.session_factory.begin() as s:
        s.execute(update(AdaptationJob).where(AdaptationJob.id == other)
                  .values(attempts=ctx.settings.max_job_attempts))
    assert run_adaptation_job(ctx, other, worker="test") == "failed"


def test_a_job_of_a_deleted_bundle_fails_with_the_reason(client, ctx, settings):
    job = new_job(client, iterations="2")
    with ctx.session_factory.begin() as s:
        s.execute(update(ExemplarSet).where(ExemplarSet.id == uuid.UUID(job["exemplar_set_id"]))
                  .values(bundle="gone"))
    assert run_adaptation_job(ctx, uuid.UUID(job["id"]), worker="test") == "failed"
    assert "unknown bundle 'gone'" in client.get(f"/v1/adaptations/{job['id']}").json()["error"]
