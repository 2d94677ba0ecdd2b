"""Stand-ins the model tests share (importable from every test directory: ``tests/conftest.py`` puts ``tests/`` on the
path)."""

from __future__ import annotations


class LeftEdgeScorer:
    """A reward's distance that is not the embedding's (``models.repair``'s scorers): the boxes' left edge. It reads
    pixels when ``pixels`` (the env then hands it the images) and no embedding; it records what the env gave it."""

    name, embedding = "left", False

    def __init__(self, pixels: bool = True):
        self.pixels = pixels
        self.distances, self.images = [], []

    def env_distance(self, env, roi, emb):  # noqa: ANN001, ANN201
        self.images.append(env.images01)
        self.distances.append(env.boxes[:, 0].clone())
        return self.distances[-1]
