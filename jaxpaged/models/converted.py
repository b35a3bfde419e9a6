"""Converted checkpoints (`jaxpaged convert`): the engine's parameter tree saved with orbax, for fast starts.

A converted folder holds the source's HF config, generation config and tokenizer (a GGUF's converted
metadata), so it loads like any model folder, and under `params/` an orbax checkpoint of the loaders' output:
our parameter names, matmul weights already transposed to [in, out], layers stacked on axis 0, in the chosen
dtype. Loading it skips GGUF dequantization and HF's per-tensor transposes; `jaxpaged_checkpoint.json` marks
the folder and carries the format version, the dtype and the source.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import numpy as np

from jaxpaged.config import ModelConfig

logger = logging.getLogger(__name__)

MARKER = "jaxpaged_checkpoint.json"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                 "added_tokens.json")


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


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


def _flat(tree: dict) -> dict:
    return {f"{k}.{sub}" if isinstance(v, dict) else k: x
            for k, v in tree.items() for sub, x in (v.items() if isinstance(v, dict) else [(None, v)])}


def convert(source: str, out: str, *, dtype: str = "float32", load_format: str = "auto") -> str:
    """Write `source` (HF folder, GGUF file or, "dummy", random weights) as a converted folder at `out`."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxpaged.models.registry import config_folder, load_hf_config, load_weights, model_config_from_hf

    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"convert: {out!r} exists and is not empty")
    start = time.perf_counter()
    cfg = model_config_from_hf(source, load_hf_config(source), dtype)
    weights = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in load_weights(cfg, load_format).items()}
    tmp = f"{out.rstrip('/')}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    folder = config_folder(source)
    for name in _CONFIG_FILES:
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


def load_converted(path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The parameter tree of a converted folder (numpy arrays, in the dtype it was converted to)."""
    import orbax.checkpoint as ocp

    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: converted with format version {meta.get('format_version')}, this jaxpaged reads "
                         f"version {FORMAT_VERSION}: convert the source again")
    with ocp.StandardCheckpointer() as ckpt:
        tree = ckpt.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)))
    if meta.get("dtype") != cfg.dtype:
        logger.info("%s was converted as %s; casting to %s", path, meta.get("dtype"), cfg.dtype)
    return {k: np.asarray(v) for k, v in _flat(tree).items()}
