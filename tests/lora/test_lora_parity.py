"""LoRA outputs equal HF transformers with the PEFT adapter merged into the weights: logits of the model alone
(every layout), and greedy tokens through the engine with adapters and the base model mixed in its steps."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from jaxpaged.models.lora_adapter import load_lora_adapter
from pallas_kernels import cpu_dense
from tests.lora.adapters import hf_merged
from tests.reference import hf_greedy, hf_last_logits
from tests.tiny_models import load_hf_model

PROMPT_LENS = [5, 40]  # (one block, and three: a block table with several entries)


def prompts(seed=0, lens=PROMPT_LENS):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lens]


def our_logits(model, ids, slot):
    """Last-position logits of one prompt with every token on LoRA slot `slot` (-1: the base model)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.layers.attention import empty_kv_pool
    from jaxpaged.models.llama import AttentionMetadata, compute_logits, forward

    cfg, n, bs = model.cfg, len(ids), 16
    blocks = -(-n // bs)
    table = np.zeros((1, 8), np.int32)
    table[0, :blocks] = np.arange(1, blocks + 1)
    pos = np.arange(n, dtype=np.int32)
    meta = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(table[0, pos // bs] * bs + pos % bs),
                             token_seq=jnp.zeros(n, jnp.int32), decode_context_lens=jnp.zeros(n, jnp.int32),
                             seq_context_lens=jnp.zeros(1, jnp.int32), continuation_rows=jnp.full(1, -1, jnp.int32),
                             block_tables=jnp.asarray(table))
    pool = empty_kv_pool(cfg.num_layers, blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim, jnp.float32)

    @jax.jit
    def run(params, ids, pool, meta, slots):
        hidden, _ = forward(cfg, params, ids, pool, meta, attention_backend=model.attention_backend,
                            kv_chunk=model.kv_chunk, lora_slots=slots)
        return compute_logits(params, hidden[-1:])[0]

    return np.asarray(run(model.params(), jnp.asarray(ids, jnp.int32), pool, meta, jnp.full(n, slot, jnp.int32)))


@pytest.mark.parametrize("layout", ["per-layer", "stacked", "packed"])
def test_logits_match_hf_with_the_adapter_merged(lora_setup, layout):
    base, adapters = lora_setup
    backend = "cpu" if layout == "packed" else "reference"
    if backend == "cpu" and not cpu_dense.panel():
        pytest.skip("the CPU kernels cannot be built here")
    cfg = model_config_from_hf(base, load_hf_config(base), "float32")
    model = build_model(cfg, per_layer=layout != "stacked", attention_backend=backend)
    model.add_lora_stack(3, 8)
    # slots out of order, one left empty: a slot's index must not matter, an empty slot is the base model
    model.write_lora(2, load_lora_adapter("a1", 1, adapters["a1"], cfg, 8))
    model.write_lora(0, load_lora_adapter("a2", 2, adapters["a2"], cfg, 8))
    hf_base = load_hf_model(base)
    for slot, name in ((2, "a1"), (0, "a2"), (1, None), (-1, None)):
        hf = hf_merged(base, adapters[name]) if name else hf_base
        for ids in prompts():
            ours, ref = our_logits(model, ids, slot), hf_last_logits(hf, ids)
            assert np.abs(ours - ref).max() < 1e-4, (slot, name, len(ids))
            if name:  # (the adapter changes the logits: a test that passed with it ignored would be worthless)
                assert np.abs(ref - hf_last_logits(hf_base, ids)).max() > 1e-2


def test_rank_pattern_and_fused_modules_are_read(lora_setup):
    """a3's o_proj has rank 6 by its rank_pattern, its other modules rank 2; its logits match the merged model."""
    base, adapters = lora_setup
    cfg = model_config_from_hf(base, load_hf_config(base), "float32")
    adapter = load_lora_adapter("a3", 3, adapters["a3"], cfg, 8)
    assert adapter.rank == 6 and adapter.targets == ("o", "gate", "up")
    assert np.count_nonzero(np.abs(adapter.a["o"]).sum(axis=(0, 1))) == 6
    assert np.count_nonzero(np.abs(adapter.a["gate"]).sum(axis=(0, 1))) == 2
    model = build_model(cfg)
    model.add_lora_stack(1, 8)
    model.write_lora(0, adapter)
    hf = hf_merged(base, adapters["a3"])
    for ids in prompts(1):
        assert np.abs(our_logits(model, ids, 0) - hf_last_logits(hf, ids)).max() < 1e-4


def engine(base, **kw):
    return LLM(base, enable_lora=True, max_lora_rank=8, compile_guard=True, max_num_seqs=8,
               max_num_batched_tokens=64, num_kv_blocks=96, max_model_len=128, **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def hf_outputs(base, adapters, cases):
    models = {}
    out = []
    for ids, name in cases:
        if name not in models:
            models[name] = hf_merged(base, adapters[name]) if name else load_hf_model(base)
        out.append(hf_greedy(models[name], ids, GREEDY.max_tokens))
    return out


def test_mixed_batch_greedy_equals_hf(lora_setup):
    """Two adapters of different ranks and targets and the base model in the same steps (a decode of one beside
    the prefill of another), no compile after warmup; each output equals HF's with its adapter merged."""
    base, adapters = lora_setup
    llm = engine(base, max_loras=2)
    requests = {"a1": LoRARequest("a1", 1, adapters["a1"]), "a2": LoRARequest("a2", 2, adapters["a2"]), None: None}
    cases = [(ids, name) for ids, name in zip(prompts(2, [5, 17, 30, 9, 40, 12]), ["a1", "a2", None] * 2)]
    outs = llm.generate([ids for ids, _ in cases], GREEDY, lora_request=[requests[n] for _, n in cases])
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(base, adapters, cases)
    assert llm.engine.scheduler.loras.num_loads == 2


def test_lru_swapping_with_one_slot(lora_setup):
    """max_loras=1 with three adapters and the base model: adapters take turns in the one slot (each load waits for
    the slot's requests to end; the base model's requests run meanwhile); outputs equal HF's; n=2 forks share
    the slot."""
    base, adapters = lora_setup
    llm = engine(base, max_loras=1)
    requests = {n: LoRARequest(n, i, adapters[n]) for i, n in enumerate(("a1", "a2", "a3"), 1)}
    requests[None] = None
    names = ["a1", "a2", None, "a3", "a1", None, "a2"]
    cases = list(zip(prompts(3, [6, 20, 8, 33, 11, 7, 25]), names))
    outs = llm.generate([ids for ids, _ in cases], GREEDY, lora_request=[requests[n] for _, n in cases])
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(base, adapters, cases)
    assert llm.engine.scheduler.loras.num_loads >= 3
    two = llm.generate([cases[0][0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2),
                       lora_request=requests["a1"])[0]
    assert [o.token_ids for o in two.outputs] == [outs[0].outputs[0].token_ids] * 2


def test_prefix_cache_is_keyed_by_adapter(lora_setup):
    """A prompt cached under one adapter is a hit for that adapter again, never for the base model or another
    adapter (whose K/V differ), and their outputs stay HF's."""
    base, adapters = lora_setup
    llm = engine(base, max_loras=2, enable_prefix_caching=True)
    ids = prompts(4, [50])[0]
    requests = {"a1": LoRARequest("a1", 1, adapters["a1"]), "a2": LoRARequest("a2", 2, adapters["a2"]), None: None}
    order = ["a1", None, "a2", "a1"]
    outs = [llm.generate([ids], GREEDY, lora_request=requests[n], use_tqdm=False)[0] for n in order]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 48]
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(base, adapters, [(ids, n) for n in order])


def test_beam_search_runs_the_adapter(lora_setup):
    """Beams of an adapter's prompt fork under the adapter (sharing its slot): the best beam of width 1 is the
    greedy output with the adapter, HF's with it merged."""
    from jaxpaged import BeamSearchParams

    base, adapters = lora_setup
    llm = engine(base, max_loras=1)
    ids = prompts(6, [12])[0]
    a2 = LoRARequest("a2", 2, adapters["a2"])
    one = llm.beam_search([ids], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True), lora_request=a2)[0]
    assert one.sequences[0].tokens[len(ids):] == hf_greedy(hf_merged(base, adapters["a2"]), ids, 8)
    wide = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True), lora_request=a2)[0]
    assert len(wide.sequences) == 3 and llm.engine.scheduler.loras.users == [0]


def test_snapshot_keeps_each_requests_adapter(lora_setup, tmp_path):
    """Requests saved mid-generation with their adapters finish after a restart as they would have (HF's), the
    adapters found again by name and folder."""
    from jaxpaged.engine.output_processor import RequestOutputKind

    base, adapters = lora_setup
    cases = list(zip(prompts(7, [10, 14]), ["a3", None]))
    first = engine(base, max_loras=1)
    for ids, name in cases:
        lora = LoRARequest(name, 3, adapters[name]) if name else None
        first.engine.add_request(None, ids, GREEDY, lora_request=lora, output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(4):
        first.engine.step()
    assert first.save_state(str(tmp_path)) == 2
    second = engine(base, max_loras=1)
    ids = second.load_state(str(tmp_path))
    outs = second.run_until_finished(ids)
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(base, adapters, cases)
