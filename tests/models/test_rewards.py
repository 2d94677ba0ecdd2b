"""Rewards chosen on the probes (``models.repair``): the scorers ``BoxEnv`` measures its distance with, the
embedding one giving exactly the rewards of before, NCC and backbone-feature scorers vectorized over the batch, and
the choice of the most faithful candidate on a job's selection probes, reported in the job's record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.bundle import load_bundle
from models.core.templates import box_ncc, make_templates
from models.data.glyphs import font_files
from models.data.types import LabeledImages, exemplar_crops
from models.experiments.datasets import GlyphKind
from models.features import features_of
from models.guard import synthetic_probes
from models.inference import Localizer, normalize
from models.repair import (
    CANDIDATES,
    NCC_JITTER,
    EmbeddingScorer,
    FeatureScorer,
    NCCScorer,
    candidate_scorers,
    choose_reward,
    faithfulness,
    guarded_setup,
    scorer_faithfulness,
)
from models.rollout import BoxEnv, rollout

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mnist-digit4.pt"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle(BUNDLE, "cpu")


@pytest.fixture(scope="module")
def glyphs(bundle):
    """Glyph 'K' (a kind the digit bundle never saw): 5 exemplar crops, 24 unlabeled images, their prototype."""
    kind = GlyphKind("K", "patch")
    crops = exemplar_crops(kind.draw(bundle, "exemplars", 5, 0))
    unl = kind.draw(bundle, "unlabeled", 24, 0, after=5)
    return crops, unl.images, Localizer(bundle, "cpu").prototype(crops)


@pytest.fixture(scope="module")
def probes(bundle, glyphs):
    crops, images, proto = glyphs
    return synthetic_probes(bundle, proto, crops, images, None, 24, torch.Generator().manual_seed(2))


def test_the_embedding_scorer_gives_the_rewards_of_before(bundle, glyphs):
    """Default, or named: the distances and rewards are bit for bit those of the embedding distance as ``BoxEnv``
    computed it before scorers (RoIAlign, head, norm to the prototypes), and so are sampled episodes."""
    _, images, proto = glyphs
    feats = features_of(bundle, images[:8])
    agent = bundle.new_agent()
    runs = [rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (84.0, 84.0), deterministic=False,
                    generator=torch.Generator().manual_seed(5), scorer=scorer)
            for scorer in (None, EmbeddingScorer(proto))]
    for field in ("boxes", "actions", "rewards", "distances", "log_probs"):
        assert torch.equal(getattr(runs[0], field), getattr(runs[1], field)), field
    ro = runs[0]
    protos = proto.expand(8, -1)
    with torch.no_grad():
        old = torch.stack([(bundle.embedder.embed_roi(bundle.embedder.roi(feats, ro.boxes[t][:, None])
                                                      .flatten(0, 1)[:, None])[:, 0] - protos).norm(dim=-1)
                           for t in range(len(ro.boxes))])
    assert torch.equal(ro.distances, old)
    assert torch.equal(ro.rewards, old[:-1] - old[1:])  # dist_before - dist


def test_ncc_and_feature_scorers_are_vectorized_in_the_env(bundle, glyphs):
    """In the env (several episodes per image too) each scorer's distance equals its distance of the same boxes
    computed apart, and the reward is ``dist_before - dist``; NCC without the pixels is refused."""
    crops, images, proto = glyphs
    feats = features_of(bundle, images[:6])
    agent = bundle.new_agent()
    for scorer in (NCCScorer(crops), FeatureScorer.from_crops(bundle, crops)):
        ro = rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (84.0, 84.0), deterministic=False,
                     generator=torch.Generator().manual_seed(1), episodes=3, scorer=scorer, images01=images[:6])
        assert ro.distances.shape == (bundle.config.env.steps + 1, 18)
        with torch.no_grad():
            apart = torch.stack([scorer.box_distances(bundle.embedder, feats, b.view(6, 3, 4), images[:6]).view(-1)
                                 for b in ro.boxes])
        assert torch.allclose(ro.distances, apart, atol=1e-5), scorer.name
        assert torch.allclose(ro.rewards, ro.distances[:-1] - ro.distances[1:])
        assert float(ro.distances.min()) >= 0 and float(ro.distances.max()) <= 2
    with pytest.raises(ValueError, match="pixels"):
        BoxEnv(bundle.embedder, feats, proto.expand(6, -1), bundle.config.env, (84.0, 84.0), scorer=NCCScorer(crops))
    with pytest.raises(ValueError, match="^the 'ncc' scorer needs the images' pixels$"):
        NCCScorer(crops).box_distances(bundle.embedder, feats, ro.boxes[-1].view(6, 3, 4), None)


@pytest.mark.skipif(not font_files(), reason="the premise holds for 'K' drawn in TrueType fonts (/usr/share/fonts); "
                    "PIL's built-in bitmap font draws another glyph")
def test_the_choice_picks_ncc_where_the_embedding_misleads(bundle, glyphs, probes):
    """On glyph probes the bundle's embedding orders boxes worse than NCC with the crops (it was trained on digits),
    and with a misleading prototype (the whole images') it orders them backwards: the choice picks NCC. A margin
    larger than the gap keeps the current reward. (On a GPU machine with no font files, 2026-11-28: NCC's Spearman
    -0.34 against the embedding's -0.70 on the bitmap font's 'K': the premise is the fonts', not the device's.)"""
    crops, images, proto = glyphs
    ncc = NCCScorer(crops)
    choice = choose_reward(bundle, {"embedding": EmbeddingScorer(proto), "ncc": ncc}, probes)
    f = choice.faithfulness
    assert f["ncc"]["spearman"] < f["embedding"]["spearman"] - choice.margin
    assert choice.chosen == "ncc" and choice.scorer is ncc
    assert f["embedding"] == faithfulness(bundle, proto, probes)  # the same pairs and numbers as repair's

    whole = torch.tensor([[0.0, 0.0, 84.0, 84.0]]).expand(8, 1, 4)
    with torch.no_grad():
        misleading = bundle.embedder.embed(bundle.embedder.features(normalize(images[:8], bundle.config.input)),
                                           whole)[:, 0].mean(0)
    bad = choose_reward(bundle, {"embedding": EmbeddingScorer(misleading), "ncc": ncc}, probes)
    assert bad.faithfulness["embedding"]["spearman"] > 0.2  # farther from it = more overlap: backwards
    assert bad.chosen == "ncc" and bad.record["chosen"] == "ncc"

    kept = choose_reward(bundle, {"embedding": EmbeddingScorer(proto), "ncc": ncc}, probes, margin=1.0)
    assert kept.chosen == "embedding" and kept.faithfulness == choice.faithfulness


def test_every_candidate_is_scored_on_the_same_pairs_and_the_most_faithful_wins(bundle, glyphs, probes):
    crops, _, proto = glyphs
    scorers = candidate_scorers(bundle, proto, crops)
    assert tuple(scorers) == CANDIDATES
    choice = choose_reward(bundle, scorers, probes, margin=0.0)
    best = min(CANDIDATES, key=lambda n: choice.faithfulness[n]["spearman"])
    assert choice.chosen == best
    for name, s in scorers.items():
        assert choice.faithfulness[name] == scorer_faithfulness(bundle, s, probes), name
    with pytest.raises(ValueError, match="unknown"):
        candidate_scorers(bundle, proto, crops, ("embedding", "iou"))


def test_a_job_reports_its_choice_and_adapts_on_it_while_the_guard_keeps_its_probes(bundle, glyphs):
    """``guarded_setup(choice=True)``: ``record["reward_choice"]`` names the chosen candidate and every candidate's
    probe faithfulness (the embedding's on the bundle head = repair's ``before`` numbers on the same probes); the
    served head and prototype stay the bundle's; off, the record says ``None`` and the job is today's."""
    crops, images, proto = glyphs
    kw = {"synthetic": 24, "generator_seed": 0}
    off = guarded_setup(bundle, proto, crops, images, None, **kw)
    on = guarded_setup(bundle, proto, crops, images, None, choice=True, **kw)
    forced = guarded_setup(bundle, proto, crops, images, None, choice=True, choice_margin=-10.0, **kw)
    assert off.record["reward_choice"] is None and off.scorer is None
    rec = on.record
    assert rec["reward"] == "bundle head" and rec["repair"] is None  # the existing keys stay
    choice = rec["reward_choice"]
    assert choice["chosen"] in CANDIDATES and set(choice["candidates"]) == set(CANDIDATES)
    assert choice["probes"] == 12 and "rule" in choice and choice["current"] == "embedding"
    val = synthetic_probes(bundle, proto, crops, images, None, 12, torch.Generator().manual_seed(0 * 7919 + 2))
    assert choice["candidates"]["embedding"] == faithfulness(bundle, proto, val, 0)
    assert (on.scorer is None) == (choice["chosen"] == "embedding")
    # a margin below every gap forces the best candidate: here not the embedding (digits-trained, on glyphs)
    best = forced.record["reward_choice"]["chosen"]
    assert best != "embedding" and forced.scorer is not None and forced.scorer.name == best
    assert forced.bundle is bundle and torch.equal(forced.prototype, proto)  # served as before
    guard = forced.guard
    assert guard.faithfulness == scorer_faithfulness(
        bundle, forced.scorer, LabeledImages(guard.probes.images, guard.probes.boxes, guard.feats))
    # the guard's probes are the same draw, erased where the chosen reward's ranking finds the object
    assert torch.equal(guard.probes.boxes, off.guard.probes.boxes)


def test_the_choice_keeps_the_current_reward_on_a_tie_and_scores_on_the_seed_given(bundle, glyphs, probes):
    """Two names for one scorer tie: the current one stays whichever comes first, even with no margin; the
    faithfulness is measured on the pairs of the ``seed`` given; a current reward that is not a candidate is named."""
    _, _, proto = glyphs
    same = EmbeddingScorer(proto)
    for scorers in ({"embedding": same, "twin": same}, {"twin": same, "embedding": same}):
        c = choose_reward(bundle, scorers, probes, margin=0.0)
        assert c.chosen == "embedding" and c.faithfulness["twin"] == c.faithfulness["embedding"]
    c = choose_reward(bundle, {"embedding": same}, probes, seed=3)
    assert c.faithfulness["embedding"] == scorer_faithfulness(bundle, same, probes, 3)
    assert c.faithfulness["embedding"] != scorer_faithfulness(bundle, same, probes, 0)
    with pytest.raises(ValueError, match=r"the current reward 'ncc' must be one of the candidates \['embedding'\]"):
        choose_reward(bundle, {"embedding": same}, probes, current="ncc")


def test_the_ncc_reward_reads_each_box_alone_unless_told_to_jitter(glyphs, probes):
    """``NCC_JITTER`` (0): a box is read as it is, not as the best of its shifted reads (three times the cost per
    adaptation step); ``1 - `` the mean over the templates of ``box_ncc`` at the jitter asked for."""
    crops, _, _ = glyphs
    boxes = probes.boxes[:, None] + torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.0, -2.0, 5.0, 1.0]])  # [n, 2, 4]
    templates = make_templates(crops)
    assert NCC_JITTER == 0.0
    for scorer, jitter in ((NCCScorer(crops), 0.0), (NCCScorer(crops, jitter=0.1), 0.1)):
        want = (1.0 - box_ncc(probes.images, boxes, templates, jitter=jitter).mean(-1)).float()
        assert torch.equal(scorer.distances(probes.images, boxes), want)
    plain = NCCScorer(crops).distances(probes.images, boxes)
    jittered = NCCScorer(crops, jitter=0.1).distances(probes.images, boxes)
    assert (jittered <= plain + 1e-6).all() and (jittered < plain - 1e-3).any()  # the best read is never worse
