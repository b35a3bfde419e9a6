"""The model identity disk files carry: the same checkpoint gives the same one, other weights, dtypes or block
sizes another (so a folder shared by several models never serves one model's KV to another)."""

from jaxpaged.kv_offload.identity import model_identity
from jaxpaged.models.registry import load_hf_config, model_config_from_hf
from tests.tiny_models import make_tiny_model


def test_identity_follows_weights_dtype_and_block_size(tmp_path):
    a = make_tiny_model("llama", str(tmp_path / "a"), seed=0)
    a2 = make_tiny_model("llama", str(tmp_path / "a2"), seed=0)
    b = make_tiny_model("llama", str(tmp_path / "b"), seed=1)

    def ident(path, **kw):
        args = {"load_format": "auto", "kv_dtype": "float32", "block_size": 16, **kw}
        return model_identity(model_config_from_hf(path, load_hf_config(path), "float32"), **args)

    assert ident(a) == ident(a2)  # the same weights in another folder
    assert ident(a) != ident(b)  # same architecture, other weights
    assert ident(a) != ident(a, kv_dtype="bfloat16")
    assert ident(a) != ident(a, block_size=32)
    assert ident(a, load_format="dummy") == ident(b, load_format="dummy")  # dummy weights: the config alone
