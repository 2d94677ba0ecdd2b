"""The known-kinds verifier on the service's side: found beside its bundle, read again once replaced."""

import os

import torch

from app.inference import BundleRegistry
from models.verifier import KindVerifier, save_verifier, verifier_path


def test_the_registry_reads_a_bundles_verifier_and_reads_it_again_once_replaced(tmp_path, caplog):
    reg = BundleRegistry(tmp_path, device="cpu")
    assert reg.verifier("b") is None and reg.verifier("../b") is None  # none installed; not a bundle name
    path = verifier_path(tmp_path / "b.pt")
    first = save_verifier(path, KindVerifier(1, ["0", "background"]), {})
    v = reg.verifier("b")
    assert v is not None and v.sha256 == first and reg.verifier("b") is v  # kept while the file is the same
    torch.manual_seed(1)
    second = save_verifier(path, KindVerifier(1, ["0", "background"]), {})
    os.utime(path, ns=(1, 1))  # another file even within the clock's resolution
    assert second != first and reg.verifier("b").sha256 == second
    path.write_bytes(b"broken")
    assert reg.verifier("b") is None and "not read" in caplog.text
    path.unlink()
    assert reg.verifier("b") is None
