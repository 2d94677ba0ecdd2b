"""The CUDA paths: inference, adaptation (with a checkpoint that resumes on the other device), stage 1
and stage 2 training, the photo bundle, the CLI. They skip where no GPU is present (CI); run them on a
GPU machine with ``pytest tests/models/test_cuda.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.adapt import AdaptConfig, adapt
from models.bundle import load_bundle
from models.cli import main as cli_main
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc
from models.experiments.cmnist import TrainSetup, cmnist, train_bundle
from models.inference import Localizer, resolve_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
MNIST = ROOT / "bundles" / "mnist-digit4.pt"
PHOTO = ROOT / "bundles" / "photo-mammals.pt"


@pytest.fixture(scope="module")
def data():
    ex = cmnist(2, "train", 5, seed=1000)
    return ex, cmnist(2, "train", 64, seed=1000, offset=5), cmnist(2, "test", 200, seed=0)


def test_auto_device_is_cuda():
    assert resolve_device("auto").type == "cuda"


def test_localization_on_cuda_matches_cpu(data):
    ex, _, test = data
    cpu, gpu = load_bundle(MNIST, "cpu"), load_bundle(MNIST, "cuda")
    assert next(gpu.embedder.parameters()).is_cuda
    results = {}
    for name, b in (("cpu", cpu), ("cuda", gpu)):
        loc = Localizer(b, name)
        proto = loc.prototype(exemplar_crops(ex))
        results[name] = (proto, *evaluate_corloc(b, b.new_agent(), test, proto))
    (p_cpu, c_cpu, b_cpu), (p_gpu, c_gpu, b_gpu) = results["cpu"], results["cuda"]
    assert torch.allclose(p_cpu, p_gpu, rtol=1e-3, atol=1e-2)
    # Greedy argmax may flip on a near-tie under other kernels' rounding; almost every box must agree.
    same = (b_cpu - b_gpu).abs().amax(dim=1) < 1e-3
    assert same.float().mean() >= 0.97
    assert abs(c_cpu - c_gpu) <= 2.0


def test_best_of_n_search_on_cuda(data):
    ex, _, test = data
    b = load_bundle(MNIST, "cuda")
    proto = Localizer(b, "cuda").prototype(exemplar_crops(ex))
    greedy, _ = evaluate_corloc(b, b.new_agent(), test, proto)
    best, boxes = evaluate_corloc(b, b.new_agent(), test, proto, samples=15)
    again, boxes2 = evaluate_corloc(b, b.new_agent(), test, proto, samples=15)
    assert torch.equal(boxes, boxes2) and best == again  # seeded on a CPU generator: repeatable
    assert best >= greedy - 1.0



def test_nearest_answer_on_cuda_matches_cpu(data):
    """The visited box nearest the prototype, with the search's episodes, on CUDA and on the CPU."""
    ex, _, test = data
    out = {}
    for dev in ("cpu", "cuda"):
        b = load_bundle(MNIST, dev)
        loc = Localizer(b, dev)
        proto = loc.prototype(exemplar_crops(ex))
        ro = loc.run(test.images[:64], proto, loc.agent(), samples=3, nearest=True,
                     generator=torch.Generator().manual_seed(0))
        plain = loc.run(test.images[:64], proto, loc.agent(), samples=3, generator=torch.Generator().manual_seed(0))
        assert bool((ro.distances[-1] <= plain.distances[-1] + 1e-4).all())
        out[dev] = ro.boxes[-1].cpu()
    same = (out["cpu"] - out["cuda"]).abs().amax(dim=1) < 1e-3
    assert same.float().mean() >= 0.9  # sampled episodes may part on a near-tie under other kernels


def test_adaptation_on_cuda_learns_and_its_checkpoint_resumes_on_cpu(data):
    ex, unl, test = data
    b = load_bundle(MNIST, "cuda")
    proto = Localizer(b, "cuda").prototype(exemplar_crops(ex))
    saved = []
    cfg = AdaptConfig(iterations=6, batch_size=32, checkpoint_every=3)
    res = adapt(b, proto, unl.images, cfg, device="cuda", on_checkpoint=saved.append)
    assert res.iteration == 6 and not res.stopped
    assert all(v.device.type == "cpu" for v in res.agent_state.values())
    assert torch.isfinite(torch.tensor(res.mean_reward))
    assert [s["iteration"] for s in saved] == [3, 6]
    # The KL trust region runs on CUDA too (a frozen copy of the starting policy beside the agent).
    kl = adapt(b, proto, unl.images, AdaptConfig(iterations=3, batch_size=32, kl_coef=1.0), device="cuda")
    assert kl.iteration == 3 and torch.isfinite(torch.tensor(kl.mean_reward))
    # A job checkpointed on a GPU worker resumes on a CPU worker (the generator state is a CPU one).
    cpu = load_bundle(MNIST, "cpu")
    resumed = adapt(cpu, proto, unl.images, AdaptConfig(iterations=9, batch_size=32, checkpoint_every=3),
                    resume=saved[0], device="cpu")
    assert resumed.iteration == 9
    corloc, _ = evaluate_corloc(cpu, cpu.new_agent(resumed.agent_state), test, proto)
    assert corloc > 50.0


def test_training_both_stages_on_cuda():
    setup = TrainSetup(digit=4, n_train=20, n_val=10)
    setup.embedding.epochs, setup.agent.iterations, setup.agent.eval_every = 2, 4, 2
    b = train_bundle("cuda-smoke", setup, seed=0, device=torch.device("cuda"))
    assert next(b.embedder.parameters()).is_cuda
    assert b.agent_state is not None and all(v.device.type == "cpu" for v in b.agent_state.values())


def test_photo_bundle_localizes_a_real_photo_on_cuda():
    skimage_data = pytest.importorskip("skimage.data")
    from PIL import Image

    b = load_bundle(PHOTO, "cuda")
    loc = Localizer(b, "cuda")
    cat = Image.fromarray(skimage_data.chelsea())
    w, h = cat.size
    proto = loc.prototype([cat.crop((50, 20, 300, 280))])
    (out,) = loc.localize([cat], proto, trajectory=True)
    x0, y0, x1, y1 = out.box
    assert 0 <= x0 < x1 <= w + 1e-3 and 0 <= y0 < y1 <= h + 1e-3
    assert len(out.trajectory) == b.config.env.steps + 1


def test_cli_evaluate_on_cuda(tmp_path, capsys):
    metrics = tmp_path / "m.json"
    assert cli_main(["evaluate", "--bundle", str(MNIST), "--digit", "2", "--n-test", "100", "--device", "cuda",
                     "--metrics", str(metrics)]) == 0
    m = json.loads(metrics.read_text())
    assert m["corloc"] > 80.0


def test_batched_localization_with_a_prototype_per_image_on_cuda_matches_cpu(data):
    """What the server's engine thread runs (``localize_batch``: one forward for several requests' images, each
    with its own prototype) gives the CPU's answers on the GPU."""
    from models.inference import preprocess

    ex, _, test = data
    out = {}
    for dev in ("cpu", "cuda"):
        bundle = load_bundle(MNIST, dev)
        loc = Localizer(bundle, dev)
        protos = torch.stack([loc.prototype(exemplar_crops(ex)), loc.prototype(exemplar_crops(test)[:5])])
        batch, scales = preprocess(list(test.images[:16]), loc.spec)
        per_image = protos.repeat_interleave(8, dim=0)
        out[dev] = loc.localize_batch(batch, scales, per_image, loc.agent(None), nearest=True)
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        assert torch.allclose(torch.tensor(a.box), torch.tensor(b.box), atol=1e-3)
        # TF32 convolutions on the GPU (PyTorch's default): the distance moves ~0.4 % (seen on an H100), the box not
        assert abs(a.score - b.score) <= 1e-2 * abs(a.score) + 1e-3


def test_reward_repair_and_a_repaired_checkpoint_served_on_cuda(data):
    """Reward repair trains the head on the GPU, and a bundle with that head (how a format-2 checkpoint is
    served) localizes there with the repaired prototype."""
    from models.guard import synthetic_probes
    from models.repair import RepairConfig, repair_reward

    ex, unl, test = data
    bundle = load_bundle(MNIST, "cuda")
    crops = exemplar_crops(ex)
    proto = Localizer(bundle, "cuda").prototype(crops)
    probes = [synthetic_probes(bundle, proto, crops, unl.images, None, n, torch.Generator().manual_seed(n))
              for n in (48, 24)]
    rep = repair_reward(bundle, crops, probes[0], probes[1], RepairConfig(epochs=4, min_gain=-100.0))
    assert rep.kept and rep.bundle.device.type == "cuda"
    served = bundle.with_head(rep.head)
    assert next(served.embedder.head.parameters()).device.type == "cuda"
    loc = Localizer(served, "cuda")
    assert torch.allclose(loc.prototype(crops), rep.prototype, atol=1e-4)
    answers = loc.localize(list(test.images[:8]), rep.prototype)
    assert len(answers) == 8 and all(a.box[0] < a.box[2] for a in answers)


def test_graphed_greedy_episodes_on_cuda_equal_eager_ones(data):
    """``models.compiled.GraphedSteer``: greedy episodes replayed as CUDA graphs give the eager boxes at batch
    sizes that fill and pad their bucket, capture once per bucket, follow in-place weight changes, keep two
    agents apart, and replay from another thread; sampled episodes stay eager."""
    import threading

    from models.compiled import graphed_steer

    _, _, test = data
    b = load_bundle(MNIST, "cuda")
    fast, eager = Localizer(b, "cuda"), Localizer(b, "cuda", fast_episode=False)
    proto = fast.prototype(exemplar_crops(data[0]))
    agent, other = fast.agent(), fast.agent()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    graphs = graphed_steer()
    x = test.images[:13]

    def boxes(loc, ag, n):
        with torch.inference_mode():
            return loc.run(x[:n], proto, ag).boxes

    captures = graphs.captures
    for n in (1, 3, 4, 13):
        for ag in (agent, other):
            want, calls = boxes(eager, ag, n), graphs.calls
            assert torch.allclose(boxes(fast, ag, n), want, atol=1e-3), (n, ag is agent)
            assert graphs.calls == calls + 1  # replayed, not eager
    assert graphs.captures - captures == 6  # buckets 1, 4 (3 and 4 share it), 16, for each agent
    assert not torch.equal(boxes(fast, agent, 13), boxes(fast, other, 13))
    assert graphs.captures - captures == 6  # nothing captured again
    with torch.no_grad():  # in place: the graph reads the agent's weights where they lie
        for p, q in zip(agent.parameters(), other.parameters(), strict=True):
            p.copy_(q)
    assert torch.allclose(boxes(fast, agent, 13), boxes(eager, other, 13), atol=1e-3)
    seen = []
    t = threading.Thread(target=lambda: seen.append(boxes(fast, other, 3)))
    t.start()
    t.join()
    assert torch.allclose(seen[0], boxes(eager, other, 3), atol=1e-3)
    calls = graphs.calls
    with torch.inference_mode():
        fast.run(x[:3], proto, agent, deterministic=False, generator=torch.Generator().manual_seed(0))
        fast.run(x[:3], proto, other.train())  # an agent in training mode (dropout): eager
    assert graphs.calls == calls
