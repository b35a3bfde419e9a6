"""The model identity disk-tier files carry: blocks are only ever read back by an engine whose KV they are."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from jaxpaged.config import ModelConfig
from jaxpaged.models.converted import PARAMS_DIR, is_converted
from jaxpaged.models.kv_scales import CALIBRATION_TEXT, HEADROOM

_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_SAMPLE = 1 << 20  # bytes read from each end of each weight file


def _weight_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    if is_converted(path):  # (`jaxpaged convert`: an orbax checkpoint under params/)
        return sorted(os.path.join(d, f) for d, _, files in os.walk(os.path.join(path, PARAMS_DIR)) for f in files)
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(_WEIGHT_SUFFIXES))


def model_identity(model_config: ModelConfig, *, load_format: str, kv_dtype: str, block_size: int,
                   kv_scales: bool = False) -> str:
    """A hex digest of the architecture config, the weights' and KV's dtypes, the block size and a fingerprint of
    the weight files (each one's size and its first and last MiB: cheap, and a different checkpoint of the
    same architecture differs there); dummy weights (always drawn from seed 0) by the config alone. kv_scales: the
    fp8 pool is scaled by calibrated scales (models/kv_scales.py; their calibration is part of the identity)."""
    h = hashlib.blake2b(digest_size=12)
    config = {k: v for k, v in dataclasses.asdict(model_config).items() if k != "model"}
    h.update(json.dumps([config, load_format, kv_dtype, block_size], sort_keys=True, default=str).encode())
    if kv_scales:  # fp8 blocks stored divided by the calibrated scales
        h.update(f"kv scales: headroom {HEADROOM}, {CALIBRATION_TEXT}".encode())
    if load_format != "dummy":
        for f in _weight_files(model_config.model):
            size = os.path.getsize(f)
            h.update(f"{os.path.basename(f)} {size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(_SAMPLE))
                if size > 2 * _SAMPLE:
                    fh.seek(size - _SAMPLE)
                    h.update(fh.read(_SAMPLE))
    return h.hexdigest()
