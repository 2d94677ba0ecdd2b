"""Adaptation jobs, without Celery: claim a job row, run ``models.adapt`` with checkpoints, finish.

A run owns its job through a lease: claiming makes the job ``running`` and increments ``attempts``,
whose value is the run's fencing token; every later write of the run requires it (``app.jobstates``
owns the state changes and their guards). A heartbeat thread renews the lease. The reaper
(``worker.reaper``) requeues a job whose heartbeat stopped, and the next run resumes from the job's
latest checkpoint, so a job killed with its worker continues where it was and no checkpoint is
written twice (``(job_id, iteration)`` is unique).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session
from torch import Tensor

from app import jobstates, retention
from app.images import open_stored
from app.inference import (
    bundle_for_set,
    prototype_from_bytes,
    read_checkpoint,
    read_served_checkpoint,
    store_head,
)
from app.jobstates import JobState
from app.storage import checkpoint_key, head_key
from app.tables import AdaptationJob, Checkpoint, ExemplarSet, JobImage, utcnow
from models.adapt import AdaptConfig, adapt
from models.bundle import Bundle, HeadRef, Reward, Start, policy_to_bytes
from models.guard import Guard, GuardConfig
from models.inference import preprocess
from models.repair import Guarded, RepairConfig, guarded_setup, pairs_start, probe_style
from models.train.embedding import Interrupted
from worker.calibrations import refreshed_calibrations
from worker.context import WorkerContext
from worker.probes import set_examples

log = logging.getLogger(__name__)


class LeaseLost(Exception):  # noqa: N818 -- a condition, not a crash
    """Another run owns the job now (the reaper gave it away): stop without writing anything."""


def claim_job(ctx: WorkerContext, job_id: uuid.UUID, *, worker: str) -> int | None:
    """Take a queued job (or a running one whose worker stopped beating) -> its fencing token, or None."""
    now = utcnow()
    stale = now - timedelta(seconds=ctx.settings.heartbeat_timeout)
    with ctx.session_factory.begin() as s:
        return jobstates.claim(s, job_id=job_id, worker=worker, stale_before=stale, now=now)


class Heartbeat:
    """Renews the run's lease every ``interval`` seconds from a thread, until stopped."""

    def __init__(self, ctx: WorkerContext, job_id: uuid.UUID, attempt: int):
        self.ctx, self.job_id, self.attempt = ctx, job_id, attempt
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.ctx.settings.heartbeat_interval):
            try:
                with self.ctx.session_factory.begin() as s:
                    res = s.execute(update(AdaptationJob).where(jobstates.lease_held(self.job_id, self.attempt))
                                    .values(heartbeat_at=utcnow()))
                if res.rowcount != 1:  # type: ignore[attr-defined]
                    self.lost = True
                    return
            except Exception:  # a database hiccup: try again at the next beat
                log.exception("heartbeat of job %s failed", self.job_id)


class AdaptationRun:
    """One run of one job under one lease; the callbacks ``adapt`` calls write progress and checkpoints."""

    progress_every_s = 0.5
    """Progress rows and cancel checks at most this often (``adapt`` calls back every iteration)."""

    def __init__(self, ctx: WorkerContext, job_id: uuid.UUID, attempt: int):
        self.ctx, self.job_id, self.attempt = ctx, job_id, attempt
        self.heartbeat: Heartbeat | None = None
        self.cancel = False
        self.lost = False
        self.mean_reward: float | None = None
        self.iteration = 0
        self.phase = "setup"  # as the claim wrote it (app.tables.PHASES)
        self._last_sync = 0.0
        self.guard: Guard | None = None
        self.setup: Guarded | None = None
        self.reward_head: dict[str, Tensor] | None = None
        self.checkpoint_ids: dict[int, uuid.UUID] = {}
        self._heads: list[tuple[dict[str, Tensor], HeadRef]] = []
        """The heads stored apart so far, with their references (``_store_head``)."""
        self.voters: list[dict[str, Tensor]] = []
        """The agents of this job's checkpoints written so far, oldest first (a format-5 checkpoint carries them)."""

    # --- the run

    def execute(self) -> str:
        ctx = self.ctx
        with ctx.session_factory() as s:
            job = s.get_one(AdaptationJob, self.job_id)
            es = s.get_one(ExemplarSet, job.exemplar_set_id)
            images = list(s.scalars(select(JobImage).where(JobImage.job_id == self.job_id)
                                    .order_by(JobImage.position)))
            start = s.get(Checkpoint, job.base_checkpoint_id) if job.base_checkpoint_id else None
            latest = s.scalars(select(Checkpoint).where(Checkpoint.job_id == self.job_id)
                               .order_by(Checkpoint.iteration.desc()).limit(1)).first()
        self.job, self.exemplar_set = job, es
        bundle = bundle_for_set(ctx.bundles, es).bundle  # refuses a set whose bundle file was replaced

        agent_state = None  # None = the bundle's base policy
        start_reward = None  # a start checkpoint adapted on a repaired reward runs with its head and prototype
        if start is not None and start.kind != "base":
            agent_state, start_reward = read_served_checkpoint(ctx.store, blob=start.blob or "", sha256=start.sha256,
                                                               bundle=bundle)
        resume = None
        self.parent_id = start.id if start is not None else None
        self.last_checkpoint_id: uuid.UUID | None = None
        self.last_iteration = 0
        if latest is not None:  # a redelivered job: continue from its latest checkpoint
            agent, meta = read_checkpoint(ctx.store, blob=latest.blob or "", sha256=latest.sha256, bundle=bundle)
            resume = {**meta["resume"], "agent": agent}
            self.parent_id = self.last_checkpoint_id = latest.id
            self.last_iteration = self.iteration = latest.iteration
            self.mean_reward = latest.metrics.get("mean_reward")
            log.info("job %s resumes from checkpoint %s at iteration %d", self.job_id, latest.id, latest.iteration)
        if self.attempt > 1:  # a rerun's progress is where it restarts (the last run's may be past its last checkpoint)
            self._sync()
        self.bundle = bundle

        # Decoded as the API decodes uploads: upright (EXIF orientation), downscaled to decode_max_side.
        pils = [open_stored(ctx.store.read_verified(im.blob, im.sha256), max_side=ctx.settings.decode_max_side).image
                for im in images]
        images01, _ = preprocess(pils, bundle.config.input)  # [N, C, S, S] in [0, 1], as localize sees them
        self.images01 = images01  # also the backgrounds of the calibration refresh (``finish``)
        prototype = prototype_from_bytes(es.prototype)
        if start_reward is not None:
            bundle, prototype = bundle.with_head(start_reward.head, start_reward.refine), start_reward.prototype.float()
        pair = None  # the start as it is served, for checkpoints to carry where this job's repair is kept
        if pairs_start(self.ctx.settings.pair_start, bundle):
            pair = Start(prototype.float(), agent_state, start_reward.head if start_reward else None,
                         start_reward.refine if start_reward else False,
                         consensus=() if self.ctx.settings.pair_rule == "consensus" else None)
        try:
            self.setup = self._setup(bundle, prototype, images01, agent_state, pair)
        except Interrupted:
            if self.lost or (self.heartbeat is not None and self.heartbeat.lost):
                raise LeaseLost from None
            return self.finish(JobState.CANCELED, error=jobstates.CANCELED_ON_REQUEST)
        # The head this job's checkpoints are served with: the one repaired now, else the start checkpoint's.
        self.reward_head = (self.setup.repair.head if self.setup.repair is not None and self.setup.repair.kept
                            else start_reward.head if start_reward is not None else None)
        self.guard = self.setup.guard
        bundle, prototype = self.setup.bundle, self.setup.prototype  # the repaired reward, when it was kept
        if self.last_iteration < job.iterations and not self.guard.should_stop:
            self.phase = "adapting"
            self._sync()
            cfg = AdaptConfig(iterations=job.iterations, lr=job.learning_rate, seed=job.seed,
                              checkpoint_every=ctx.settings.checkpoint_every,
                              batch_size=min(ctx.settings.adapt_batch_size, len(images)))
            result = adapt(bundle, prototype, images01, cfg, agent_state=agent_state,
                           resume=resume, on_progress=self.on_progress, on_checkpoint=self.on_checkpoint,
                           should_stop=self.should_stop, device=ctx.settings.device, scorer=self.setup.scorer)
            if self.lost or (self.heartbeat is not None and self.heartbeat.lost):
                raise LeaseLost
            if result.stopped and not self.guard.should_stop:
                return self.finish(JobState.CANCELED, error=jobstates.CANCELED_ON_REQUEST)
            if result.iteration > self.last_iteration:  # adapt did not checkpoint its final state
                self.save_checkpoint(result.iteration, {"iteration": result.iteration, "agent": result.agent_state})
        return self.finish(JobState.SUCCEEDED)

    def _setup(self, bundle: Bundle, prototype: Tensor, images01: Tensor,
               agent_state: dict[str, Tensor] | None, start: Start | None) -> Guarded:
        """The job's reward (repaired when ``QLOC_REWARD_REPAIR`` is on and the probes confirm it; with
        ``QLOC_REWARD_CHOICE``, the policy may adapt on another candidate, ``models.repair``), its probes and
        its guard, with the starting policy scored; a resumed run rebuilds them (seeded: the same) and re-scores
        the checkpoints the job already wrote (the guard's record is rebuilt, not stored half-way)."""
        ctx = self.ctx
        with ctx.session_factory() as s:
            crops, labeled = set_examples(s, ctx.store, set_id=self.exemplar_set.id, spec=bundle.config.input,
                                          max_side=ctx.settings.decode_max_side)
            done = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == self.job_id)
                                  .order_by(Checkpoint.iteration)))
        repair = (RepairConfig(epochs=ctx.settings.repair_epochs) if ctx.settings.reward_repair else None)
        setup = guarded_setup(bundle, prototype, crops, images01, agent_state, synthetic=ctx.settings.synthetic_probes,
                              generator_seed=self.job.seed, labeled=labeled, repair=repair,
                              guard_cfg=GuardConfig(patience=ctx.settings.early_stop_patience,
                                                    labeled_rule=ctx.settings.labeled_rule),
                              choice=ctx.settings.reward_choice, start=start,
                              probe_style=probe_style(ctx.settings.probe_style, bundle),
                              should_stop=self.should_stop)  # a cancel during repair's training: honoured there
        if setup.repair is not None:
            log.info("job %s: reward repair %s (probe OrdAcc %s -> %s)", self.job_id,
                     "kept" if setup.repair.kept else "not kept", setup.repair.record["before"]["ordacc"],
                     setup.repair.record["after"]["ordacc"])
        if setup.choice is not None:
            log.info("job %s: reward chosen on the probes: %s (%s)", self.job_id, setup.choice.chosen,
                     setup.choice.faithfulness)
        for ckpt in done:
            agent = read_checkpoint(ctx.store, blob=ckpt.blob or "", sha256=ckpt.sha256, bundle=bundle)[0]
            setup.guard.observe(ckpt.iteration, agent)
            self.checkpoint_ids[ckpt.iteration] = ckpt.id
            self.voters.append(agent)
        return setup

    def reward(self) -> Reward | None:
        """The reward this job's checkpoints carry: a repaired head (this job's, or its start's) is served with the
        policy it trained, paired with the job's start where the setup pairs them; ``None``: the bundle's head."""
        if self.setup is None or self.reward_head is None:
            return None
        start = self.setup.start
        if start is not None and start.consensus is not None:  # format 5: the checkpoints written before vote too
            start = replace(start, consensus=tuple(self.voters))
        return Reward(self.reward_head, self.setup.prototype, refine=self.setup.bundle.refine, start=start)

    # --- callbacks from ``adapt``

    def on_progress(self, iteration: int, total: int, mean_reward: float) -> None:
        self.iteration, self.mean_reward = iteration, float(mean_reward)
        if time.monotonic() - self._last_sync >= self.progress_every_s or iteration >= total:
            self._sync()

    def should_stop(self) -> bool:
        if time.monotonic() - self._last_sync >= self.progress_every_s:
            self._sync()
        stop_early = self.guard is not None and self.guard.should_stop  # the probes kept falling
        return self.cancel or self.lost or (self.heartbeat is not None and self.heartbeat.lost) or stop_early

    def on_checkpoint(self, state: dict[str, Any]) -> None:
        self.save_checkpoint(int(state["iteration"]), state)

    # --- writes

    def _sync(self) -> None:
        """Write progress (and renew the lease); read the cancel flag."""
        self._last_sync = time.monotonic()
        with self.ctx.session_factory.begin() as s:
            res = s.execute(update(AdaptationJob).where(jobstates.lease_held(self.job_id, self.attempt)).values(
                progress_iteration=self.iteration, mean_reward=self.mean_reward, phase=self.phase,
                heartbeat_at=utcnow()))
            if res.rowcount != 1:  # type: ignore[attr-defined]
                self.lost = True
                return
            self.cancel = bool(s.scalar(select(AdaptationJob.cancel_requested)
                                        .where(AdaptationJob.id == self.job_id)))

    def save_checkpoint(self, iteration: int, state: dict[str, Any]) -> None:
        """File first (atomic), then its row; a run never rewrites an iteration it already recorded."""
        if iteration <= self.last_iteration:
            return
        es = self.exemplar_set
        key = checkpoint_key(es.id, self.job_id, iteration)
        metrics: dict[str, Any] = {"mean_reward": self.mean_reward}
        if self.guard is not None:  # the checkpoint's probe scores (flat: the API lists metrics as numbers)
            rec = self.guard.observe(iteration, state["agent"])
            metrics.update({"probe_corloc": rec["select"]["corloc"], "probe_mean_iou": rec["select"]["mean_iou"],
                            "probe_held_corloc": rec["held"]["corloc"], "probe_gain": rec["gain"],
                            "probe_noise": rec["noise"]})
        meta = {"job_id": str(self.job_id), "iteration": iteration, "metrics": metrics,
                "resume": {k: v for k, v in state.items() if k != "agent"}}
        with self.ctx.session_factory.begin() as s:  # check the lease before touching the file
            if not self._still_owned(s):
                raise LeaseLost
        if self.setup is not None and self.setup.start is not None:
            metrics["answers"] = ("paired with its start" if self.setup.start.consensus is None
                                  else "consensus of its start and its job's checkpoints")
        sha = self.ctx.store.put(key, policy_to_bytes(state["agent"], bundle_name=self.bundle.name, meta=meta,
                                                      bundle_sha256=self.bundle.sha256,
                                                      prototype_dim=self.bundle.prototype_dim, reward=self.reward(),
                                                      store_head=self._store_head))
        ckpt_id = uuid.uuid4()
        with self.ctx.session_factory.begin() as s:
            if not self._still_owned(s):
                raise LeaseLost
            s.add(Checkpoint(id=ckpt_id, exemplar_set_id=es.id, parent_id=self.parent_id, job_id=self.job_id,
                             kind="adapted", iteration=iteration, sha256=sha, metrics=metrics, blob=key))
            s.flush()
            s.execute(update(AdaptationJob).where(AdaptationJob.id == self.job_id).values(
                checkpoint_id=ckpt_id, progress_iteration=iteration, mean_reward=self.mean_reward,
                heartbeat_at=utcnow()))
        self.parent_id = self.last_checkpoint_id = ckpt_id
        self.last_iteration = self.iteration = iteration
        self.checkpoint_ids[iteration] = ckpt_id
        self.voters.append(state["agent"])

    def _store_head(self, head: dict[str, Tensor]) -> HeadRef:
        """A reward's head stored once for all of this job's checkpoints (format 6: 84-86 % of a checkpoint's
        bytes), in the set's folder (a job that starts from one of them shares its start's head file)."""
        for known, ref in self._heads:
            if known is head:
                return ref
        ref = store_head(self.ctx.store, lambda sha: head_key(self.exemplar_set.id, sha), head)
        self._heads.append((head, ref))
        return ref

    def _calibrations(self, ckpt_ids: set[uuid.UUID | None]) -> dict[uuid.UUID, dict[str, Any]]:
        return refreshed_calibrations(self, ckpt_ids)

    def _still_owned(self, s: Session) -> bool:
        owned = s.scalar(select(func.count()).select_from(AdaptationJob)
                         .where(jobstates.lease_held(self.job_id, self.attempt)))
        if not owned:
            self.lost = True
        return bool(owned)

    def finish(self, outcome: JobState, *, error: str | None = None) -> str:
        """Record the outcome and the guard's verdict; on success, make the checkpoint the guard picks for the
        job's ``activate`` mode the set's active policy (``auto``: the best, only if it beat the start on the
        probes; ``true``: the final one; ``false``: none), unless the active checkpoint changed while the job
        ran: a rollback made meanwhile stands."""
        job = self.job
        verdict = validation = None
        ckpt_id = None
        if outcome == JobState.SUCCEEDED:  # the last scores, calibrations and the activation: seconds more
            self.phase = "finishing"
            self._sync()
            if self.lost:
                raise LeaseLost
        if self.guard is not None:
            decision = self.guard.decide(job.activate)
            verdict, validation = decision["verdict"], decision["validation"]
            if outcome == JobState.SUCCEEDED and decision["activate"] is not None:
                ckpt_id = self.checkpoint_ids.get(decision["activate"])
            message = decision["message"]
            if outcome == JobState.CANCELED:
                message += f"; canceled at iteration {self.iteration}: nothing is activated"
            elif job.activate == "true" and ckpt_id is not None:
                message += (f"; activate=true: the last checkpoint (iteration {decision['activate']}) is activated "
                            "whatever the probes say")
            elif job.activate == "false":
                message += "; activate=false: nothing is activated"
            validation = {**validation, "activated_iteration": decision["activate"] if ckpt_id is not None else None,
                          "activated_checkpoint_id": None if ckpt_id is None else str(ckpt_id),
                          "message": message, **(self.setup.record if self.setup is not None else {})}
        # calibrated: what is served now, the last checkpoint (activate=true's), and the probes' best (the one the
        # verdict names for a user to activate): a checkpoint on a repaired head scores on a scale of its own
        best = (validation or {}).get("best") or {}
        best_id = self.checkpoint_ids.get(best.get("iteration")) if isinstance(best, dict) else None
        calibrations = (self._calibrations({ckpt_id, self.last_checkpoint_id, best_id})
                        if outcome == JobState.SUCCEEDED else {})
        with self.ctx.session_factory.begin() as s:  # one transaction: the outcome, and the activation it reports
            for cid, cal in calibrations.items():  # with the outcome: a served checkpoint is calibrated at once
                s.execute(update(Checkpoint).where(Checkpoint.id == cid).values(calibration=cal))
            if ckpt_id is not None and not jobstates.activate_job_result(
                    s, set_id=job.exemplar_set_id, checkpoint_id=ckpt_id, base_checkpoint_id=job.base_checkpoint_id):
                log.info("job %s: the set's active checkpoint changed while the job ran; %s not activated",
                         self.job_id, ckpt_id)
                chosen = (f"; activate=true: the last checkpoint (iteration {decision['activate']}) was to be "
                          "activated whatever the probes say, but" if job.activate == "true" else ";")
                validation = {**(validation or {}), "activated_iteration": None, "activated_checkpoint_id": None,
                              "message": f"{decision['message']}{chosen} not activated: the set's active checkpoint "
                                         "changed while the job ran (that choice stands; activate this job's "
                                         "checkpoint to serve it)."}
            if not jobstates.finish_run(s, job_id=self.job_id, attempt=self.attempt, outcome=outcome,
                                        progress_iteration=self.iteration, mean_reward=self.mean_reward,
                                        checkpoint_id=self.last_checkpoint_id, error=error, verdict=verdict,
                                        validation=validation):
                raise LeaseLost
        log.info("job %s %s (attempt %d)", self.job_id, outcome, self.attempt)
        if outcome == JobState.SUCCEEDED and self.ctx.settings.job_checkpoints == "chosen":
            retention.keep_only(self.ctx.session_factory, self.ctx.store, set_id=job.exemplar_set_id,
                                job_id=self.job_id, chosen={ckpt_id, self.last_checkpoint_id, best_id} - {None})
        return outcome.value


def fail_job(ctx: WorkerContext, job_id: uuid.UUID, attempt: int, error: str) -> str:
    """Mark the job failed if this run still owns it -> ``failed``, or ``lost`` (the new owner's job is left alone)."""
    with ctx.session_factory.begin() as s:
        failed = jobstates.fail_run(s, job_id=job_id, attempt=attempt, error=error)
    if not failed:
        log.warning("job %s: not marked failed (%s): another run owns it now", job_id, error[:200])
        return "lost"
    return JobState.FAILED.value


def run_adaptation_job(ctx: WorkerContext, job_id: uuid.UUID, *, worker: str) -> str:
    """Claim and run one job -> its outcome (``succeeded``, ``failed``, ``canceled``, or ``skipped`` / ``lost``).

    Safe to call any number of times for the same job: only one run at a time holds it, and a
    finished job is never run again.
    """
    attempt = claim_job(ctx, job_id, worker=worker)
    if attempt is None:
        log.info("job %s is not claimable (finished, canceled, or owned by a live worker): skipped", job_id)
        return "skipped"
    if attempt > ctx.settings.max_job_attempts:
        return fail_job(ctx, job_id, attempt, f"gave up after {attempt - 1} attempts (worker lost each time)")
    run = AdaptationRun(ctx, job_id, attempt)
    try:
        with Heartbeat(ctx, job_id, attempt) as hb:
            run.heartbeat = hb
            return run.execute()
    except LeaseLost:
        log.warning("job %s: lease lost, another run owns it now", job_id)
        return "lost"
    except SoftTimeLimitExceeded:
        return fail_job(ctx, job_id, attempt, f"time limit exceeded ({ctx.settings.job_soft_time_limit:g} s); "
                                              "checkpoints written so far are kept")
    except Exception as e:
        stop = _stopping(e)
        if stop is not None:  # the process is being stopped: a lost run (it resumes), not a failed job
            log.warning("job %s: its process was stopped (%s: %s); the job resumes from its last checkpoint",
                        job_id, type(e).__name__, e)
            raise stop from e
        log.exception("job %s failed", job_id)
        return fail_job(ctx, job_id, attempt, f"{type(e).__name__}: {e}")


def _stopping(e: BaseException) -> BaseException | None:
    """The ``SystemExit`` or ``KeyboardInterrupt`` behind ``e``, if any: a shutdown that interrupted a database call
    surfaces as the driver's error while cleaning up (psycopg's "connection in transaction status ACTIVE"), with
    the interruption as its context."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, Exception):
            return cause
        seen.add(id(cause))
        cause = cause.__context__ or cause.__cause__
    return None
