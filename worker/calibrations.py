"""The calibration refresh at the end of an adaptation job (``worker.jobs.AdaptationRun.finish``)."""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any

import torch

from app.inference import prototype_from_bytes, read_checkpoint
from app.tables import Checkpoint
from models.calibration import answers, calibrate_policy, stored_kind, stored_negative_templates
from models.data.probes import erase_boxes
from models.inference import Localizer
from worker.probes import set_examples

if TYPE_CHECKING:
    from worker.jobs import AdaptationRun

log = logging.getLogger(__name__)


def refreshed_calibrations(run: AdaptationRun, ckpt_ids: set[uuid.UUID | None]) -> dict[uuid.UUID, dict[str, Any]]:
    """The calibration refresh at the end of a job (``models.calibration``): for the checkpoints it may serve
    (the one it activates, its last one, the probes' best that its verdict names), fit on the job's probes (the
    guard's: pasted crops and labeled examples) and its images with the checkpoint's answers erased (plus
    ``calibration_samples`` pasted crops and synthesized backgrounds, as a new set's), with the set's negative
    exemplars unless the job repaired the reward (they were embedded by the bundle's head). A failure is logged and
    leaves those checkpoints on the set's calibration: it never fails the job."""
    setup, images01 = run.setup, getattr(run, "images01", None)
    if setup is None or images01 is None:
        return {}
    out = {}
    try:
        with run.ctx.session_factory() as s:
            crops, _ = set_examples(s, run.ctx.store, set_id=run.exemplar_set.id, spec=setup.bundle.config.input,
                                    max_side=run.ctx.settings.decode_max_side)
        es = run.exemplar_set
        negatives = None
        if es.negatives is not None and setup.reward == "bundle head":
            negatives = prototype_from_bytes(es.negatives).view(-1, es.prototype_dim)
        # The set's kind check (it depends on its crops only): the stored one; a set with no calibration (made in
        # workers mode by an earlier version) gets it made here, by the bundle's verifier, as set creation makes it.
        verifier = run.ctx.bundles.verifier(es.bundle) if es.calibration is None else None
        reward = run.reward()  # as localize serves the checkpoints: paired with the job's start where they carry it
        loc = Localizer(setup.bundle, run.ctx.settings.device)
        if reward is not None:
            loc = Localizer(run.bundle, run.ctx.settings.device).with_reward(reward)
        for iteration, cid in run.checkpoint_ids.items():
            if cid not in ckpt_ids:
                continue
            with run.ctx.session_factory() as s:
                row = s.get_one(Checkpoint, cid)
                agent = read_checkpoint(run.ctx.store, blob=row.blob or "", sha256=row.sha256, bundle=setup.bundle)[0]
            boxes, _ = answers(loc, loc.agent(agent), setup.prototype, images01, nearest=loc.default_nearest)
            backgrounds = erase_boxes(images01, boxes, torch.Generator().manual_seed(run.job.seed))
            cal = calibrate_policy(loc, setup.prototype, crops, nearest=loc.default_nearest, agent_state=agent,
                                   n=run.ctx.settings.calibration_samples, seed=run.job.seed, backgrounds01=backgrounds,
                                   positives=setup.guard.probes, negative_embeddings=negatives, threshold=es.threshold,
                                   negative_templates=stored_negative_templates(es.calibration), verifier=verifier)
            if cal.templates is not None and verifier is None:  # the set's kind check holds for every policy
                cal.kind = stored_kind(es.calibration)
            out[cid] = {**cal.to_dict(), "iteration": iteration}
    except Exception:
        log.exception("job %s: calibration refresh failed; its checkpoints use the set's calibration", run.job_id)
        return {}
    return out
