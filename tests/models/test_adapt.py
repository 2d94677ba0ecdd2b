"""Stage 3: the KL trust region of test-time adaptation."""

import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import new_bundle
from models.data.cmnist import CMnistSpec, generate
from models.inference import normalize
from models.presets import mnist_config
from models.rollout import rollout


def _setup():
    bundle = new_bundle("test-kl", mnist_config(), seed=0)
    data = generate(CMnistSpec(2, "val", 16, seed=0))
    proto = torch.randn(bundle.config.head.out_features, generator=torch.Generator().manual_seed(1))
    feats = bundle.embedder.features(normalize(data.images, bundle.config.input)).detach()
    return bundle, data, proto, feats


def _kl_to(bundle, state, reference_state, feats, proto) -> float:
    with torch.no_grad():
        ro = rollout(bundle.embedder, bundle.new_agent(state), feats, proto, bundle.config.env, (84, 84),
                     deterministic=True, reference=bundle.new_agent(reference_state))
    return float(ro.kl.mean())


def test_kl_against_itself_is_zero_and_absent_without_reference():
    bundle, _, proto, feats = _setup()
    assert _kl_to(bundle, None, None, feats, proto) < 1e-6
    ro = rollout(bundle.embedder, bundle.new_agent(), feats, proto, bundle.config.env, (84, 84))
    assert ro.kl is None


def test_kl_penalty_keeps_the_adapted_policy_near_the_start():
    bundle, data, proto, feats = _setup()
    far, near = (adapt(bundle, proto, data.images, AdaptConfig(iterations=15, batch_size=16, lr=1e-2, kl_coef=k),
                       device="cpu")
                 for k in (0.0, 20.0))
    kl_far = _kl_to(bundle, far.agent_state, None, feats, proto)
    kl_near = _kl_to(bundle, near.agent_state, None, feats, proto)
    assert kl_far > 0.01  # adaptation does move the policy
    assert kl_near < 0.5 * kl_far


def test_several_episodes_per_image_adapt_reproducibly():
    bundle, data, proto, _ = _setup()
    cfg = AdaptConfig(iterations=3, batch_size=8, lr=1e-2, episodes=4)
    a, b = (adapt(bundle, proto, data.images, cfg, device="cpu") for _ in range(2))
    start = bundle.agent_state
    assert all(torch.equal(a.agent_state[k], b.agent_state[k]) for k in start)  # seeded: the same run twice
    assert any(not torch.equal(a.agent_state[k], start[k]) for k in start)  # and it learned something
    one = adapt(bundle, proto, data.images, AdaptConfig(iterations=3, batch_size=8, lr=1e-2), device="cpu")
    assert any(not torch.equal(a.agent_state[k], one.agent_state[k]) for k in start)
