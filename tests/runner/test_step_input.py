"""The persistent batch and the vectorized step builder, against hand-worked arrays."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged.request import Request
from jaxpaged.runner.input_batch import InputBatch
from jaxpaged.runner.step_input import StepGeometry, StepPacker, build_step_input, step_order
from jaxpaged.sampling_params import SamplingParams

GEO = StepGeometry(block_size=4, num_blocks=32, table_width=8)


def make_batch():
    batch = InputBatch(num_rows=4, max_model_len=32, table_width=8)
    a = Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(temperature=0.5, top_k=3, seed=7), seed=7)
    a.output_token_ids = [20, 21]  # 8 known tokens, decoding
    b = Request("b", [30, 31, 32, 33, 34], SamplingParams(prompt_logprobs=1, min_tokens=2), seed=1)
    c = Request("c", [40, 41, 42], SamplingParams(logprobs=2), seed=2)
    rows = [batch.add(a, [5, 9]), batch.add(b, [3, 4]), batch.add(c, [7])]
    return batch, rows, (a, b, c)


def test_rows_carry_tokens_tables_and_settings():
    batch, rows, (a, b, c) = make_batch()
    assert rows == [0, 1, 2] and a.batch_row == 0 and batch.row_of == {"a": 0, "b": 1, "c": 2}
    assert batch.token_ids[0, :8].tolist() == [10, 11, 12, 13, 14, 15, 20, 21] and batch.num_known[0] == 8
    assert batch.block_table[1, :3].tolist() == [3, 4, 0] and batch.num_blocks[1] == 2
    batch.append_blocks(1, [6])
    assert batch.block_table[1, :3].tolist() == [3, 4, 6]
    assert (batch.temperature[0], batch.top_k[0], batch.seed[0], batch.min_tokens[1], batch.num_logprobs[2]) == (
        0.5, 3, 7, 2, 2)
    gen = batch.generation[2]
    batch.remove("c")
    assert c.batch_row == -1 and batch.generation[2] == gen + 1 and batch.add(c, [7]) == 2


def test_step_layout_positions_slots_and_draws():
    batch, rows, _ = make_batch()
    # a: decode of its 9th token (position 8, not known on the host: the device feeds it);
    # b: prompt chunk of 3 tokens from position 2; c: fresh prefill of 3 tokens.
    sched_rows, n, start = np.array([2, 0, 1]), np.array([3, 1, 3]), np.array([0, 8, 2])
    samples = np.array([True, True, False])
    inp, plan = build_step_input(batch, sched_rows, n, start, samples, 16, 4, GEO, np.zeros(4, bool))
    assert plan.order.tolist() == [1, 2, 0]  # decode, continuation, fresh prefill
    assert step_order(start, n).tolist() == [1, 2, 0]
    assert inp.attn.positions[:7].tolist() == [8, 2, 3, 4, 0, 1, 2]
    assert inp.token_ids[1:7].tolist() == [32, 33, 34, 40, 41, 42]
    assert inp.from_device[:7].tolist() == [True] + [False] * 6
    # slot = block * 4 + offset: a's position 8 is in its 3rd block (none yet: 0); b's 2..4 in blocks 3, 4
    assert inp.attn.slot_mapping[1:7].tolist() == [3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]
    assert inp.attn.slot_mapping[7:].tolist() == [GEO.pad_slot] * 9
    assert inp.attn.token_seq[:8].tolist() == [0, 1, 1, 1, 2, 2, 2, -1]
    assert int(inp.attn.num_real_tokens) == 7  # the dense layers' rows (the rest is padding to 16)
    assert int(inp.head_rows) == 3  # the LM head's rows: up to c, the last that draws (b's chunk draws nothing)
    assert inp.attn.decode_context_lens[:2].tolist() == [8, 0] and inp.attn.seq_context_lens.tolist() == [8, 2, 0, 0]
    assert inp.attn.continuation_rows.tolist() == [1, -1, -1, -1]
    assert inp.logits_indices.tolist() == [0, 3, 6, 0]
    assert inp.draw_rows.tolist() == [0, 4, 2, 4]  # b's chunk draws nothing; padding rows point past the batch
    assert inp.sampling.steps[:3].tolist() == [3, 0, 0]  # output index drawn: a's 3rd, c's 1st
    assert inp.sampling.processors.suppress_stop[:3].tolist() == [False, True, False]  # b: min_tokens 2
    assert inp.next_prompt_ids[1:4].tolist() == [33, 34, -1]  # b wants prompt logprobs: the next prompt token
    assert inp.sampling.processors.token_is_output[:7].tolist() == [True] + [False] * 6
    assert plan.num_prompt_tokens == 6 and plan.wants_logprobs and plan.wants_prompt_logprobs
    assert plan.draw_positions.tolist() == [9, 5, 3]


def test_packer_round_trip():
    batch, _, _ = make_batch()
    inp, _ = build_step_input(batch, np.array([0, 2]), np.array([1, 3]), np.array([8, 0]), np.array([True, True]),
                              16, 4, GEO, np.zeros(4, bool))
    packer = StepPacker(inp)
    ints, floats = packer.pack(inp)
    back = packer.unpack(ints, floats)
    import jax

    for x, y in zip(jax.tree.leaves(inp), jax.tree.leaves(back)):
        assert np.asarray(y).dtype == np.asarray(x).dtype
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_drawn_tokens_land_only_in_rows_still_theirs():
    batch, _, (a, _, c) = make_batch()
    gens = batch.generation[[0, 2]].copy()
    batch.remove("c")  # c's row changes hands before its step's results arrive
    d = Request("d", [50, 51, 52], SamplingParams(), seed=0)
    batch.add(d, [8])
    batch.record_tokens(np.array([0, 2]), np.array([8, 3]), np.array([99, 77]), gens)
    assert batch.token_ids[0, 8] == 99 and batch.num_known[0] == 9
    assert batch.token_ids[2, :4].tolist() == [50, 51, 52, 0] and batch.num_known[2] == 3


def test_sampling_settings_per_sequence_and_neutral_padding():
    """Each scheduled sequence carries its request's settings in step order; padding rows are neutral (no
    penalty, no filter, nothing suppressed); every array has the dtype the compiled step was built for."""
    import jax

    batch = InputBatch(num_rows=4, max_model_len=32, table_width=8)
    a = Request("a", [10, 11, 12], SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1, presence_penalty=0.5,
                                                  frequency_penalty=0.25, repetition_penalty=1.3, min_tokens=4,
                                                  logit_bias={5: 1.0}), seed=3)
    a.output_token_ids = [20]
    b = Request("b", [30, 31], SamplingParams(), seed=4)
    batch.add(a, [1]), batch.add(b, [2])
    inp, plan = build_step_input(batch, np.array([0, 1]), np.array([1, 2]), np.array([3, 0]),
                                 np.array([True, True]), 16, 4, GEO, np.zeros(4, bool))
    s, p = inp.sampling, inp.sampling.processors
    assert plan.order.tolist() == [0, 1]  # a decodes, b prefills
    assert s.temperature.tolist() == pytest.approx([0.7, 1.0, 0.0, 0.0])
    assert s.top_p.tolist() == pytest.approx([0.8, 1.0, 1.0, 1.0]) and s.top_k.tolist() == [0, 0, 0, 0]
    assert s.seeds.tolist() == [3, 4, 0, 0] and s.num_logprobs.tolist() == [-1, -1, -1, -1]
    assert p.repetition_penalty.tolist() == pytest.approx([1.3, 1.0, 1.0, 1.0])
    assert p.presence_penalty.tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])
    assert p.frequency_penalty.tolist() == pytest.approx([0.25, 0.0, 0.0, 0.0])
    assert p.min_p.tolist() == pytest.approx([0.1, 0.0, 0.0, 0.0])
    assert p.use_bias.tolist() == [True, False, False, False]
    assert p.suppress_stop.tolist() == [True, False, False, False]  # a draws its 2nd token (< min 4); b: min 0
    assert p.row_slot.tolist()[:2] == [0, 1]
    assert inp.next_prompt_ids.tolist() == [-1] * 16
    expected = {"from_device": bool, "use_bias": bool, "suppress_stop": bool, "token_is_output": bool,
                "reset_slots": bool, "seeds": np.uint32}
    for path, leaf in jax.tree_util.tree_leaves_with_path(inp):
        name = jax.tree_util.keystr(path).rsplit(".", 1)[-1]
        want = expected.get(name, np.float32 if leaf.dtype.kind == "f" else np.int32)
        assert leaf.dtype == want, (name, leaf.dtype)
    assert batch.token_ids.dtype == batch.num_known.dtype == batch.block_table.dtype == np.int32
