"""Write a draft model for speculative decoding from a model's first layers: the same
embeddings, final norm and head, and its first N decoder layers (a "layer skip" draft;
same vocabulary by construction). For measuring the draft-model path when no smaller
model of the vocabulary is at hand.

    .venv/bin/python scripts/make_layer_skip_draft.py OUT_DIR [--layers 8] [--model PATH]

(default model: the bundled SmolLM2-135M-Instruct GGUF, dequantized to bfloat16.)
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedllm.config import default_model_path
from pagedllm.loader import iter_weights, load_tokenizer
from pagedllm.loader.hf_config import load_hf_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers to keep")
    parser.add_argument("--model", default=None, help="source model (default: bundled)")
    ns = parser.parse_args()
    path = ns.model or default_model_path()
    config = load_hf_config(path)
    tensors = {}
    for name, tensor in iter_weights(path, config, torch.bfloat16):
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match is None or int(match.group(1)) < ns.layers:
            tensors[name] = tensor.contiguous()
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.num_hidden_layers = ns.layers
    config.save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    print(f"wrote {out}: {ns.layers} of the layers of {path}")


if __name__ == "__main__":
    main()
