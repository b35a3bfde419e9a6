"""lm-evaluation-harness itself against `jaxpaged serve`: loglikelihood (multiple choice), loglikelihood_rolling
and generate_until tasks through `local-completions`, generate_until through `local-chat-completions`; every
per-sample result checked against HF transformers' logprobs or the engine's Python API."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from tests.server.conftest import ENGINE_ARGS, LiveServer
from tests.tiny_models import load_hf_model

lm_eval = pytest.importorskip("lm_eval")

MC_DOCS = [{"question": "Q: 2 + 2 =", "choices": [" 4", " 5", " 22"], "answer": 0},
           {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
           {"question": "a b c", "choices": [" d", " e f", " the end"], "answer": 2},
           {"question": "Hello", "choices": [" there", " world", " in", " at"], "answer": 1}]
TEXT_DOCS = [{"text": "the cat sat on the mat"}, {"text": "in a hole in the ground there lived a hobbit"}]
GEN_DOCS = [{"question": "Say hi:", "answer": "hi"}, {"question": "the the the", "answer": "the"},
            {"question": "x y z", "answer": "w"}]

TASKS = {
    "jp_mc": ("mc.jsonl", MC_DOCS, """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]"""),
    "jp_rolling": ("text.jsonl", TEXT_DOCS, """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list: [{metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}]"""),
    "jp_gen": ("gen.jsonl", GEN_DOCS, """
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{answer}}"
        generation_kwargs: {until: ["\\n", "in"], max_gen_toks: 6, do_sample: false, temperature: 0}
        metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]"""),
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (data, docs, spec) in TASKS.items():
        (d / data).write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (d / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                        f"    test: {d / data}\ntest_split: test" + textwrap.dedent(spec) + "\n")
    return str(d)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-bytes")  # a byte-level BPE tokenizer, as real models have


@pytest.fixture(scope="module")
def server(model_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=model_dir, **ENGINE_ARGS))
    s = LiveServer(engine, None)
    yield s
    s.stop()


def evaluate(model: str, base_url: str, tasks: list[str], task_dir: str, **kw):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    args = f"model=tiny,base_url={base_url},num_concurrent=4,max_retries=1,max_length=200"
    return simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=TaskManager(include_path=task_dir),
                           log_samples=True, bootstrap_iters=0, **kw)


def hf_scorer(model_dir):
    """(context ids, continuation ids) -> (sum of the continuation's logprobs, whether it is the greedy one)."""
    import torch

    hf = load_hf_model(model_dir)

    def score(ctx: list[int], cont: list[int]) -> tuple[float, bool]:
        ids = (ctx + cont)[-201:]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        rows = lp[len(ids) - len(cont) - 1: len(ids) - 1]
        return float(rows[torch.arange(len(cont)), cont].sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())
    return score


def test_local_completions_scores_equal_hf_and_the_engine(server, task_dir, model_dir):
    from lm_eval import utils
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    out = evaluate("local-completions", server.base_url + "/v1/completions", ["jp_mc", "jp_rolling", "jp_gen"],
                   task_dir, batch_size=2)
    # The harness found /tokenizer_info and /tokenize and tokenizes through the server; so do we.
    lm = LocalCompletionsAPI(base_url=server.base_url + "/v1/completions", model="tiny", max_length=200)
    assert lm.tokenizer_backend == "remote"
    score = hf_scorer(model_dir)

    samples = out["samples"]["jp_mc"]
    correct = []
    for s in samples:
        got = [r[0] for r in s["resps"]]
        want = [score(*lm._encode_pair(ctx, cont)) for ctx, cont in s["arguments"]]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-3)
        assert [g[1] for g in got] == [w[1] for w in want]
        correct.append(int(np.argmax([w[0] for w in want]) == s["target"]))
    assert out["results"]["jp_mc"]["acc,none"] == pytest.approx(np.mean(correct))

    for s in out["samples"]["jp_rolling"]:
        (text,) = s["arguments"][0]
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=lm.tok_encode(text), prefix_token=lm.prefix_token_id, max_seq_len=199, context_len=1))
        want = sum(score(list(ctx), list(cont))[0] for ctx, cont in windows)
        assert s["resps"][0][0] == pytest.approx(want, abs=1e-3)

    llm = LLM(model_dir, **ENGINE_ARGS)
    gen = out["samples"]["jp_gen"]
    prompts = [lm.tok_encode(s["arguments"][0][0]) for s in gen]
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=6, stop=["\n", "in"]), use_tqdm=False)
    assert [s["resps"][0][0] for s in gen] == [r.outputs[0].text for r in ref]
    assert any(r.outputs[0].text for r in ref)  # (not a vacuous equality of empty strings)
    want_em = np.mean([r.outputs[0].text.strip() == s["target"] for r, s in zip(ref, gen)])
    assert out["results"]["jp_gen"]["exact_match,none"] == pytest.approx(want_em)

    chat = evaluate("local-chat-completions", server.base_url + "/v1/chat/completions", ["jp_gen"], task_dir,
                    apply_chat_template=True)
    chat_gen = chat["samples"]["jp_gen"]
    conversations = [json.loads(s["arguments"][0][0].prompt) for s in chat_gen]
    ref = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=6, stop=["\n", "in"]), use_tqdm=False)
    assert [s["resps"][0][0] for s in chat_gen] == [r.outputs[0].text for r in ref]
