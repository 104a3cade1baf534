"""The model names a server's clients may give as `model`: the base model's
(--served-model-name) and its LoRA adapters' (vLLM's --lora-modules).

Each adapter gets a name and an id (1, 2, ... in the order added) and is checked against
the model when added, so a bad adapter stops start-up, or fails its load request with a
400, instead of failing requests later. With --allow-runtime-lora-updating,
/v1/load_lora_adapter and /v1/unload_lora_adapter change the set while serving; an
unloaded adapter's requests still running finish with it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator

from pagedllm.errors import ConfigError, InvalidRequestError
from pagedllm.lora_request import LoRARequest


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (404)."""


def parse_lora_module(text: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules entry: name=path, or vLLM's JSON object
    {"name": ..., "path": ...} (a base_model_name in it is ignored: one base model)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules {text!r}: not valid JSON: {e}") from None
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("path"), str)):
            raise ConfigError(f"--lora-modules {text!r}: expected an object with string "
                              f"\"name\" and \"path\"")
        return entry["name"], entry["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules {text!r}: expected name=path")
    return name, path


class ServedModels:
    """The base model's names, and name -> LoRARequest of the adapters served beside it.

    `check` (None: LoRA is off) raises InvalidRequestError for an adapter that cannot
    run on this engine."""

    def __init__(self, base_names: list[str],
                 check: Callable[[LoRARequest], None] | None = None) -> None:
        self.base_names = base_names
        self._check = check
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def model_name(self) -> str:
        """The base model's first name: what responses of base-model requests carry."""
        return self.base_names[0]

    def add(self, name: str, path: str) -> LoRARequest:
        if self._check is None:
            raise InvalidRequestError("LoRA adapters need the engine started with "
                                      "--enable-lora")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequestError("lora_name and lora_path must be non-empty strings")
        if name in self._by_name or name in self.base_names:
            raise InvalidRequestError(f"The model name `{name}` is already in use.")
        lora = LoRARequest(name, next(self._ids), path)
        self._check(lora)
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise ModelNotFoundError(f"The LoRA adapter `{name}` is not loaded.")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names: None for the base model (or no name);
        ModelNotFoundError for a name this server does not serve."""
        if model is None or model in self.base_names:
            return None
        lora = self._by_name.get(model)
        if lora is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        return lora

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))
