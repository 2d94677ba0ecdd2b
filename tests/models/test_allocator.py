"""``models.allocator``: with glibc's thresholds fixed, a freed batch's memory is the next batch's, without
page faults; each case runs in a fresh process (``mallopt`` is process-wide and not undone)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, sys
import torch
from models.allocator import tune_malloc
tuned = tune_malloc() if sys.argv[1] == "tuned" else None
torch.manual_seed(0)
encoder = torch.nn.Sequential(  # the cMNIST encoder's shape: batch 16's activations are 1-7 MiB each
    torch.nn.Conv2d(1, 10, 3, 2, 1), torch.nn.ReLU(), torch.nn.Conv2d(10, 32, 3, 1, 1), torch.nn.ReLU(),
    torch.nn.Conv2d(32, 64, 3, 1, 1))
x = torch.rand(16, 1, 84, 84)
with torch.inference_mode():
    for _ in range(3):
        encoder(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        encoder(x)
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_a_freed_batch_is_reused_without_faulting_its_pages_again():
    plain, tuned = run("plain"), run("tuned")
    assert tuned["tuned"] is True
    one_activation = 16 * 64 * 42 * 42 * 4 // 4096  # pages of the largest activation
    assert plain["faults"] >= 5 * one_activation  # glibc's defaults: activations leave the heap, fault in again
    assert tuned["faults"] < one_activation  # tuned: ten forward passes on the pages of the first ones
