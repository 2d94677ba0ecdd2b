"""qloc's PyTorch core, split by role. A module imports only modules of its own role or a lower one
(``tests/models/test_layers.py`` checks it), and never ``app`` or ``worker``:

0. ``config``, ``core`` (boxes, actions, ordinal pairs, REINFORCE, metrics, seeded scopes, template NCC, Platt
   scaling), ``plots``, ``allocator`` (glibc's thresholds for batched activations)
1. ``backbones`` (registry, builders, decoders, oneDNN convolution stacks), ``data`` (``LabeledImages``, cMNIST,
   photos, fetcher)
2. ``nets`` (RoI embedder, agent), ``presets`` (the cMNIST and photo configs)
3. ``bundle`` (files, identity by sha256), ``rollout`` (the box environment, search), ``compiled`` (the
   one-image greedy episode compiled ahead), ``instances`` (several objects per image: episodes from coarse
   windows, NMS), ``refine`` (an answer refined on a repaired reward)
4. ``inference`` (the one ``preprocess`` and ``Localizer``), ``companion`` (a policy whose answers compete with a
   localizer's own: what a paired checkpoint serves)
5. ``features`` (backbone features, prototypes), ``policy`` (the policy-gradient step)
6. ``evaluate`` (OrdAcc, CorLoc, ranking baseline), ``adapt`` (stage 3), ``guard`` (probes decide)
7. ``train`` (stages 1 and 2), ``repair`` (reward repair at test time: stage 1 on probes, head only; the
   reward chosen on probes among the embedding, NCC and backbone-feature scorers)
8. ``experiments`` (protocols, dataset kinds, fine-tune baseline, summary, provenance, speed)
9. ``cli`` (``qloc``)

Box convention for the whole project: ``Tensor[N, 4]`` of float ``(x1, y1, x2, y2)`` in pixels of
the network input, origin top-left, ``x1 < x2`` and ``y1 < y2``; the image spans ``[0, W] x [0, H]``.
"""
