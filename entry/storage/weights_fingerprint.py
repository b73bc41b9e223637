"""The fingerprint of an exported weights file: of the tensors it holds, not of its bytes.

Stages record the weights they read (`entry.training.stage_record.stage_inputs`) and a latent
cache records the encoder that wrote it. Comparing file bytes would make the same tensors saved
twice look like new inputs whenever the container differs (torch.save names the folder inside
its zip after the file it is given; another torch version may lay the zip out differently), and
every later stage would then retrain. The fingerprint is a sha256 over each tensor's name, dtype,
shape and bytes, in name order.

Weights live in the run folder, so the fingerprint is cached in this process only
(`pipelines.file_facts.cached_fact(beside=False)`): reading a run never writes into it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from pipelines.file_facts import cached_fact, file_sha256

__all__ = ["weights_fingerprint", "tensors_fingerprint"]


def tensors_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """``"tensors:sha256:<hex>"`` of a flat {name: tensor} dict (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(_tensor_header(name, tensor))
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"tensors:sha256:{digest.hexdigest()}"


def _tensor_header(name: str, tensor: torch.Tensor) -> bytes:
    # Length-prefixed, so no two different lists of tensors give the same byte stream.
    text = f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}".encode()
    return len(text).to_bytes(8, "little") + text


def _compute(path: Path) -> str:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a weights file: its bytes still tell one version from another
        state = None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        # Loading it will fail with the error that names the file; here it only has to differ.
        return f"bytes:{path.stat().st_size}:sha256:{file_sha256(path)}"
    return tensors_fingerprint(state)


def weights_fingerprint(path: str | os.PathLike) -> str:
    """Fingerprint of the weights file `path` (`tensors_fingerprint` of what it holds; for a file
    that is not a state dict of tensors, ``"bytes:<size>:sha256:<hex>"``). Raises OSError when
    the file cannot be read."""
    p = Path(path)
    return cached_fact(p, "fingerprint/tensors", lambda: _compute(p), beside=False)
