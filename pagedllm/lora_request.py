"""LoRARequest: which LoRA adapter a request runs with (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors).

    `lora_int_id` (>= 1) identifies the adapter everywhere: in the workers' loaded
    adapters, in the scheduler's count of adapters per step and in prefix-cache hashes
    (equal prompts under different adapters never share KV blocks). One id must always
    name the same adapter.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
