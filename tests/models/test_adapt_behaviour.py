"""Behaviour of ``models.adapt.adapt``: what it optimizes, its hooks, resume and cancel, on a tiny bundle.

The reference below re-does test-time adaptation the plain way (a seeded sample of images, one sampled
episode toward the given prototype, REINFORCE, Adam); ``adapt`` must match it bit for bit, so a
prototype that is negated, zeroed or ignored, a wrong seed, batch or learning rate cannot pass.
"""

import io

import pytest
import torch
from model_stand_ins import LeftEdgeScorer

from models.adapt import AdaptConfig, AdaptResult, adapt
from models.bundle import new_bundle
from models.config import AgentConfig, EnvConfig, HeadConfig, InputSpec, ModelConfig
from models.core.reinforce import reinforce_loss
from models.inference import Localizer, normalize, resolve_device
from models.rollout import rollout

S = 32
STEPS = 4
N = 6


def tiny_bundle(seed=0, use_prototype=False, dropout=0.0, channels=1):
    cfg = ModelConfig(
        input=InputSpec(channels=channels, size=S, mean=(0.1307,) * channels, std=(0.3081,) * channels,
                        exemplar_size=12, fill=(0.0,) * channels),
        head=HeadConfig(in_features=64 * 7 * 7, hidden=32, out_features=16, dropout=dropout),
        agent=AgentConfig(conv_channels=4, hidden=8, use_prototype=use_prototype, embed_dim=16),
        env=EnvConfig(steps=STEPS, alpha=0.2, min_side=8.0, resize=0.2),
    )
    cfg.encoder.in_channels = channels
    bundle = new_bundle("tiny-adapt", cfg, seed)
    g = torch.Generator().manual_seed(seed)
    bundle.agent_state = {k: torch.randn(v.shape, generator=g) * (3.0 / v[0].numel() ** 0.5 if v.dim() > 1 else 0.1)
                          for k, v in bundle.agent_state.items()}
    return bundle


def images(n=N, seed=0, channels=1):
    """Dim noise with one bright square each."""
    g = torch.Generator().manual_seed(seed)
    x = 0.3 * torch.rand(n, channels, S, S, generator=g)
    for i in range(n):
        side = int(torch.randint(6, 16, (1,), generator=g))
        x0, y0 = (int(v) for v in torch.randint(0, S - side, (2,), generator=g))
        x[i, :, y0:y0 + side, x0:x0 + side] = 0.7 + 0.3 * torch.rand(channels, side, side, generator=g)
    return x


def prototype(bundle, x):
    """The mean embedding of two exemplar crops taken around the bright squares (what a client uploads)."""
    return Localizer(bundle, "cpu").prototype([x[0, :, 4:28, 4:28], x[1, :, 2:20, 8:30]])


def reference_adapt(bundle, proto, x, cfg, agent_state=None, scorer=None):
    """Test-time adaptation written out: -> (agent state, per-iteration mean returns). ``scorer``: the reward's
    distance (``models.repair``), given each batch's pixels when it reads them."""
    bundle.embedder.eval()
    agent = bundle.new_agent(agent_state)
    ref = None
    if cfg.kl_coef > 0:
        ref = bundle.new_agent(agent_state).eval()
    opt = torch.optim.Adam(agent.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        feats = bundle.embedder.features(normalize(x, bundle.config.input))
    returns = []
    for _ in range(cfg.iterations):
        idx = torch.randperm(len(x), generator=gen)[:cfg.batch_size]
        agent.train()
        ro = rollout(bundle.embedder, agent, feats[idx], proto.expand(len(idx), -1), bundle.config.env,
                     (float(S), float(S)), generator=gen, reference=ref, episodes=cfg.episodes, scorer=scorer,
                     images01=x[idx] if scorer is not None and scorer.pixels else None)
        out = reinforce_loss(ro.log_probs, ro.entropies, ro.rewards, cfg.gamma, cfg.entropy_coef,
                             cfg.normalize_advantages, cfg.episodes)
        loss = out.loss if ref is None else out.loss + cfg.kl_coef * ro.kl.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        returns.append(float(out.mean_return))
    return {k: v.detach().clone() for k, v in agent.state_dict().items()}, returns


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(bundle, proto, x, cfg, **kw):
    progress, checkpoints = [], []
    res = adapt(bundle, proto, x, cfg, device="cpu", on_progress=lambda *a: progress.append(a),
                on_checkpoint=lambda s: checkpoints.append(_serialized(s)), **kw)
    return res, progress, checkpoints


def _serialized(state):
    """What a worker stores: the checkpoint written to bytes at once and read back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


CFG = dict(iterations=5, batch_size=4, lr=0.02, seed=3, checkpoint_every=2)


@pytest.fixture(scope="module")
def tiny():
    bundle = tiny_bundle()
    x = images()
    return bundle, x, prototype(bundle, x)


def test_adapt_is_reinforce_toward_the_given_prototype(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(**CFG)
    res, progress, _ = run(bundle, proto, x, cfg)
    want_state, want_returns = reference_adapt(bundle, proto, x, cfg)
    assert isinstance(res, AdaptResult)
    assert res.iteration == 5 and res.stopped is False
    assert [p[:2] for p in progress] == [(i, 5) for i in range(1, 6)]
    assert [p[2] for p in progress] == pytest.approx(want_returns, abs=1e-6)
    assert same_state(res.agent_state, want_state)
    assert not same_state(res.agent_state, bundle.agent_state)  # it did learn
    assert res.mean_reward == pytest.approx(sum(want_returns[-2:]) / 2, abs=1e-6)  # the last checkpoint_every
    # The rewards it optimizes are distance decreases toward *this* prototype: any other one gives others.
    for other in (-proto, torch.zeros_like(proto), 2 * proto):
        _, returns = reference_adapt(bundle, other, x, AdaptConfig(**{**CFG, "iterations": 1}))
        assert returns[0] != pytest.approx(want_returns[0], abs=1e-4)


@pytest.mark.parametrize("pixels", [True, False])
def test_adapt_optimizes_the_distance_of_a_scorer_it_is_given(tiny, pixels):
    """A job's reward chosen on its probes (``scorer``): the policy steps use its distance, not the embedding's, and a
    scorer that reads pixels gets each batch's images (the same images the features are of)."""
    bundle, x, proto = tiny
    cfg = AdaptConfig(**{**CFG, "iterations": 3})
    scorer = LeftEdgeScorer(pixels)
    res, progress, _ = run(bundle, proto, x, cfg, scorer=scorer)
    want_state, want_returns = reference_adapt(bundle, proto, x, cfg, scorer=LeftEdgeScorer(pixels))
    assert [p[2] for p in progress] == pytest.approx(want_returns, abs=1e-6)
    assert same_state(res.agent_state, want_state)
    _, embedding_returns = reference_adapt(bundle, proto, x, cfg)
    assert [p[2] for p in progress] != pytest.approx(embedding_returns, abs=1e-4)  # not the embedding's reward
    first = x[torch.randperm(N, generator=torch.Generator().manual_seed(cfg.seed))[:cfg.batch_size]]
    if pixels:
        assert torch.equal(scorer.images[0], first)  # iteration 1's batch, drawn by the job's seed
        assert all(i.shape == (cfg.batch_size, 1, S, S) for i in scorer.images)
    else:
        assert all(i is None for i in scorer.images)


def test_the_first_return_is_the_mean_distance_decrease_toward_the_prototype(tiny):
    """Independently of REINFORCE: with gamma = 1, iteration 1's return is dist(whole image) - dist(final box)."""
    bundle, x, proto = tiny
    cfg = AdaptConfig(iterations=1, batch_size=N, seed=5, gamma=1.0)
    res, progress, _ = run(bundle, proto, x, cfg)
    gen = torch.Generator().manual_seed(5)
    idx = torch.randperm(N, generator=gen)
    with torch.no_grad():
        feats = bundle.embedder.features(normalize(x[idx], bundle.config.input))
        agent = bundle.new_agent()
        boxes = rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (S, S), generator=gen).boxes
        emb = bundle.embedder.embed(feats, torch.stack([boxes[0], boxes[-1]], 1))  # [N, 2, D]
    dist = (emb - proto).norm(dim=-1)
    want = float((dist[:, 0] - dist[:, 1]).mean())
    assert progress[0][2] == pytest.approx(want, abs=1e-4)
    assert res.mean_reward == pytest.approx(want, abs=1e-4)


def test_adapt_hands_the_prototype_and_a_frozen_reference_to_every_policy_step(tiny, monkeypatch):
    import models.adapt as adapt_module

    bundle, x, proto = tiny
    seen = []
    real = adapt_module.policy_step

    def spy(bundle_, agent, opt, feats, prototypes, cfg, generator=None, gt_boxes=None, reference=None):
        seen.append((prototypes.clone(), len(feats), reference))
        return real(bundle_, agent, opt, feats, prototypes, cfg, generator, gt_boxes, reference)

    monkeypatch.setattr(adapt_module, "policy_step", spy)
    adapt(bundle, proto, x, AdaptConfig(iterations=3, batch_size=4), device="cpu")
    assert len(seen) == 3
    for protos, b, reference in seen:
        assert b == 4 and protos.shape == (4, 16) and reference is None
        assert torch.equal(protos, proto.expand(4, -1))
    seen.clear()
    start = tiny_bundle(seed=7).agent_state
    adapt(bundle, proto, x, AdaptConfig(iterations=2, batch_size=4, kl_coef=0.5), agent_state=start, device="cpu")
    reference = seen[0][2]
    assert reference is not None and all(r is reference for *_, r in seen)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert same_state(reference.state_dict(), start)  # the starting policy, never updated


def test_kl_trust_region_is_against_the_starting_policy(tiny):
    bundle, x, proto = tiny
    start = tiny_bundle(seed=7).agent_state  # adapt a policy other than the bundle's
    cfg = AdaptConfig(**{**CFG, "kl_coef": 1.0, "iterations": 3})
    res, progress, _ = run(bundle, proto, x, cfg, agent_state=start)
    want_state, want_returns = reference_adapt(bundle, proto, x, cfg, agent_state=start)
    assert same_state(res.agent_state, want_state)
    assert [p[2] for p in progress] == pytest.approx(want_returns, abs=1e-6)
    no_kl, _ = reference_adapt(bundle, proto, x, AdaptConfig(**{**CFG, "iterations": 3}), agent_state=start)
    assert not same_state(res.agent_state, no_kl)


def test_episodes_and_batch_size_follow_the_config(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(iterations=2, batch_size=3, lr=0.05, seed=1, episodes=2, gamma=0.9, entropy_coef=0.1)
    res, progress, _ = run(bundle, proto, x, cfg)
    want_state, want_returns = reference_adapt(bundle, proto, x, cfg)
    assert same_state(res.agent_state, want_state)
    assert [p[2] for p in progress] == pytest.approx(want_returns, abs=1e-6)


def test_checkpoints_every_k_iterations_and_at_the_end(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(**CFG)  # 5 iterations, a checkpoint every 2
    res, progress, checkpoints = run(bundle, proto, x, cfg)
    assert [c["iteration"] for c in checkpoints] == [2, 4, 5]
    assert set(checkpoints[0]) == {"iteration", "agent", "optimizer", "rng"}
    assert same_state(checkpoints[-1]["agent"], res.agent_state)
    assert not same_state(checkpoints[0]["agent"], checkpoints[1]["agent"])
    want_2, _ = reference_adapt(bundle, proto, x, AdaptConfig(**{**CFG, "iterations": 2}))
    assert same_state(checkpoints[0]["agent"], want_2)
    # every iteration, and a final one that is also on the cadence is not repeated
    _, _, each = run(bundle, proto, x, AdaptConfig(**{**CFG, "checkpoint_every": 1, "iterations": 3}))
    assert [c["iteration"] for c in each] == [1, 2, 3]
    _, _, on_cadence = run(bundle, proto, x, AdaptConfig(**{**CFG, "iterations": 4}))
    assert [c["iteration"] for c in on_cadence] == [2, 4]
    _, _, rare = run(bundle, proto, x, AdaptConfig(**{**CFG, "checkpoint_every": 10, "iterations": 3}))
    assert [c["iteration"] for c in rare] == [3]


def test_a_checkpoint_state_is_a_snapshot(tiny):
    """A caller may keep the states ``on_checkpoint`` hands over: later iterations do not change them."""
    bundle, x, proto = tiny
    kept = []
    adapt(bundle, proto, x, AdaptConfig(**CFG), on_checkpoint=kept.append, device="cpu")
    steps = [int(next(iter(c["optimizer"]["state"].values()))["step"]) for c in kept]
    assert steps == [2, 4, 5]


def test_the_default_device_is_auto():
    bundle = tiny_bundle()  # its own bundle: "auto" may move it to a GPU
    res = adapt(bundle, prototype(bundle, images()), images(), AdaptConfig(iterations=1, batch_size=2))
    assert res.iteration == 1 and all(v.device.type == "cpu" for v in res.agent_state.values())
    assert next(bundle.embedder.parameters()).device.type == resolve_device("auto").type  # "cuda:0" is "cuda"


def test_returned_state_is_a_detached_cpu_copy(tiny):
    bundle, x, proto = tiny
    res = adapt(bundle, proto, x, AdaptConfig(iterations=1, batch_size=2), device=torch.device("cpu"))
    for v in res.agent_state.values():
        assert v.device.type == "cpu" and not v.requires_grad
    assert not any(v is bundle.agent_state[k] for k, v in res.agent_state.items())


@pytest.mark.parametrize("k", [2, 4])
def test_resume_after_a_stop_ends_bit_identical_to_an_uninterrupted_run(tiny, k):
    bundle, x, proto = tiny
    cfg = AdaptConfig(**{**CFG, "iterations": 6, "checkpoint_every": 2})
    full, full_progress, full_checkpoints = run(bundle, proto, x, cfg)

    calls = []

    def stop_after_k():
        calls.append(len(calls))
        return len(calls) > k  # checked before every iteration: k iterations run

    first, first_progress, first_checkpoints = run(bundle, proto, x, cfg, should_stop=stop_after_k)
    assert first.stopped is True and first.iteration == k and len(calls) == k + 1
    assert [p[0] for p in first_progress] == list(range(1, k + 1))
    assert first_checkpoints[-1]["iteration"] == k
    assert same_state(first.agent_state, first_checkpoints[-1]["agent"])  # a stopped run returns its agent
    assert first.mean_reward == pytest.approx(sum(p[2] for p in first_progress[-2:]) / 2, abs=1e-9)

    resumed, progress, checkpoints = run(bundle, proto, x, cfg, resume=first_checkpoints[-1])
    assert [p[0] for p in progress] == list(range(k + 1, 7))  # exactly iterations - k more
    assert all(p[1] == 6 for p in progress)
    assert resumed.iteration == 6 and resumed.stopped is False
    assert same_state(resumed.agent_state, full.agent_state)
    assert [p[2] for p in progress] == [p[2] for p in full_progress[k:]]
    assert [c["iteration"] for c in checkpoints] == list(range(k + 2, 7, 2))
    assert same_state(checkpoints[-1]["agent"], full_checkpoints[-1]["agent"])
    # The optimizer state and random stream came back too (not just the weights): compare with resuming
    # from the weights alone.
    weights_only, _, _ = run(bundle, proto, x, AdaptConfig(**{**CFG, "iterations": 6 - k}),
                             agent_state=first_checkpoints[-1]["agent"])
    assert not same_state(weights_only.agent_state, full.agent_state)


def test_resume_restores_the_rng_and_the_optimizer_separately(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(**{**CFG, "iterations": 4})
    full, _, checkpoints = run(bundle, proto, x, cfg)
    ckpt = checkpoints[0]  # iteration 2
    fresh_rng = {**ckpt, "rng": torch.Generator().manual_seed(cfg.seed).get_state()}
    fresh_opt = {**ckpt, "optimizer": torch.optim.Adam(bundle.new_agent().parameters(), lr=cfg.lr).state_dict()}
    assert same_state(run(bundle, proto, x, cfg, resume=ckpt)[0].agent_state, full.agent_state)
    assert not same_state(run(bundle, proto, x, cfg, resume=fresh_rng)[0].agent_state, full.agent_state)
    assert not same_state(run(bundle, proto, x, cfg, resume=fresh_opt)[0].agent_state, full.agent_state)


def test_resume_at_the_last_iteration_runs_nothing(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(**{**CFG, "iterations": 2})
    full, _, checkpoints = run(bundle, proto, x, cfg)
    again, progress, more = run(bundle, proto, x, cfg, resume=checkpoints[-1])
    assert progress == [] and more == [] and again.iteration == 2 and not again.stopped
    assert same_state(again.agent_state, full.agent_state)
    assert again.mean_reward == 0.0


def test_should_stop_before_the_first_iteration_returns_the_start(tiny):
    bundle, x, proto = tiny
    start = tiny_bundle(seed=9).agent_state
    res, progress, checkpoints = run(bundle, proto, x, AdaptConfig(**CFG), agent_state=start,
                                     should_stop=lambda: True)
    assert res == AdaptResult(res.agent_state, 0, 0.0, True)
    assert progress == [] and checkpoints == []
    assert same_state(res.agent_state, start)
    calls = []
    never = run(bundle, proto, x, AdaptConfig(**CFG), should_stop=lambda: calls.append(1) or False)[0]
    assert len(calls) == 5 and never.stopped is False and never.iteration == 5


def test_no_iterations_keeps_the_given_agent(tiny):
    bundle, x, proto = tiny
    start = tiny_bundle(seed=9).agent_state
    res = adapt(bundle, proto, x, AdaptConfig(iterations=0), agent_state=start, device="cpu")
    assert res.iteration == 0 and res.stopped is False and res.mean_reward == 0.0
    assert same_state(res.agent_state, start)


def test_mean_reward_is_the_mean_of_the_last_checkpoint_every_returns(tiny):
    bundle, x, proto = tiny
    res, progress, _ = run(bundle, proto, x, AdaptConfig(**{**CFG, "checkpoint_every": 3}))
    returns = [p[2] for p in progress]
    assert res.mean_reward == pytest.approx(sum(returns[-3:]) / 3, abs=1e-9)
    assert res.mean_reward != pytest.approx(sum(returns) / 5, abs=1e-6)
    many = adapt(bundle, proto, x, AdaptConfig(**{**CFG, "checkpoint_every": 50}), device="cpu")
    assert many.mean_reward == pytest.approx(sum(returns) / 5, abs=1e-9)  # fewer than k iterations: all of them
    zero = adapt(bundle, proto, x, AdaptConfig(**{**CFG, "checkpoint_every": 0}), device="cpu")
    assert zero.mean_reward == pytest.approx(returns[-1], abs=1e-9)  # no cadence: the last return


def test_without_a_feature_cache_the_result_is_the_same(tiny, monkeypatch):
    import models.adapt as adapt_module

    bundle, x, proto = tiny
    cfg = AdaptConfig(**CFG)
    cached = adapt(bundle, proto, x, cfg, device="cpu")
    calls = []
    real = adapt_module.features_of
    monkeypatch.setattr(adapt_module, "features_of", lambda b, im, *a: calls.append(len(im)) or real(b, im, *a))
    uncached = adapt(bundle, proto, x, AdaptConfig(**{**CFG, "cache_bytes": 0}), device="cpu")
    assert calls == [4] * 5  # the batch's features, every iteration
    assert all(torch.allclose(uncached.agent_state[k], v, atol=1e-5) for k, v in cached.agent_state.items())
    assert uncached.mean_reward == pytest.approx(cached.mean_reward, abs=1e-4)
    # The cache is used exactly when all the images' features fit in cache_bytes (float32).
    with torch.no_grad():
        per_image = bundle.embedder.features(torch.zeros(1, 1, S, S)).numel() * 4
    for budget, want in ((per_image * N, [N]), (per_image * N - 1, [4, 4]), (1 << 30, [N])):
        calls.clear()
        adapt(bundle, proto, x, AdaptConfig(**{**CFG, "iterations": 2, "cache_bytes": budget}), device="cpu")
        assert calls == want, budget


def test_the_embedder_is_frozen_in_eval_mode():
    """A head with dropout must not drop units while adapting: the reward would be noise."""
    bundle = tiny_bundle(dropout=0.5)
    x = images()
    proto = prototype(bundle, x)
    cfg = AdaptConfig(**{**CFG, "iterations": 2})
    bundle.embedder.train()
    res = adapt(bundle, proto, x, cfg, device="cpu")
    assert not bundle.embedder.training
    want, _ = reference_adapt(bundle, proto, x, cfg)
    assert same_state(res.agent_state, want)
    assert all(p.grad is None for p in bundle.embedder.parameters())


def test_agent_reading_the_prototype_adapts_like_the_reference():
    bundle = tiny_bundle(use_prototype=True)
    x = images()
    proto = prototype(bundle, x)
    cfg = AdaptConfig(**{**CFG, "iterations": 2})
    res, progress, _ = run(bundle, proto, x, cfg)
    want, returns = reference_adapt(bundle, proto, x, cfg)
    assert same_state(res.agent_state, want)
    assert [p[2] for p in progress] == pytest.approx(returns, abs=1e-6)


def test_input_validation(tiny):
    bundle, x, proto = tiny
    cfg = AdaptConfig(iterations=1)
    for bad in (x[0], x.expand(-1, 3, -1, -1), x[:, :, :, :, None]):
        with pytest.raises(ValueError) as e:
            adapt(bundle, proto, bad, cfg, device="cpu")
        assert str(e.value) == f"images must be [N, 1, S, S]; got {tuple(bad.shape)}"
    with pytest.raises(ValueError) as e:
        adapt(bundle, proto, x[:0], cfg, device="cpu")
    assert str(e.value) == "adaptation needs at least one unlabeled image"
    rgb = tiny_bundle(channels=3)
    with pytest.raises(ValueError) as e:
        adapt(rgb, proto, x, cfg, device="cpu")
    assert str(e.value) == "images must be [N, 3, S, S]; got (6, 1, 32, 32)"
    res = adapt(rgb, proto, images(channels=3), cfg, device="cpu")
    assert res.iteration == 1
