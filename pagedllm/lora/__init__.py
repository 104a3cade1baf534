"""LoRA adapters (PEFT's format) applied per request on top of the base model's linears."""
