"""qloc's PyTorch core: boxes, actions, cMNIST, networks, ordinal embedding, agent, adaptation.

Box convention for the whole project: ``Tensor[N, 4]`` of float ``(x1, y1, x2, y2)`` in pixels of
the network input, origin top-left, ``x1 < x2`` and ``y1 < y2``; the image spans ``[0, W] x [0, H]``.
"""
