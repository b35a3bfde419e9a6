"""Beam search equals HF transformers' (num_beams=W, early_stopping=True), and beams share blocks."""

import json
import shutil

import numpy as np
import pytest
import torch

from jaxpaged import LLM, BeamSearchParams
from tests.tiny_models import load_hf_model

PROMPTS = [[5, 17, 99, 3, 44], list(range(10, 40)), [200, 7, 7, 19, 60, 61, 62, 130, 5, 88, 9, 250, 31]]


@pytest.fixture(scope="module")
def model_with_frequent_eos(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with EOS set to a token that beams reach early, so hypotheses end mid-search."""
    src = tiny_model_dir("llama")
    hf = load_hf_model(src)
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=12, num_beams=4, num_return_sequences=4,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    best, second = out[0].tolist(), out[1].tolist()
    eos = next(b for a, b in zip(best, second) if a != b)  # where the second beam leaves the best one
    dst = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        f = dst / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    return str(dst), eos


def hf_beam_search(hf, ids, width, max_tokens, eos, length_penalty):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, num_beams=width, num_return_sequences=width,
                          do_sample=False, early_stopping=True, length_penalty=length_penalty, eos_token_id=eos,
                          pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    seqs = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        gen = row[len(ids):]
        if eos is not None and eos in gen:
            gen = gen[: gen.index(eos) + 1]
        seqs.append((gen, score))
    return seqs


@pytest.fixture(scope="module")
def llm_and_hf(model_with_frequent_eos):
    path, eos = model_with_frequent_eos
    return LLM(path, num_kv_blocks=96, max_num_batched_tokens=64, compile_guard=True), load_hf_model(path), eos


@pytest.mark.parametrize("width,length_penalty,ignore_eos", [(3, 1.0, False), (4, 0.5, False), (2, 1.0, True),
                                                             ("sync", 1.0, False)])
def test_beam_search_matches_hf(llm_and_hf, model_with_frequent_eos, width, length_penalty, ignore_eos):
    llm, hf, eos = llm_and_hf
    if width == "sync":  # width 3 on an engine without async scheduling
        width, llm = 3, LLM(model_with_frequent_eos[0], num_kv_blocks=96, max_num_batched_tokens=64,
                            compile_guard=True, async_scheduling=False)
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty, ignore_eos=ignore_eos)
    outs = llm.beam_search(PROMPTS, params, use_tqdm=False)
    ended_by_eos = 0
    for ids, out in zip(PROMPTS, outs):
        want = hf_beam_search(hf, ids, width, 12, None if ignore_eos else eos, length_penalty)
        got = [(s.tokens[len(ids):], s.score) for s in out.sequences]
        assert [g for g, _ in got] == [w for w, _ in want], f"prompt of {len(ids)} tokens"
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-4, atol=1e-4)
        for s in out.sequences:
            assert s.tokens[: len(ids)] == ids
            gen = len(s.tokens) - len(ids)
            assert s.score == pytest.approx(s.cum_logprob / gen ** length_penalty, rel=1e-6)
            ended_by_eos += s.finish_reason == "stop"
    if not ignore_eos:
        assert ended_by_eos > 0  # the EOS path was exercised
    assert llm.engine.kv_cache_manager.num_free_blocks == 95  # every beam freed its blocks


def test_beams_share_blocks_and_copy_on_write(model_with_frequent_eos):
    """With sharing, peak blocks stay well below one private copy per beam; without it, forks copy."""
    path, _ = model_with_frequent_eos
    peaks, copies, tokens = {}, {}, {}
    for share in (True, False):
        llm = LLM(path, num_kv_blocks=256, block_size=16, share_forked_blocks=share, compile_guard=True)
        outs = llm.beam_search([list(range(3, 43))], BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True),
                               use_tqdm=False)
        peaks[share] = llm.engine.stats.peak_kv_blocks_used
        copies[share] = llm.engine.kv_cache_manager.num_cow_copies
        tokens[share] = [s.tokens for s in outs[0].sequences]
        assert llm.engine.kv_cache_manager.num_free_blocks == 255
    assert tokens[True] == tokens[False] and len(tokens[True]) == 4
    # 40 prompt + 20 new tokens = 4 blocks per beam: 16 unshared; shared, the 2 full prompt blocks are held once.
    assert peaks[False] >= 14 and peaks[True] <= peaks[False] - 4, peaks
    assert copies[True] > 0  # beams forked mid-block and copied that block on their first write


def test_more_prompts_than_max_num_seqs_holds_beams(model_with_frequent_eos, llm_and_hf):
    """Searches queue when max_num_seqs has no room for their beams; results equal HF's all the same."""
    path, eos = model_with_frequent_eos
    _, hf, _ = llm_and_hf
    llm = LLM(path, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=64, compile_guard=True)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=8), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert [s.tokens[len(ids):] for s in out.sequences] == [g for g, _ in hf_beam_search(hf, ids, 2, 8, eos, 1.0)]
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=5, max_tokens=8), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=8)


@pytest.mark.parametrize("share", [True, False])
def test_beam_search_under_block_pressure_recomputes_held_beams(model_with_frequent_eos, llm_and_hf, share):
    """A pool too small for all beams, in swap mode: held beams are never swapped (a beam may be forked while it
    waits, and a swapped copy would not follow), so they are preempted by recompute, and forks may copy; the
    results are still HF's."""
    path, eos = model_with_frequent_eos
    _, hf, _ = llm_and_hf
    llm = LLM(path, num_kv_blocks=10, max_num_batched_tokens=64, compile_guard=True, preemption_mode="swap",
              swap_space=1e-3, share_forked_blocks=share)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=12), use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert [s.tokens[len(ids):] for s in out.sequences] == [g for g, _ in hf_beam_search(hf, ids, 3, 12, eos, 1.0)]
    kv, sched = llm.engine.kv_cache_manager, llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swaps == 0
    assert kv.num_free_blocks == 9 and len(kv.host_free) == kv.num_host_blocks
