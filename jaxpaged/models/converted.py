"""Converted checkpoints (`jaxpaged convert`): the engine's parameter tree saved with orbax, for fast starts.

A converted folder holds the source's HF config, generation config and tokenizer (a GGUF's converted
metadata), so it loads like any model folder, and under `params/` an orbax checkpoint of the loaders' output:
our parameter names, matmul weights already transposed to [in, out], layers stacked on axis 0, in the chosen
dtype. Loading it skips GGUF dequantization and HF's per-tensor transposes; `jaxpaged_checkpoint.json` marks
the folder and carries the format version, the dtype and the source. This module reads such folders (below the
registry, which loads them); `convert.py` writes them.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from jaxpaged.config import ModelConfig

logger = logging.getLogger(__name__)

MARKER = "jaxpaged_checkpoint.json"
FORMAT_VERSION = 1
PARAMS_DIR = "params"
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
                "added_tokens.json")


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def _flat(tree: dict) -> dict:
    return {f"{k}.{sub}" if isinstance(v, dict) else k: x
            for k, v in tree.items() for sub, x in (v.items() if isinstance(v, dict) else [(None, v)])}


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
