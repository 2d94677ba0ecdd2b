import pytest
import torch

from models.bundle import load_bundle, load_policy, new_bundle, save_bundle, save_policy
from models.data.cmnist import CMnistSpec, generate
from models.inference import Localizer, normalize
from models.presets import mnist_config
from models.rollout import BoxEnv, rollout


def _setup(seed=0, n=6):
    bundle = new_bundle("test-mnist", mnist_config(), seed)
    data = generate(CMnistSpec(4, "val", n, seed=seed))
    feats = bundle.embedder.features(normalize(data.images, bundle.config.input)).detach()
    proto = torch.randn(n, bundle.config.head.out_features, generator=torch.Generator().manual_seed(seed))
    return bundle, data, feats, proto


@torch.no_grad()
def test_vectorized_rollout_equals_per_sample_loop():
    bundle, data, feats, proto = _setup()
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    batched = rollout(bundle.embedder, agent, feats, proto, cfg, (84, 84), deterministic=True)
    for i in range(len(feats)):
        single = rollout(bundle.embedder, agent, feats[i:i + 1], proto[i:i + 1], cfg, (84, 84), deterministic=True)
        assert torch.equal(single.actions[:, 0], batched.actions[:, i])
        assert torch.allclose(single.boxes[:, 0], batched.boxes[:, i])
        assert torch.allclose(single.rewards[:, 0], batched.rewards[:, i], atol=1e-4)
    # Reward is the decrease of the distance to the prototype, step by step.
    assert torch.allclose(batched.rewards, batched.distances[:-1] - batched.distances[1:], atol=1e-5)
    assert batched.boxes.shape == (cfg.steps + 1, len(feats), 4)


@torch.no_grad()
def test_env_iou_rewards():
    bundle, data, feats, proto = _setup()
    env = BoxEnv(bundle.embedder, feats, proto, bundle.config.env, (84, 84), reward="iou", gt_boxes=data.boxes)
    _, _, dist = env.observe()
    a = torch.full((len(feats),), 4)  # shrink to the centre
    from models.core.boxes import paired_iou

    before = paired_iou(env.boxes, data.boxes)
    *_, r = env.step(a, dist)
    assert torch.allclose(r, paired_iou(env.boxes, data.boxes) - before)
    env2 = BoxEnv(bundle.embedder, feats, proto, bundle.config.env, (84, 84), reward="iou_sign", gt_boxes=data.boxes)
    *_, r2 = env2.step(a, dist)
    assert set(r2.tolist()) <= {-1.0, 0.0, 1.0}


def test_sampled_rollout_is_seeded():
    bundle, data, feats, proto = _setup()
    agent = bundle.new_agent()
    runs = [rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (84, 84),
                    generator=torch.Generator().manual_seed(3)).actions for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_bundle_round_trip(tmp_path):
    bundle, data, feats, proto = _setup()
    path = tmp_path / "b.pt"
    sha = save_bundle(path, bundle)
    assert len(sha) == 64 and not list(tmp_path.glob(".*.tmp"))
    raw = torch.load(path, weights_only=True)  # plain types only
    assert raw["format"] == "qloc-bundle" and raw["config"]["agent"]["n_actions"] == 10
    again = load_bundle(path)
    assert again.config == bundle.config and again.name == "test-mnist"
    crops = [data.images[0, :, 10:40, 20:50]]
    a, b = Localizer(bundle, "cpu"), Localizer(again, "cpu")
    p = a.prototype(crops)
    assert torch.allclose(p, b.prototype(crops))
    ra, rb = a.localize(list(data.images), p), b.localize(list(data.images), p)
    assert [x.box for x in ra] == [x.box for x in rb]
    # Half-precision storage shrinks the file and still loads.
    save_bundle(tmp_path / "h.pt", bundle, half=True)
    assert (tmp_path / "h.pt").stat().st_size < path.stat().st_size * 0.6
    assert torch.allclose(Localizer(load_bundle(tmp_path / "h.pt"), "cpu").prototype(crops), p, rtol=1e-2, atol=0.5)


def test_policy_round_trip_and_bundle_check(tmp_path):
    bundle, *_ = _setup()
    state = bundle.new_agent().state_dict()
    save_policy(tmp_path / "p.pt", state, bundle_name="test-mnist", meta={"iteration": 3})
    got, meta = load_policy(tmp_path / "p.pt", bundle)
    assert meta == {"iteration": 3} and all(torch.equal(got[k], state[k]) for k in state)
    other = new_bundle("other", mnist_config())
    try:
        load_policy(tmp_path / "p.pt", other)
    except ValueError as e:
        assert "test-mnist" in str(e)
    else:
        raise AssertionError("a policy of another bundle must be refused")


def test_localize_maps_boxes_to_uploaded_pixels():
    from PIL import Image

    bundle, data, *_ = _setup()
    loc = Localizer(bundle, "cpu")
    img = Image.fromarray((data.images[0, 0].numpy() * 255).astype("uint8")).resize((168, 252))
    p = loc.prototype([data.images[0, :, 0:28, 0:28]])
    [res] = loc.localize([img], p, trajectory=True)
    [ref] = loc.localize([data.images[0]], p, trajectory=True)
    assert len(res.trajectory) == bundle.config.env.steps + 1
    assert res.trajectory[0] == (0.0, 0.0, 168.0, 252.0)
    x1, y1, x2, y2 = res.box
    assert 0 <= x1 < x2 <= 168 and 0 <= y1 < y2 <= 252
    # Resizing changes pixels slightly, but the whole-image start maps exactly and scales are per axis.
    assert ref.trajectory[0] == (0.0, 0.0, 84.0, 84.0)


@torch.no_grad()
def test_inference_rollout_equals_training_rollout():
    bundle, data, feats, proto = _setup()
    agent = bundle.new_agent().eval()
    full = rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (84, 84), deterministic=True)
    fast = rollout(bundle.embedder, agent, feats, proto, bundle.config.env, (84, 84), deterministic=True,
                   rewards=False)
    assert torch.equal(full.actions, fast.actions) and torch.allclose(full.boxes, fast.boxes)
    assert torch.allclose(full.distances[-1], fast.distances[-1])
    assert bool(fast.distances[:-1].isnan().all())


@torch.no_grad()
def test_episodes_share_the_feature_map_and_equal_separate_rollouts():
    bundle, data, feats, proto = _setup()
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    one = rollout(bundle.embedder, agent, feats, proto, cfg, (84, 84), deterministic=True)
    many = rollout(bundle.embedder, agent, feats, proto, cfg, (84, 84), deterministic=True, episodes=3)
    assert many.boxes.shape == (cfg.steps + 1, 3 * len(feats), 4)
    for j in range(3):  # image-major rows: episode j of image i is row 3 i + j
        assert torch.allclose(many.boxes[:, j::3], one.boxes)
        assert torch.allclose(many.rewards[:, j::3], one.rewards, atol=1e-5)
    # A mask makes some rows greedy and samples the others.
    mask = torch.arange(3 * len(feats)) % 3 == 0
    mixed = rollout(bundle.embedder, agent, feats, proto, cfg, (84, 84), deterministic=mask,
                    generator=torch.Generator().manual_seed(0), episodes=3)
    assert torch.equal(mixed.actions[:, 0::3], one.actions)
    assert not torch.equal(mixed.actions[:, 1::3], one.actions)


@torch.no_grad()
def test_nearest_answer_is_the_visited_box_nearest_the_prototype():
    from models.rollout import search

    bundle, _, feats, proto = _setup(n=8)
    agent = bundle.new_agent().eval()
    cfg, size = bundle.config.env, (84, 84)
    for samples in (0, 5):
        full = rollout(bundle.embedder, agent, feats, proto, cfg, size, rewards=True, episodes=samples + 1,
                       deterministic=torch.arange(8 * (samples + 1)) % (samples + 1) == 0,
                       generator=torch.Generator().manual_seed(4))
        out = search(bundle.embedder, agent, feats, proto, cfg, size, samples, torch.Generator().manual_seed(4),
                     nearest=True)
        assert out.boxes.shape == (cfg.steps + 1, 8, 4)
        for i in range(8):  # the slow, obvious way: every box image i's episodes visit after step 1
            rows = range(i * (samples + 1), (i + 1) * (samples + 1))
            d = torch.stack([full.distances[1:, r] for r in rows], 1)  # [T, E]
            t, j = divmod(int(d.argmin()), samples + 1)
            assert torch.equal(out.boxes[-1, i], full.boxes[t + 1, rows[j]])
            assert torch.allclose(out.distances[-1, i], d.min())
            assert torch.equal(out.boxes[:t + 2, i], full.boxes[:t + 2, rows[j]])  # the path up to the stop
            assert bool((out.boxes[t + 1:, i] == out.boxes[-1, i]).all())  # then it stays
    plain = search(bundle.embedder, agent, feats, proto, cfg, size, 5, torch.Generator().manual_seed(4))
    assert bool((out.distances[-1] <= plain.distances[-1] + 1e-5).all())


@torch.no_grad()
def test_the_bundle_sets_the_default_answer(tmp_path):
    import dataclasses

    from models.config import EnvConfig, ModelConfig

    bundle, data, feats, proto = _setup(n=8)
    assert bundle.config.env.answer == "last"  # the paper's, and what bundles saved before the field mean
    old = bundle.config.to_dict()
    del old["env"]["answer"]
    assert ModelConfig.from_dict(old).env.answer == "last"
    with pytest.raises(ValueError, match="answer"):
        EnvConfig(answer="first")
    bundle.config = dataclasses.replace(bundle.config, env=dataclasses.replace(bundle.config.env, answer="nearest"))
    save_bundle(tmp_path / "b.pt", bundle)
    loaded = load_bundle(tmp_path / "b.pt")
    assert loaded.config.env.answer == "nearest"
    loc = Localizer(loaded, "cpu")
    agent = loc.agent()
    default = loc.run(data.images, proto[0], agent)
    assert torch.equal(default.boxes, loc.run(data.images, proto[0], agent, nearest=True).boxes)
    assert not torch.equal(default.boxes, loc.run(data.images, proto[0], agent, nearest=False).boxes)


@torch.no_grad()
def test_best_of_n_search_keeps_the_nearest_final_box_and_is_repeatable():
    from models.rollout import search

    bundle, data, feats, proto = _setup(n=8)
    agent = bundle.new_agent().eval()
    cfg = bundle.config.env
    greedy = rollout(bundle.embedder, agent, feats, proto, cfg, (84, 84), deterministic=True, rewards=False)
    assert torch.equal(search(bundle.embedder, agent, feats, proto, cfg, (84, 84), 0).boxes, greedy.boxes)
    best = search(bundle.embedder, agent, feats, proto, cfg, (84, 84), 7, torch.Generator().manual_seed(3))
    again = search(bundle.embedder, agent, feats, proto, cfg, (84, 84), 7, torch.Generator().manual_seed(3))
    assert torch.equal(best.boxes, again.boxes)
    assert best.boxes.shape == greedy.boxes.shape
    # Never worse than the greedy episode (it is one of the candidates), and the score is the kept box's.
    assert bool((best.distances[-1] <= greedy.distances[-1] + 1e-5).all())
    assert bool((best.distances[-1] < greedy.distances[-1] - 1e-5).any())
    emb = bundle.embedder.embed(feats, best.boxes[-1][:, None])[:, 0]
    assert torch.allclose((emb - proto).norm(dim=-1), best.distances[-1], atol=1e-4)
    # The same through the Localizer, on images of any size.
    loc = Localizer(bundle, "cpu")
    out = loc.localize(list(data.images[:4]), proto[0], samples=7)
    assert len(out) == 4 and all(o.score >= 0 for o in out)
