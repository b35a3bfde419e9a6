"""Pure, jitted generation with `jaxpaged.functional`: no engine, no host loop.

    python examples/functional_generate.py

1. load the default model (SmolLM2-135M-Instruct) as (config, params);
2. `generate`: one compiled program for a batch of chat prompts;
3. a custom decode loop under `lax.scan` that records every step's logits (entropy per step),
   what a researcher writes to analyse decoding.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import functional as F

config, params = F.load()  # an HF folder or .gguf path works too
tokenizer = F.load_tokenizer()

questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"] for q in questions]
tokens, lengths = F.pad_batch(prompts)  # right-padded int32 [B, P], and lengths [B]

# --- 2. generate: prefill + a lax.while_loop of decode steps, one call -------------------------------
out = F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=48,
                 eos_id=config.eos_token_ids)  # greedy; rows padded with EOS after they end
for q, row in zip(questions, np.asarray(out)):
    print(f"{q!r} -> {tokenizer.decode(row, skip_special_tokens=True)!r}")


# --- 3. your own loop: prefill, then lax.scan over decode steps, keeping each step's logits ----------
@jax.jit
def greedy_with_entropy(params, tokens, lengths, steps: int = 16):
    cache = F.init_cache(config, num_seqs=tokens.shape[0], max_len=tokens.shape[1] + steps)
    logits, cache = F.prefill(config, params, cache, tokens, lengths)

    def step(carry, _):
        logits, cache = carry
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        logits, cache = F.decode(config, params, cache, token)
        return (logits, cache), (token, entropy)

    _, (toks, entropy) = jax.lax.scan(step, (logits, cache), length=steps)
    return toks.T, entropy.T  # [B, steps] each


toks, entropy = greedy_with_entropy(params, tokens, lengths)
print("entropy (nats) of the first 8 steps, prompt 0:", [f"{e:.2f}" for e in np.asarray(entropy[0, :8])])
is_eos = np.isin(np.asarray(out[:, :16]), config.eos_token_ids)
before_eos = np.cumsum(is_eos, axis=1) - is_eos == 0  # up to each row's first EOS (generate pads after it)
print("same tokens as generate:", bool((np.asarray(toks) == np.asarray(out[:, :16]))[before_eos].all()))
