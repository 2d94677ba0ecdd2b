"""Stage 1: train the ordinal embedding (encoder + projection head; a frozen backbone: the head only).

Loss = triplet_weight * triplet(anchor, pos, neg) [+ recon_weight * MSE(decoder(features), image) when the
backbone has a decoder and ``recon_weight > 0``]. Box pairs are group-sampled from dense candidates (two
IoU bins per pair). The training images' features come from the backbone at every step, or once from
``LabeledImages.feats`` (a frozen backbone's). The best evaluation is chosen on the validation split,
never on test: by OrdAcc with the group-prototype anchor, or -- given ``val_exemplars`` -- by OrdAcc with
the prototype of those exemplars' crops as anchor (what the reward uses at test time).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.backbones import build_decoder
from models.bundle import Bundle
from models.core.ordinal import (
    ANCHORS,
    anchors_for,
    class_batches,
    kind_margin_loss,
    sample_pairs,
    triplet_loss,
)
from models.core.seeding import seeded
from models.data.types import LabeledImages
from models.evaluate import evaluate_ordacc, ranking_metrics, training_candidates
from models.features import crop_embeddings, prototypes_for
from models.inference import normalize

EMBEDDING_ANCHORS = (*ANCHORS, "shuffle_exemplar")
"""``ANCHORS`` of ``models.core.ordinal`` on the in-image ground-truth embeddings, or ``shuffle_exemplar``:
``shuffle_proto`` over the ground-truth crops pasted on a blank canvas, which is how ``Localizer.prototype``
embeds a client's exemplars -- training then matches serving exactly."""


@dataclass
class EmbeddingTrainConfig:
    epochs: int = 200
    """One epoch = one pass over the training images (they are few: 50 in the paper)."""
    batch_size: int = 50
    drop_last: bool = False
    """Skip a last, smaller batch (shuffled group anchors need at least two full groups)."""
    lr: float = 1e-3
    pairs_per_image: int = 8
    """Box pairs sampled per image per step, re-sampled every step."""
    group_size: int = 5
    """Images per group for the ``proto`` / ``shuffle_proto`` / ``shuffle_exemplar`` anchors."""
    anchor: str = "shuffle_proto"
    """One of ``EMBEDDING_ANCHORS``."""
    margin: float = 60.0
    triplet_weight: float = 0.1
    recon_weight: float = 1.0
    """0 turns the autoencoder off (frozen photo backbones train the head with the triplet loss only)."""
    eval_every: int = 10
    seed: int = 0
    class_weight: float = 0.0
    """Weight of the cross-kind term on data of several kinds (``LabeledImages.classes``): each image's box must
    be nearer its own kind's anchor than another kind's prototype (the mean crop embedding of ``group_size``
    images of a kind drawn at random), by ``margin``. The ordinal triplet alone orders boxes around one object
    and leaves the kinds mixed: a general photo bundle's prototypes then hardly change its distances, and its
    answers do not follow the query (BENCHMARKS.md, "Does the answer follow the query"). 0: off."""
    head_only: bool = False
    """Train the projection head alone, the backbone frozen whatever the bundle's config says (reward repair
    at test time, ``models.repair``)."""


class Interrupted(Exception):  # noqa: N818 -- a request honoured, not a failure
    """Training stopped because its caller's ``should_stop`` said so (a canceled job): the weights are half-trained."""


def train_embedding(bundle: Bundle, train: LabeledImages, val: LabeledImages, cfg: EmbeddingTrainConfig, *,
                    val_exemplars: LabeledImages | None = None, candidates: Tensor | None = None,
                    on_log: Callable[[dict], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> dict:
    """Train ``bundle.embedder`` in place (best validation state restored) -> summary metrics.

    ``candidates [K, 4]``: the boxes pairs are drawn from (default ``training_candidates``); validation
    uses the same. With ``val_exemplars``, model selection uses ``ranking_metrics`` with their prototype.
    ``should_stop``: asked before every batch; true raises ``Interrupted`` (the embedder is then left half-trained)."""
    if cfg.anchor not in EMBEDDING_ANCHORS:
        raise ValueError(f"anchor must be one of {EMBEDDING_ANCHORS}, got {cfg.anchor!r}")
    if cfg.recon_weight > 0 and train.feats is not None:
        raise ValueError("the reconstruction loss trains the backbone: give images without cached features")
    emb = bundle.embedder
    dev = bundle.device
    with seeded(cfg.seed, dev):  # weight init of the decoder and dropout draw from torch's global generator
        gen = torch.Generator().manual_seed(cfg.seed)
        emb.requires_grad_(True)
        frozen = bundle.config.encoder.frozen or cfg.head_only
        if frozen:
            emb.encoder.requires_grad_(False)
        decoder = build_decoder(bundle.config.encoder).to(dev) if cfg.recon_weight > 0 else None
        if decoder is not None and "decoder" in bundle.training:
            decoder.load_state_dict(bundle.training["decoder"])
        params = [p for p in emb.parameters() if p.requires_grad] + (list(decoder.parameters()) if decoder else [])
        opt = torch.optim.Adam(params, lr=cfg.lr)
        cands = training_candidates(bundle) if candidates is None else candidates
        n, P = len(train), cfg.pairs_per_image
        kinds = 0 if train.classes is None else len(train.classes.unique())
        bs = min(cfg.batch_size, n)
        best: tuple[float, dict | None, dict | None, int] = (-1.0, None, None, -1)
        history = []
        for epoch in range(1, cfg.epochs + 1):
            emb.train()
            if frozen:
                emb.encoder.eval()
            if train.classes is None:
                perm = torch.randperm(n, generator=gen)
                batches = [perm[i:i + bs] for i in range(0, n - bs + 1 if cfg.drop_last else n, bs)]
            else:  # several kinds: each batch holds one kind, so every anchor is of the image's own kind
                batches = class_batches(train.classes, bs, cfg.drop_last, gen)
            for idx in batches:
                if should_stop is not None and should_stop():
                    raise Interrupted(f"stopped at epoch {epoch} of {cfg.epochs}")
                gt = train.boxes[idx]
                pairs = sample_pairs(gt, cands, P, generator=gen)
                if train.feats is not None:
                    feats = train.feats[idx.to(train.feats.device)]
                else:
                    x01 = train.images[idx].to(dev)
                    feats = emb.features(normalize(x01, bundle.config.input))
                out = emb.embed(feats, torch.cat([gt[:, None], pairs.pos, pairs.neg], 1).to(dev))  # [b, 1+2P, D]
                if cfg.anchor == "shuffle_exemplar":
                    crops = crop_embeddings(bundle, train, idx, grad=True)
                    anchor = anchors_for("shuffle_proto", crops, cfg.group_size, gen)
                else:
                    anchor = anchors_for(cfg.anchor, out[:, 0], cfg.group_size, gen)
                trip = triplet_loss(anchor, out[:, 1:1 + P], out[:, 1 + P:], cfg.margin)
                loss = cfg.triplet_weight * trip
                if cfg.class_weight > 0 and kinds > 1:
                    other = _other_kind_prototype(bundle, train, int(train.classes[idx[0]]), cfg.group_size, gen)
                    loss = loss + cfg.class_weight * kind_margin_loss(out[:, 0], anchor, other, cfg.margin)
                recon = None
                if decoder is not None:
                    recon = F.mse_loss(decoder(feats), x01)
                    loss = loss + cfg.recon_weight * recon
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
                rec: dict = {"epoch": epoch, "losses/triplet": trip.item()}
                if recon is not None:
                    rec["losses/recon"] = recon.item()
                if val_exemplars is None:
                    rec["val/ordacc"] = evaluate_ordacc(bundle, val, seed=cfg.seed, candidates=cands)
                else:
                    emb.eval()
                    m = ranking_metrics(bundle, val, prototypes_for(bundle, val_exemplars, val), seed=cfg.seed,
                                        candidates=cands)
                    rec["val/ordacc"], rec["val/spearman"] = m["ordacc"], m["spearman"]
                history.append(rec)
                if on_log:
                    on_log(rec)
                if rec["val/ordacc"] > best[0]:
                    best = (rec["val/ordacc"], copy.deepcopy(emb.state_dict()),
                            copy.deepcopy(decoder.state_dict()) if decoder else None, epoch)
    emb.load_state_dict(best[1])
    emb.eval()
    emb.requires_grad_(False)
    if decoder is not None:
        bundle.training["decoder"] = best[2]
    return {"val/ordacc": best[0], "best_epoch": best[3], "history": history}


def _other_kind_prototype(bundle: Bundle, data: LabeledImages, kind: int, group: int,
                          gen: torch.Generator) -> Tensor:
    """The mean crop embedding (with its gradient) of ``group`` random images of a random kind other than
    ``kind`` -> ``[D]``."""
    kinds = data.classes.unique()
    others = kinds[kinds != kind]
    pick = others[torch.randint(len(others), (1,), generator=gen)]
    members = (data.classes == pick).nonzero().flatten()
    idx = members[torch.randperm(len(members), generator=gen)[:group]]
    return crop_embeddings(bundle, data, idx, grad=True).mean(0)
