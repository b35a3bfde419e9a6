"""`jaxpaged convert`: write a model (HF folder, GGUF file or random weights) as a converted folder
(`converted.py` reads it)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import numpy as np

from jaxpaged.models.converted import CONFIG_FILES, FORMAT_VERSION, MARKER, PARAMS_DIR
from jaxpaged.models.registry import config_folder, load_hf_config, load_weights, model_config_from_hf

logger = logging.getLogger(__name__)


def _nested(flat: dict) -> dict:
    """{"layers.wq": x, "embed": y} -> {"layers": {"wq": x}, "embed": y} (orbax keys without dots)."""
    out: dict = {}
    for name, value in flat.items():
        head, _, rest = name.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[name] = value
    return out


def convert(source: str, out: str, *, dtype: str = "float32", load_format: str = "auto") -> str:
    """Write `source` (HF folder, GGUF file or, "dummy", random weights) as a converted folder at `out`."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"convert: {out!r} exists and is not empty")
    start = time.perf_counter()
    cfg = model_config_from_hf(source, load_hf_config(source), dtype)
    if cfg.quantization is not None:  # (a converted folder holds float arrays only)
        raise ValueError(f"convert: {source!r} is quantized ({cfg.quantization}); serve it as it is (its "
                         "quantized weights are read without a conversion)")
    weights = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in load_weights(cfg, load_format).items()}
    tmp = f"{out.rstrip('/')}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    folder = config_folder(source)
    for name in CONFIG_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copy2(os.path.join(folder, name), os.path.join(tmp, name))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.path.join(tmp, PARAMS_DIR)), _nested(weights))
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "dtype": dtype, "source": os.path.abspath(source),
                   "load_format": load_format, "architecture": cfg.architecture}, f, indent=1)
    if os.path.exists(out):
        os.rmdir(out)  # (empty)
    os.replace(tmp, out)
    logger.info("Converted %s to %s (%s, %.2f GB) in %.1f s", source, out, dtype,
                sum(w.nbytes for w in weights.values()) / 1e9, time.perf_counter() - start)
    return out
