"""The bundled GGUF as an HF bfloat16 directory (for vLLM, which does not run GGUF on
CPU): transformers dequantizes it; the weights then go into a fresh model built from the
same config, so no GGUF quantization config is saved with them.

    python scripts/side_by_side/to_hf.py MODEL.gguf OUT_DIR
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(src: str, out: str) -> None:
    folder, name = os.path.dirname(src), os.path.basename(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                  torch_dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
