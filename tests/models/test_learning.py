"""Learning checks on a small budget: a broken loss, reward or update cannot clear these bars."""

import pytest
import torch

from models.bundle import new_bundle
from models.data.types import exemplar_crops
from models.evaluate import evaluate_corloc, evaluate_ordacc
from models.experiments.cmnist import cmnist
from models.inference import Localizer
from models.presets import mnist_config
from models.train.agent import AgentTrainConfig, train_agent
from models.train.embedding import EmbeddingTrainConfig, train_embedding

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    train = cmnist(4, "train", 50, seed=0)
    val = cmnist(4, "val", 100, seed=0)
    bundle = new_bundle("learn", mnist_config(), 0)
    untrained_ordacc = evaluate_ordacc(bundle, val)
    s1 = train_embedding(bundle, train, val, EmbeddingTrainConfig(epochs=20, eval_every=10, seed=0))
    s2 = train_agent(bundle, train, val, cmnist(4, "val", 5, seed=0, offset=100),
                     AgentTrainConfig(iterations=80, eval_every=20, seed=0))
    return bundle, untrained_ordacc, s1, s2


def test_embedding_learns_ordinal_structure(trained):
    bundle, untrained, s1, _ = trained
    assert s1["val/ordacc"] >= 88.0, s1
    assert s1["val/ordacc"] >= untrained + 10, (untrained, s1)
    test = cmnist(7, "test", 100, seed=0)  # a digit it never saw
    assert evaluate_ordacc(bundle, test) >= 80.0


def test_agent_learns_to_localize(trained):
    bundle, *_, s2 = trained
    assert s2["val/corloc"] >= 70.0, s2
    test = cmnist(4, "test", 100, seed=0)
    proto = Localizer(bundle, "cpu").prototype(exemplar_crops(cmnist(4, "train", 5, seed=9)))
    corloc, _ = evaluate_corloc(bundle, bundle.new_agent(), test, proto)
    assert corloc >= 60.0
    # The untrained policy cannot: the whole-image start has IoU 1/9 with the digit.
    untrained = new_bundle("random", mnist_config(), 1)
    untrained.embedder = bundle.embedder
    assert evaluate_corloc(untrained, untrained.new_agent(), test, proto)[0] < corloc - 30
