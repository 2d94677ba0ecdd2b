"""Small convolution stacks on the CPU through oneDNN's own tensor layout, for answers.

PyTorch's eager CPU convolutions and max pools convert each small activation to and from oneDNN's blocked layout
(or take slower kernels) layer by layer; kept in that layout from the first layer to the last, the known-kinds
verifier's 28 x 28 reads run 1.25x faster for one box and 2-4x for 2-64 boxes (one thread; BENCHMARKS.md, "Known
kinds"). Public tensor operations only (``Tensor.to_mkldnn``, ``torch.mkldnn_convolution``), not the deprecated
TorchScript modules of ``torch.utils.mkldnn``; ``available()`` says whether this torch has oneDNN.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn


def available() -> bool:
    """Whether this torch build runs oneDNN on this CPU."""
    return bool(torch.backends.mkldnn.is_available())


class OneDnnConvs:
    """A frozen ``nn.Sequential`` whose leading convolutions, ReLUs and max pools run on oneDNN's tensors
    (``Tensor.to_mkldnn``, ``torch.mkldnn_convolution``), the activations kept in its layout from the first
    convolution to the last of them, then the rest of the layers as they are. A copy of the weights as they are
    now (build another after training them); the same outputs to float rounding. For answers: a batch on another
    device, of another dtype, empty or with gradients on runs through the layers as given."""

    def __init__(self, seq: nn.Sequential):
        layers = list(seq)
        self.steps: list[tuple[str, Any]] = []
        while layers and isinstance(layers[0], nn.Conv2d | nn.ReLU | nn.MaxPool2d):
            m = layers.pop(0)
            if isinstance(m, nn.Conv2d):
                if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
                    layers.insert(0, m)
                    break
                bias = m.bias if m.bias is not None else torch.zeros(m.out_channels)
                self.steps.append(("conv", (m.weight.detach().float().to_mkldnn(), bias.detach().float().to_mkldnn(),
                                            m.padding, m.stride, m.dilation)))
            else:
                self.steps.append(("relu", None) if isinstance(m, nn.ReLU) else ("pool", m))
        self.rest = nn.Sequential(*layers).eval()
        self.dense = seq.eval()
        """The layers as given: what runs on anything but a non-empty float32 batch on the CPU."""

    def __call__(self, x: Tensor) -> Tensor:
        """``[m, C, H, W]`` -> what the sequential gives (through oneDNN for float32 on the CPU)."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or not x.numel() or torch.is_grad_enabled():
            return self.dense(x)
        if self.steps:
            # A thread's OpenMP team size is set to torch's lazily, at its first parallel region: oneDNN called before
            # that, on a thread new to torch, ran with OpenMP's default instead (other rounding; too many threads).
            torch.get_num_threads()
            y = x.contiguous().to_mkldnn()
            for kind, arg in self.steps:
                if kind == "conv":
                    y = torch.mkldnn_convolution(y, arg[0], arg[1], arg[2], arg[3], arg[4], 1)
                elif kind == "relu":
                    y = torch.relu(y)
                else:
                    y = F.max_pool2d(y, arg.kernel_size, arg.stride, arg.padding, arg.dilation, arg.ceil_mode)
            x = y.to_dense()
        return self.rest(x)
