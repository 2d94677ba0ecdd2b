"""Stage 1: train the ordinal embedding (encoder + projection head; MNIST also reconstructs).

Loss = recon_weight * MSE(decoder(features), image) + triplet_weight * triplet(anchor, pos, neg).
The best epoch is chosen by OrdAcc on the validation split, never on test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.bundle import Bundle
from models.core.ordinal import anchors_for, sample_pairs, triplet_loss
from models.data.types import LabeledImages
from models.evaluate import candidate_boxes, evaluate_ordacc
from models.inference import normalize
from models.nets.decoder import MnistDecoder


@dataclass
class EmbeddingTrainConfig:
    epochs: int = 200
    """One epoch = one pass over the training images (they are few: 50 in the paper)."""
    batch_size: int = 50
    lr: float = 1e-3
    pairs_per_image: int = 8
    """Box pairs sampled per image per step, re-sampled every step."""
    group_size: int = 5
    """Images per group for the ``proto`` / ``shuffle_proto`` anchors."""
    anchor: str = "shuffle_proto"
    margin: float = 60.0
    triplet_weight: float = 0.1
    recon_weight: float = 1.0
    """0 turns the autoencoder off (frozen photo backbones train the head with the triplet loss only)."""
    eval_every: int = 10
    seed: int = 0


def train_embedding(bundle: Bundle, train: LabeledImages, val: LabeledImages, cfg: EmbeddingTrainConfig,
                    on_log: Callable[[dict], None] | None = None) -> dict:
    """Train ``bundle.embedder`` in place (best validation state restored) -> summary metrics."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    emb = bundle.embedder
    dev = next(emb.parameters()).device
    for p in emb.parameters():
        p.requires_grad_(True)
    if bundle.config.encoder.frozen:
        for p in emb.encoder.parameters():
            p.requires_grad_(False)
    use_recon = cfg.recon_weight > 0
    decoder = MnistDecoder(bundle.config.input.channels).to(dev) if use_recon else None
    if decoder is not None and bundle.decoder_state is not None:
        decoder.load_state_dict(bundle.decoder_state)
    params = [p for p in emb.parameters() if p.requires_grad] + (list(decoder.parameters()) if decoder else [])
    opt = torch.optim.Adam(params, lr=cfg.lr)
    cands = candidate_boxes(bundle)
    n = len(train.images)
    best = (-1.0, None, None, -1)
    history = []
    for epoch in range(1, cfg.epochs + 1):
        emb.train()
        if bundle.config.encoder.frozen:
            emb.encoder.eval()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            x01 = train.images[idx].to(dev)
            gt = train.boxes[idx]
            pairs = sample_pairs(gt, cands, cfg.pairs_per_image, generator=gen)
            feats = emb.features(normalize(x01, bundle.config.input))
            boxes = torch.cat([gt[:, None], pairs.pos, pairs.neg], 1).to(dev)  # [b, 1+2P, 4]
            out = emb.embed(feats, boxes)
            gt_emb, pos, neg = out[:, 0], out[:, 1:1 + cfg.pairs_per_image], out[:, 1 + cfg.pairs_per_image:]
            anchor = anchors_for(cfg.anchor, gt_emb, cfg.group_size, gen)
            trip = triplet_loss(anchor, pos, neg, cfg.margin)
            loss = cfg.triplet_weight * trip
            recon = torch.zeros((), device=dev)
            if decoder is not None:
                recon = F.mse_loss(decoder(feats), x01)
                loss = loss + cfg.recon_weight * recon
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if epoch % cfg.eval_every == 0 or epoch == cfg.epochs:
            val_acc = evaluate_ordacc(bundle, val, seed=cfg.seed)
            rec = {"epoch": epoch, "losses/triplet": trip.item(), "losses/recon": recon.item(),
                   "val/ordacc": val_acc}
            history.append(rec)
            if on_log:
                on_log(rec)
            if val_acc > best[0]:
                best = (val_acc, copy.deepcopy(emb.state_dict()),
                        copy.deepcopy(decoder.state_dict()) if decoder else None, epoch)
    emb.load_state_dict(best[1])
    emb.eval()
    for p in emb.parameters():
        p.requires_grad_(False)
    bundle.decoder_state = best[2]
    return {"val/ordacc": best[0], "best_epoch": best[3], "history": history}
