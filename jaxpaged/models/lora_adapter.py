"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), read into host arrays in
our layout and checked against the base model before anything reaches the device.

An adapter's low-rank update of a projection W [in, out] is x @ A @ B * scaling, A = lora_A.weight.T [in, r],
B = lora_B.weight.T [r, out], scaling = lora_alpha / r (rslora: lora_alpha / sqrt(r)). Here the scaling is
folded into B once at load, each module's rank is padded with zeros to the engine's `max_lora_rank` (exact:
the padded columns of A meet zero rows of B), and untargeted modules are zeros, so every adapter has the same
shapes and fits any slot of the device stack (`layers/lora.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig

# Our projections, in the order the device stack fuses them (`LORA_PARTS`), and the HF module names that map
# to them: Phi-3's fused qkv_proj / gate_up_proj are split into their parts (the same A for each).
MODULES = ("q", "k", "v", "o", "gate", "up", "down")
HF_MODULES = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "gate_proj": ("gate",),
              "up_proj": ("up",), "down_proj": ("down",), "qkv_proj": ("q", "k", "v"),
              "gate_up_proj": ("gate", "up")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_PREFIX = re.compile(r"(base_model\.model\.)?(model\.)?")  # what may stand before "layers." (the decoder's own)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRAError(ValueError):
    """An adapter that cannot serve this base model; the message names the adapter and what is wrong."""


def module_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA may target, in the base model's own shapes."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (e, q), "k": (e, kv), "v": (e, kv), "o": (q, e), "gate": (e, f), "up": (e, f), "down": (f, e)}


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter in host memory. a[m]: [L, in, R] and b[m]: [L, R, out] for every module m of `MODULES`
    (R = the engine's max_lora_rank; zeros where the adapter has no update), B already times the scaling."""

    name: str
    lora_id: int
    path: str
    rank: int  # the largest rank of its modules (before padding)
    targets: tuple[str, ...]  # our module names it updates
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    fingerprint: str  # a hash of its weights and config: the prefix cache's key (never another adapter's blocks)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def _pattern_value(pattern: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's path
    (the path as PEFT matches it: from `model.layers...`)."""
    module_path = module_path.removeprefix("base_model.model.")
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _check_patterns(name: str, config: dict) -> None:
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict):
            raise LoRAError(f"LoRA adapter {name!r}: {field} must be an object, got {pattern!r}")
        for key, value in pattern.items():
            try:
                re.compile(key)
            except re.error as e:
                raise LoRAError(f"LoRA adapter {name!r}: {field} key {key!r} is not a regular expression ({e})"
                                ) from None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise LoRAError(f"LoRA adapter {name!r}: {field}[{key!r}] must be a positive number, got {value!r}")


def read_adapter_config(name: str, path: str) -> dict:
    """adapter_config.json of the adapter folder `path`, checked for what this engine runs (LoRAError else)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a folder")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {name!r}: {file} is missing")
    try:
        with open(file) as fh:
            config = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out layers")):
        if config.get(flag):
            raise LoRAError(f"LoRA adapter {name!r}: {flag}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r}: trained biases are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} (whole modules "
                        "replaced) are not supported")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"LoRA adapter {name!r}: {field} must be a positive number, got {value!r}")
    _check_patterns(name, config)
    return config


def adapter_rank(name: str, path: str) -> int:
    """The largest rank among an adapter's tensors (read from the file's header, no weights loaded)."""
    from safetensors import safe_open

    read_adapter_config(name, path)
    file = os.path.join(os.fspath(path), WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {name!r}: {file} is missing")
    with safe_open(file, "np") as f:
        ranks = [f.get_slice(k).get_shape()[0] for k in f.keys() if ".lora_A" in k]
    if not ranks:
        raise LoRAError(f"LoRA adapter {name!r}: {file} holds no LoRA tensors")
    return max(ranks)


def load_lora_adapter(name: str, lora_id: int, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for the base model `cfg`; ranks up to `max_rank`. Raises LoRAError
    naming the adapter and the module for anything it cannot serve (missing files, other modules, shapes)."""
    from safetensors import safe_open

    config = read_adapter_config(name, path)
    path = os.fspath(path)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, f))]
        raise LoRAError(f"LoRA adapter {name!r}: {file} is missing" +
                        (f" ({other[0]} is there: save it with safe_serialization=True)" if other else ""))
    try:  # (through flax's arrays: numpy has no bfloat16, and bf16 adapters are common)
        with safe_open(file, framework="flax") as f:
            tensors = {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a damaged file: its error, named
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {file} ({e})") from None
    limit = float(np.finfo(np.dtype(jnp.dtype(cfg.compute_dtype))).max)  # (a B past it is inf in the activations)
    dims = module_dims(cfg)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA update of an attention or MLP "
                            f"projection (supported: {', '.join(HF_MODULES)})")
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if not _PREFIX.fullmatch(key[: m.start() + (key[m.start()] == ".")]):
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not in the decoder's layers (another tower's?)")
        if value.ndim != 2:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} has shape {tuple(value.shape)}, not 2-D")
        if side in pairs.get((layer, module), {}):
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} of layer {layer} has two lora_{side} tensors")
        if module not in HF_MODULES:
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} (tensor {key!r}) is not supported; "
                            f"supported: {', '.join(HF_MODULES)}")
        if layer >= cfg.num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the base model has "
                            f"{cfg.num_layers} layers")
        if cfg.num_experts and module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r}: adapters of mixture-of-experts MLPs are not "
                            "supported")
        pairs.setdefault((layer, module), {})[side] = value
        paths[(layer, module)] = key[: m.start(3) - len("lora_")].rstrip(".")
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {file} holds no LoRA tensors")
    L = cfg.num_layers
    a = {mod: np.zeros((L, dims[mod][0], max_rank), np.float32) for mod in MODULES}
    b = {mod: np.zeros((L, max_rank, dims[mod][1]), np.float32) for mod in MODULES}
    targets, top_rank = set(), 0
    for (layer, module), sides in sorted(pairs.items()):
        where = f"LoRA adapter {name!r}: module {module!r} of layer {layer}"
        if set(sides) != {"A", "B"}:
            raise LoRAError(f"{where} has lora_{'A' if 'A' not in sides else 'B'} missing")
        wa, wb = sides["A"], sides["B"]  # [r, in], [out, r]
        parts = HF_MODULES[module]
        d_in, d_out = dims[parts[0]][0], sum(dims[p][1] for p in parts)
        r = wa.shape[0]
        if r == 0 or wa.shape[1] != d_in or wb.shape != (d_out, r):
            raise LoRAError(f"{where}: lora_A {tuple(wa.shape)} and lora_B {tuple(wb.shape)} do not fit the base "
                            f"model's projection [{d_in} -> {d_out}] (expected [r, {d_in}] and [{d_out}, r])")
        if r > max_rank:
            raise LoRAError(f"{where}: rank {r} exceeds max_lora_rank={max_rank}")
        module_path = paths[(layer, module)]
        r_cfg = _pattern_value(config.get("rank_pattern"), module_path, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern"), module_path, config["lora_alpha"])
        if r_cfg != r:
            raise LoRAError(f"{where}: its tensors have rank {r}, its config says r={r_cfg}")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        if not (np.isfinite(wa).all() and np.abs(wa).max() <= limit and np.abs(wb).max() * scaling <= limit):
            raise LoRAError(f"{where}: its weights (times the scaling {scaling:g}) are not finite in "
                            f"{cfg.compute_dtype} (one such row would turn every token of a step to NaN)")
        top_rank = max(top_rank, r)
        lo = 0
        for part in parts:
            hi = lo + dims[part][1]
            a[part][layer, :, :r] = wa.T
            b[part][layer, :r, :] = wb[lo:hi].T * scaling
            targets.add(part)
            lo = hi
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for mod in MODULES:
        digest.update(a[mod].tobytes())
        digest.update(b[mod].tobytes())
    return LoRAAdapter(name, lora_id, path, top_rank, tuple(m for m in MODULES if m in targets), a, b,
                       digest.hexdigest())
