"""`pagedllm chat`: a terminal chat with the model, one stdin line per user turn.

Runs an in-process LLMEngine (no server) and prints the reply as it is generated. The
conversation is kept and re-sent through the chat template each turn, so the prefix
cache serves the earlier turns. `/reset` clears it, `/exit` or end of input quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InvalidRequestError
from pagedllm.sampling_params import SamplingParams


def run_chat(engine_args: EngineArgs, ns: argparse.Namespace, stdin: TextIO = sys.stdin,
             stdout: TextIO = sys.stdout) -> int:
    engine = LLMEngine.from_engine_args(engine_args)
    tokenizer = engine.get_tokenizer()
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    history: list[dict[str, Any]] = []
    interactive = stdin.isatty()
    turn = 0
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            stdout.write("[conversation cleared]\n")
            continue
        history.append({"role": "user", "content": line})
        text = tokenizer.apply_chat_template(system + history, tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p,
                                max_tokens=ns.max_tokens, seed=ns.sampling_seed)
        try:
            reply = _stream_reply(engine, f"chat-{turn}", {"prompt": text,
                                                         "prompt_token_ids": ids},
                                  params, stdout)
        except InvalidRequestError as e:
            history.pop()
            stdout.write(f"[error: {e}]\n")
            continue
        except KeyboardInterrupt:
            engine.abort_request([f"chat-{turn}"])
            history.pop()
            stdout.write("\n[interrupted]\n")
            continue
        finally:
            turn += 1
        history.append({"role": "assistant", "content": reply})
    return 0


def _stream_reply(engine: LLMEngine, req_id: str, prompt: dict, params: SamplingParams,
                  stdout: TextIO) -> str:
    """Generate one reply, writing text as it arrives; returns the whole reply."""
    engine.add_request(req_id, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            new_text = out.outputs[0].text
            if len(new_text) > len(text):
                stdout.write(new_text[len(text):])
                stdout.flush()
                text = new_text
    stdout.write("\n")
    stdout.flush()
    return text
