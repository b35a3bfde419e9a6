"""The AWQ / GPTQ checkpoints of docs/benchmarks/quantization.md: the default model (SmolLM2-135M, the shipped Q4_1
GGUF, dequantized by transformers) as an HF float folder, then as AWQ and GPTQ (act order) checkpoints written by
this suite's writers (AutoAWQ's / AutoGPTQ's packing, round-to-nearest), group 32.

    python tests/write_smollm2_awq_gptq.py OUT_DIR   # -> OUT_DIR/{hf,awq,gptq}
"""

import os
import shutil
import sys

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (not tests/: its kernels/)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jaxpaged.models.registry import default_model_path
    from tests.quant_checkpoints import write_quantized_checkpoint

    out = sys.argv[1]
    folder, name = os.path.split(default_model_path())
    hf = os.path.join(out, "hf")
    if not os.path.exists(hf):
        gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
        config = gguf.config
        if hasattr(config, "quantization_config"):  # (transformers will not save a model it calls gguf-quantized)
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        plain.load_state_dict(gguf.state_dict())
        plain.save_pretrained(hf)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(hf)
    for method, options in [("awq", {}), ("gptq", {"act_order": True})]:
        dst = os.path.join(out, method)
        shutil.rmtree(dst, ignore_errors=True)
        write_quantized_checkpoint(hf, dst, method, group=32, bits=4, **options)
        print(dst)
