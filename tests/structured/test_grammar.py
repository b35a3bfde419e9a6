"""StructuredOutputsParams validation, grammar compilation errors, and the in-step bitmask against llguidance's."""

import jax.numpy as jnp
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from jaxpaged import SamplingParams, StructuredOutputsParams
from jaxpaged.layers.token_bitmask import apply_token_bitmask
from jaxpaged.structured.grammar import compile_grammar


@pytest.mark.parametrize("kwargs,needle", [
    ({}, "exactly one"), ({"json": {}, "regex": "a"}, "exactly one"), ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"), ({"choice": "ab"}, "choice"), ({"json": 3}, "json"),
    ({"regex": ""}, "regex"), ({"json_object": "yes"}, "json_object"),
])
def test_bad_params_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_a_dict_and_reject_unknown_fields():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert p.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="unknown fields.*'schema'"):
        SamplingParams(structured_outputs={"schema": {}})


@pytest.mark.parametrize("params,needle", [
    (StructuredOutputsParams(json={"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json="[1, 2]"), "JSON object"),
    (StructuredOutputsParams(regex="[a-"), "regex"),
    (StructuredOutputsParams(grammar="root ::= ("), "grammar"),
])
def test_unusable_constraints_raise_naming_the_field(params, needle):
    with pytest.raises(ValueError, match=f"structured_outputs.{params.kind}") as e:
        compile_grammar(params)
    assert needle in str(e.value)


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array", "items": {"enum": ["x", "y"]}}'),
    StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(choice=["yes", "no (maybe)"]),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'), StructuredOutputsParams(grammar='start: "a"+'),
])
def test_supported_constraints_compile(params):
    assert compile_grammar(params)


@pytest.mark.parametrize("vocab", [64, 100, 257])
def test_bitmask_applies_like_llguidance(vocab):
    rng = np.random.default_rng(vocab)
    width = (vocab + 31) // 32
    mask = rng.integers(-2**31, 2**31, size=(5, width), dtype=np.int64).astype(np.int32)
    mask[2] = -1  # a free row
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, mask)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask))), expected)


def test_all_ones_bitmask_leaves_logits_alone():
    logits = jnp.arange(70, dtype=jnp.float32).reshape(2, 35)
    out = apply_token_bitmask(logits, jnp.full((2, 2), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))


def test_the_engine_imports_without_llguidance():
    """The GPU machine runs the project from its tree and has no llguidance: only building a grammar needs it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['llguidance'] = None\n"
            "import jaxpaged, jaxpaged.cli, jaxpaged.bench.gpu, jaxpaged.runner.model_runner\n"
            "from jaxpaged.structured import compile_grammar\n"
            "from jaxpaged.sampling_params import StructuredOutputsParams\n"
            "try:\n    compile_grammar(StructuredOutputsParams(regex='a+'))\n"
            "except ValueError as e:\n    print('needs llguidance only to build a grammar:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs llguidance only to build a grammar: structured_outputs needs llguidance" in out.stdout


@pytest.mark.parametrize("think_tokens", [False, True])
def test_a_constraint_after_the_thinking(think_tokens):
    """reasoning_end: free text (which the answer's grammar would refuse) up to the end tag, then the answer; the
    tag as a token of its own where the tokenizer has one (llguidance reads added tokens as special), else as
    text. With reasoning_start, the reply may also skip the thinking; without, it must think first."""
    import llguidance.hf
    from llguidance import LLMatcher

    from tests.tiny_models import make_byte_tokenizer, make_think_tokenizer

    tok = make_think_tokenizer() if think_tokens else make_byte_tokenizer()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def accepts(params, text):
        m = LLMatcher(lt, compile_grammar(params, lt), log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    inside = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"]}, reasoning_end="</think>")
    maybe = StructuredOutputsParams(choice=["yes", "no"], reasoning_start="<think>", reasoning_end="</think>")
    assert accepts(inside, 'so {a} is "x"...</think>\n\n{"a":1}')
    assert not accepts(inside, '{"a":1}') and not accepts(inside, 'x</think>{"a":"1"}')
    assert accepts(maybe, "yes") and accepts(maybe, "<think>hm, no?</think> no")
    assert not accepts(maybe, "hm</think>no")
    with pytest.raises(ValueError, match="reasoning_start needs reasoning_end"):
        StructuredOutputsParams(regex="a", reasoning_start="<think>")
