"""Prompts given as input embeddings (vLLM's prompt_embeds): checked, and turned into
what a request carries.

A caller that builds its prompt's embeddings itself (soft prompts, embeddings from
another model) passes them as `{"prompt_embeds": tensor [tokens, hidden_size]}` offline,
or base64 of `torch.save(tensor)` to the completions API. The request then holds one
PromptEmbedsInput over its whole prompt and placeholder token ids (0), counted as its
prompt tokens; the runner puts the rows in place of their embeddings
(worker/mm_encoder.py), and the prefix cache keys its blocks on the rows' hash.
"""

from __future__ import annotations

import base64
import binascii
import io
import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.errors import InvalidRequestError
from pagedllm.mm_inputs import PromptEmbedsInput, pixels_hash
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# The token id a prompt's embedded positions hold (any id would do: none is read).
PLACEHOLDER_ID = 0


def prompt_embeds_of(prompt: Any) -> Any:
    """The prompt's `prompt_embeds` (a dict's), or None for a token or text prompt."""
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:
        if "prompt" in prompt or "prompt_token_ids" in prompt:
            raise InvalidRequestError("a prompt gives either prompt_embeds or a prompt "
                                      "(text or token ids), not both")
        if prompt.get("multi_modal_data") is not None:
            raise InvalidRequestError("prompt_embeds cannot be given with "
                                      "multi_modal_data (embed the images into them)")
        return prompt["prompt_embeds"]
    return None


def check_embeds(embeds: Any, hidden_size: int) -> torch.Tensor:
    """A prompt's embeddings as rows [tokens, hidden_size] (a batch of one accepted)."""
    import torch  # here: the front end imports this module without torch

    if not isinstance(embeds, torch.Tensor) or embeds.layout != torch.strided:
        raise InvalidRequestError(f"prompt_embeds must be a dense torch.Tensor [tokens, "
                                  f"hidden_size], got {_kind(embeds)}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise InvalidRequestError(f"prompt_embeds must have shape [tokens, {hidden_size}] "
                                  f"(the model's hidden size), got {list(embeds.shape)}")
    if not embeds.is_floating_point():
        raise InvalidRequestError(f"prompt_embeds must be floating point, got "
                                  f"{embeds.dtype}")
    if embeds.shape[0] == 0:
        raise InvalidRequestError("prompt_embeds is empty: give at least one row")
    return embeds


def embeds_input(embeds: torch.Tensor) -> PromptEmbedsInput:
    """What a request carries of checked rows (check_embeds): float32, and hashed."""
    import torch

    rows = np.ascontiguousarray(embeds.detach().to("cpu", torch.float32).numpy())
    if not np.isfinite(rows).all():
        raise InvalidRequestError("prompt_embeds holds NaN or infinite values")
    return PromptEmbedsInput(rows=rows, hash=pixels_hash(rows), offset=0,
                             length=rows.shape[0])


def check_embeds_params(params: SamplingParams) -> None:
    """What an embeddings prompt cannot do: it has no tokens to score or penalize."""
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs needs a prompt of tokens; this one is "
                                  "prompt_embeds")
    if params.repetition_penalty != 1:
        raise InvalidRequestError("repetition_penalty counts the prompt's tokens; this "
                                  "prompt is prompt_embeds (presence_penalty and "
                                  "frequency_penalty count only the output)")


def decode_prompt_embeds(data: str) -> torch.Tensor:
    """A tensor from the API's form: base64 of `torch.save(tensor)` (its zip format).

    The bytes are a client's, so: loaded with weights_only (plain tensors and
    containers; nothing a file could run), every archive entry stored uncompressed (a
    small body may not inflate to gigabytes; torch.save compresses nothing), and sparse
    tensors' invariants checked as they load (vLLM's CVE-2025-62164: a crafted sparse
    tensor wrote out of bounds when made dense); only dense tensors are taken after."""
    import torch

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"prompt_embeds is not valid base64: {e}") from e
    _check_archive(raw)
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the bytes make torch.load raise
        first_line = str(e).strip().split("\n")[0][:200]
        raise InvalidRequestError(f"prompt_embeds is not a tensor saved with torch.save: "
                                  f"{type(e).__name__}: {first_line}") from e
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"prompt_embeds must hold one tensor, got "
                                  f"{type(tensor).__name__}")
    return tensor


def _check_archive(raw: bytes) -> None:
    """torch.save's zip archive, every entry stored as it is (no inflating)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError) as e:
        raise InvalidRequestError(f"prompt_embeds is not a tensor saved with torch.save "
                                  f"(its zip format): {e}") from e
    packed = [i.filename for i in entries if i.compress_type != zipfile.ZIP_STORED
              or i.file_size > len(raw)]
    if packed:
        raise InvalidRequestError(f"prompt_embeds: archive entry {packed[0]!r} is "
                                  f"compressed; save the tensor with torch.save as it is")


def _kind(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of layout {value.layout}"
    return type(value).__name__
