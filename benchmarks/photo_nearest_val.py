"""The answer rule on the photo **val** splits (tuning; the test split is not read): the last box of the
greedy episode against the visited box nearest the prototype (from step 0, 1 or 3), alone and over the
16 episodes of the best-of-16 search, before and after adaptation. Its output chose the nearest answer
(BENCHMARKS.md, photos, "How the nearest answer was chosen"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/photo_nearest_val.py S   # S = 0, 1, 2: runs/photo3-sS bundles

One JSON line per class; keys ``{before,after}_{final,final_best,path0,path1,path3,path0_best,...}``
(``final_best`` = the search; ``pathK`` = nearest among steps >= K of the greedy episode; ``pathK_best``
= nearest among steps >= K of all 16 episodes). ``path1`` is what ``search(nearest=True)`` returns.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from models.adapt import adapt
from models.bundle import load_bundle
from models.core.metrics import corloc
from models.data.photos import generate, load_manifest
from models.experiments.photos import PHOTO_CLASSES, PhotoTransferSetup, photo_set
from models.features import prototype_of
from models.rollout import rollout


@torch.no_grad()
def answers(bundle, agent, feats, proto, episodes: int, gen: torch.Generator) -> dict:
    """Every answer rule's boxes ``[N, 4]`` from one batch of ``episodes`` episodes per image (greedy first)."""
    n, e = len(feats), episodes
    greedy = torch.arange(n * e) % e == 0
    ro = rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (224.0, 224.0), deterministic=greedy,
                 generator=gen, rewards=False, episodes=e)
    d, bx = ro.distances.view(-1, n, e), ro.boxes.view(-1, n, e, 4)  # [T+1, N, E], [T+1, N, E, 4]
    image = torch.arange(n)
    out = {"final": bx[-1, :, 0], "final_best": bx[-1, image, d[-1].argmin(1)]}
    for lo in (0, 1, 3):
        out[f"path{lo}"] = bx[lo:, :, 0][d[lo:, :, 0].argmin(0), image]
        flat = d[lo:].permute(1, 0, 2).reshape(n, -1)
        out[f"path{lo}_best"] = bx[lo:].permute(1, 0, 2, 3).reshape(n, -1, 4)[image, flat.argmin(1)]
    return out


def main(seed: int) -> None:
    torch.set_num_threads(1)
    b = load_bundle(f"runs/photo3-s{seed}/seed{seed}/bundle.pt", "cpu")
    manifest = load_manifest()
    gen = torch.Generator().manual_seed(seed)
    for c in PHOTO_CLASSES:
        ex = photo_set(b, manifest, c, "train", 5, seed + 1000, crops=True)
        val = photo_set(b, manifest, c, "val", 48, seed)
        proto = prototype_of(b, ex)
        row = {"seed": seed, "class": c}
        agents = {"before": b.new_agent()}
        if c != "mammals":
            unl = generate(manifest, c, "train", 64, seed=seed + 2000, size=224)
            cfg = dataclasses.replace(PhotoTransferSetup(c).adapt, seed=seed)
            agents["after"] = b.new_agent(adapt(b, proto, unl.images, cfg, device="cpu").agent_state)
        for tag, agent in agents.items():
            agent.eval()
            for k, v in answers(b, agent, val.feats, proto, 16, gen).items():
                row[f"{tag}_{k}"] = round(corloc(v, val.boxes), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
