"""Hugging Face model ids ("org/name") resolved to a local snapshot directory.

Through `huggingface_hub.snapshot_download`: from the local cache when HF_HUB_OFFLINE=1
(nothing is fetched), downloading what is missing otherwise. Only the files pagedllm
reads are fetched: configs, safetensors weights, tokenizer files and chat templates (and
the repository's Python files with trust_remote_code, for its auto_map classes).
"""

from __future__ import annotations

import re

from pagedllm.errors import ModelLoadError

# "org/name" (one slash, Hub-legal characters): anything else is a local path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
WEIGHT_PATTERNS = ["*.safetensors"]
CODE_PATTERNS = ["*.py"]


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "~"))


def resolve_repo_id(repo_id: str, revision: str | None = None,
                    cache_dir: str | None = None, token: str | None = None,
                    weights: bool = True, code: bool = False,
                    ignore_patterns: list[str] | None = None) -> str:
    """The local directory of `repo_id` at `revision` (a branch, tag or commit): its
    configs and tokenizer files, its weights unless `weights` is False, its Python files
    with `code` (trust_remote_code), but no file `ignore_patterns` match (vLLM's
    default: "original/**/*", the original checkpoint some repositories carry beside
    the HF one). `token`: the Hub's (None: HF_TOKEN or the stored login)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        patterns = (TOKENIZER_PATTERNS + (WEIGHT_PATTERNS if weights else [])
                    + (CODE_PATTERNS if code else []))
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=patterns, token=token,
                                 ignore_patterns=list(ignore_patterns or ()) or None)
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(
            f"model {repo_id!r}{f' (revision {revision!r})' if revision else ''} is not a "
            f"local path and is not in the Hugging Face cache, and downloading is off "
            f"(HF_HUB_OFFLINE) or failed: {e}") from e
    except (HFValidationError, OSError, ValueError) as e:
        raise ModelLoadError(f"cannot fetch model {repo_id!r} from the Hugging Face Hub: "
                             f"{e}") from e
