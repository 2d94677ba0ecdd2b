import numpy as np
import pytest
import torch

from models.data.cmnist import BACKGROUNDS, CMnistSpec, _source_indices, generate, generate_pair, load_mnist


def test_mnist_files_load():
    x, y = load_mnist("train")
    assert x.shape == (60000, 28, 28) and y.shape == (60000,)
    xt, _ = load_mnist("test")
    assert xt.shape == (10000, 28, 28)


def test_train_val_disjoint_and_test_from_test_file():
    _, y = load_mnist("train")
    for d in (2, 4):
        tr, va = _source_indices(y, d, "train", 0.2), _source_indices(y, d, "val", 0.2)
        assert len(np.intersect1d(tr, va)) == 0 and len(tr) + len(va) == (y == d).sum()


@pytest.mark.parametrize("background", BACKGROUNDS)
def test_backgrounds_deterministic_and_boxed(background):
    a = generate(CMnistSpec(3, "train", 8, background, seed=5))
    b = generate(CMnistSpec(3, "train", 8, background, seed=5))
    c = generate(CMnistSpec(3, "train", 8, background, seed=6))
    assert torch.equal(a.images, b.images) and not torch.equal(a.images, c.images)
    assert a.images.shape == (8, 1, 84, 84) and a.images.min() >= 0 and a.images.max() <= 1
    wh = a.boxes[:, 2:] - a.boxes[:, :2]
    assert bool((wh == 28).all()) and bool((a.boxes >= 0).all()) and bool((a.boxes <= 84).all())
    if background == "patch":
        # Patches never overlap the digit: inside the box only the digit's own pixels.
        x, y = load_mnist("train")
        threes = torch.from_numpy(x[y == 3]).float() / 255.0
        for img, box in zip(a.images, a.boxes.long(), strict=True):
            inside = img[0, box[1]:box[3], box[0]:box[2]]
            assert bool(((threes - inside).abs().amax(dim=(1, 2)) < 1e-6).any()), "box must hold an MNIST 3, untouched"
            outside = img[0].clone()
            outside[box[1]:box[3], box[0]:box[2]] = 0
            assert (outside > 0).float().mean() > 0.05  # there are patches


def test_offsets_give_disjoint_digits():
    a = generate(CMnistSpec(7, "train", 5, seed=1))
    b = generate(CMnistSpec(7, "train", 20, seed=1, offset=5))
    crops_a = {tuple(img[0, bx[1]:bx[3], bx[0]:bx[2]].flatten().tolist()) for img, bx in zip(a.images, a.boxes.long(),
                                                                                             strict=True)}
    crops_b = {tuple(img[0, bx[1]:bx[3], bx[0]:bx[2]].flatten().tolist()) for img, bx in zip(b.images, b.boxes.long(),
                                                                                             strict=True)}
    assert not crops_a & crops_b


def test_selective_two_digits():
    first, second = generate_pair((3, 4), n=6, seed=0)
    assert torch.equal(first.images, second.images)
    from models.core.boxes import paired_iou

    assert bool((paired_iou(first.boxes, second.boxes) == 0).all())
    assert first.labels.tolist() == [3] * 6 and second.labels.tolist() == [4] * 6


def test_mnist_is_found_through_qloc_data_dir(tmp_path, monkeypatch):
    """Data comes from ``QLOC_DATA_DIR`` (default ``./data``), never from beside the installed code."""
    from pathlib import Path

    from models.data import DATA_DIR_ENV, data_dir
    from models.data.cmnist import load_mnist

    repo_data = Path(__file__).resolve().parents[2] / "data"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match=DATA_DIR_ENV):
        load_mnist("test")
    (tmp_path / "mnist").symlink_to(repo_data / "mnist")
    images, labels = load_mnist("test")
    assert images.shape == (10000, 28, 28) and len(labels) == 10000
    monkeypatch.delenv(DATA_DIR_ENV)
    monkeypatch.chdir(tmp_path)  # the default is the working directory's data/
    assert data_dir() == Path("data")
    with pytest.raises(FileNotFoundError, match="mnist"):
        load_mnist("train")
