"""ServeConfig: the HTTP server's limits and policies (`pagedllm serve` flags).

One flag per field, derived like the engine's (entrypoints/cli.py), so the limits a
request can hit are documented in `pagedllm serve --help` and in one place here.
Every limit protects the process from one request: beyond it the request gets a 400
(413 for the body) naming the limit and the flag that raises it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.content_format import CONTENT_FORMATS
from pagedllm.entrypoints.openai.tool_parsers import (TOOL_PARSER_NAMES, ToolParser,
                                                      get_tool_parser)
from pagedllm.errors import ConfigError
from pagedllm.multimodal.media_fetch import MediaPolicy


# Parameters of apply_chat_template itself: chat_template_kwargs may only add template
# variables, never change how it renders (or smuggle in a template).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "untrusted"})


def _flag(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServeConfig:
    """Limits on what one request may ask for, and the server's admission policies."""

    max_n: int = _flag(128, "most sequences one request generates: n (and best_of), "
                            "times the number of prompts of a completions request")
    max_stop: int = _flag(64, "most entries in each of stop, stop_token_ids and bad_words")
    max_prompt_bytes: int = _flag(1 << 20, "most UTF-8 bytes of one prompt text, or of all "
                                           "message contents of a chat together")
    max_body_bytes: int = _flag(2 << 20, "most bytes of a request body (413 beyond)")
    render_timeout: float = _flag(5.0, "seconds that tokenizing a prompt or rendering a chat "
                                       "template may take (400 beyond)")
    trust_request_chat_template: bool = _flag(
        False, "accept `chat_template` in request bodies (templates are code: a hostile "
               "one can loop; it is still cut off after --render-timeout)")
    request_timeout: float | None = _flag(None, "default deadline in seconds of a request "
                                                "that gives no `timeout` (default: none)")
    keep_alive_timeout: float = _flag(5.0, "seconds a connection may sit idle, before its "
                                           "first request or between two, before it is "
                                           "closed")
    read_timeout: float = _flag(60.0, "seconds a client has to send a request's headers once "
                                      "its connection waits for one, and again for its body "
                                      "(408 beyond)")
    write_timeout: float = _flag(60.0, "seconds a response waits on a client that reads none "
                                       "of it; beyond, the connection is closed and its "
                                       "request aborted")
    h11_max_incomplete_event_size: int = _flag(
        16 * 1024, "most bytes of a request's line and headers (431 beyond); h11's "
                   "default, where vLLM's is 4 MiB")
    h11_max_header_count: int = _flag(256, "most headers of a request (431 beyond)")
    max_connections: int | None = _flag(None, "most open connections: past it the one that "
                                              "has waited longest for a request is closed "
                                              "(default: the open-file limit less 256)")
    max_queued_requests: int | None = _flag(None, "most requests waiting to be scheduled; "
                                                  "beyond, 503 with Retry-After (default: "
                                                  "unbounded)")
    max_num_queued_reqs: int | None = _flag(
        None, "most requests in flight (waiting or running, every data parallel "
              "replica's); past it a request gets 503 with Retry-After (vLLM's)")
    max_num_queued_tokens: int | None = _flag(
        None, "most prompt tokens of the requests still waiting or in their prefill; a "
              "request that would take them past it gets 503 with Retry-After, unless "
              "none are pending (vLLM's time-to-first-token valve: target TTFT x "
              "prefill tokens/s)")
    metrics_without_key: bool = _flag(False, "serve /metrics (and the dashboard's feed, "
                                             "/dashboard/state) without the API key")
    enable_dev_endpoints: bool = _flag(
        False, "serve vLLM's development routes (its VLLM_SERVER_DEV_MODE): POST /pause "
               "and /resume, GET /is_paused (stop generating, e.g. to update weights "
               "between RL steps) and POST /collective_rpc (a worker method by name); "
               "whoever holds the API key can then stop the server's work")
    chat_template: str | None = _flag(
        None, "a Jinja chat template, or the path of a file holding one, used instead of "
              "the model's (e.g. one that renders `tools`); a request's own `chat_template` "
              "still wins where allowed")
    chat_template_content_format: str = _flag(
        "auto", "how the chat template reads a message's content: string (one text), "
                "openai (a list of parts), or auto: parts when the template loops over a "
                "content (as vLLM detects it), a multimodal model's always")
    response_role: str = _flag(
        "assistant", "the role chat completions' replies name (vLLM's --response-role)")
    enable_auto_tool_choice: bool = _flag(
        False, "let the model decide when to call tools (tool_choice \"auto\", the default "
               "with tools): its output is read by --tool-call-parser")
    tool_call_parser: str | None = field(default=None, metadata={
        "help": "how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: "
                "Qwen, Hermes), llama3_json ({\"name\": ..., \"parameters\": ...}), "
                "mistral ([TOOL_CALLS] [{\"name\": ..., \"arguments\": ...}]), pythonic "
                "([f(a=1), g()]: Llama 3.2 / 4), qwen3_coder (<tool_call><function=f>"
                "<parameter=a>1</parameter></function></tool_call>) or phi4_mini_json "
                "(functools[{\"name\": ..., \"arguments\": ...}]: Phi-4-mini); "
                "vLLM's llama4_json, llama4_pythonic and qwen3_xml are the same readers; "
                "or your own: a ToolParser subclass by qualified name (pkg.module:Class), "
                "or the `name` of one in --tool-parser-plugin; needed by "
                "--enable-auto-tool-choice"})
    tool_parser_plugin: str | None = _flag(
        None, "a Python file defining ToolParser subclasses "
              "(pagedllm.entrypoints.openai.tool_parsers.base) with a class attribute "
              "`name`, which --tool-call-parser then names, as vLLM's plugins")

    enable_per_request_metrics: bool = _flag(
        False, "completion and chat responses carry `metrics` (vLLM's): the request's "
               "queue time, time to first token, generation time, mean inter-token "
               "latency (ms) and tokens per second; a stream on its usage chunk")
    enable_prompt_tokens_details: bool = _flag(
        False, "usage carries prompt_tokens_details.cached_tokens: the prompt tokens the "
               "prefix cache served")
    return_tokens_as_token_ids: bool = _flag(
        False, "logprobs name tokens \"token_id:<id>\" instead of their text, unless a "
               "request says otherwise (its return_tokens_as_token_ids)")
    allowed_origins: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: origins browsers may call the server from, a JSON list "
                "(default: any, as vLLM)"})
    allowed_methods: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: allowed methods, a JSON list"})
    allowed_headers: list[str] = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: allowed request headers, a JSON list"})
    allow_credentials: bool = _flag(False, "CORS: allow credentials (cookies, auth headers)")
    enable_responses_store: bool = _flag(
        False, "keep /v1/responses responses in memory (those whose request does not say "
               "store: false) for previous_response_id and GET / DELETE "
               "/v1/responses/{id}; off, the Responses API is stateless")
    responses_store_max_bytes: int = _flag(
        256 << 20, "most bytes of memory stored responses take (about: their JSON size and "
                   "each item's object overhead); past it the least recently used are "
                   "dropped")
    max_background_responses: int = _flag(
        256, "most Responses API requests with background: true running at once (each "
             "holds an engine request without a connection); 503 past it")
    enable_server_load_tracking: bool = _flag(
        False, "count the generation and pooling requests in flight (until their answer "
               "or stream ends) for GET /load, {\"server_load\": N}, as vLLM's")
    enable_force_include_usage: bool = _flag(
        False, "every stream ends with a usage chunk, as if each request asked for it "
               "(stream_options.include_usage)")
    enable_request_id_headers: bool = _flag(
        False, "every response carries an X-Request-Id header: the request's own, else a "
               "new random id")
    disable_fastapi_docs: bool = _flag(
        False, "serve no /docs, /redoc or /openapi.json")
    enable_log_requests: bool = _flag(
        False, "log each request as it arrives: its id, parameters and adapter (INFO), its "
               "prompt (DEBUG)")
    enable_log_outputs: bool = _flag(
        False, "log what each request generated, with its finish reason, when it ends (INFO)")
    max_log_len: int | None = _flag(
        None, "most characters of a prompt, output or parameter value, and most token ids, "
              "in those log lines (default: all)")
    allowed_media_domains: list[str] | None = field(default=None, metadata={
        "nargs": "+", "help": "hosts whose http(s) image URLs the server may fetch (\"*\": "
        "any, the addresses behind the server included); default: none, data URLs only "
        "(vLLM fetches from any host unless given this)"})
    allowed_local_media_path: str | None = _flag(
        None, "a directory whose files file:// image URLs may read (symbolic links "
              "resolved first); default: none")
    shutdown_timeout: float = _flag(
        3.0, "seconds the requests in flight get to finish after SIGTERM or Ctrl-C "
             "(0: aborted at once, vLLM's default); the process exits at most 7 s later "
             "whatever still holds it")
    sse_keep_alive_interval: float = _flag(
        0.0, "seconds a chat or completions stream may send nothing before it sends an "
             "SSE comment line (': keep-alive'), for proxies that close idle "
             "connections; 0: none (vLLM's)")
    default_chat_template_kwargs: dict[str, Any] | None = _flag(
        None, "keyword arguments every chat template rendering gets, under a request's "
              "own chat_template_kwargs, as vLLM's: e.g. '{\"enable_thinking\": false}' "
              "turns Qwen3's thinking off unless a request asks for it")
    exclude_tools_when_tool_choice_none: bool = _flag(
        False, "leave the tools out of the prompt of a request whose tool_choice is "
               "\"none\" (by default the template still shows them, as OpenAI's)")
    enable_tokenizer_info_endpoint: bool = _flag(
        True, "GET /tokenizer_info (the tokenizer's settings and chat template) is "
              "always served here; vLLM's flag, which turns it on there, is taken")
    disable_access_log_for_endpoints: str | None = _flag(
        None, "paths whose requests leave no access log line, comma-separated, e.g. "
              "\"/health,/metrics,/load\" (with --enable-uvicorn-access-log)")
    allow_runtime_lora_updating: bool = _flag(
        False, "serve /v1/load_lora_adapter and /v1/unload_lora_adapter, which add and "
               "remove LoRA adapters while serving (vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING; needs --enable-lora)")

    tokens_only: bool = _flag(
        False, "serve only the Tokens In<>Out API (POST /inference/v1/generate, "
               "/abort_requests) beside health, metrics and models, and load no "
               "tokenizer (vLLM's, for a server behind a separate renderer)")
    skip_tokenizer_init: bool = _flag(
        False, "load no tokenizer: POST /inference/v1/generate serves token ids and "
               "the routes that read or write text answer 400")
    log_error_stack: bool = _flag(
        False, "log the traceback of every error response, 4xx included (5xx from a "
               "failure are always logged with theirs)")

    def __post_init__(self) -> None:
        for name in ("max_n", "max_stop", "max_prompt_bytes", "max_body_bytes",
                     "h11_max_incomplete_event_size", "h11_max_header_count",
                     "responses_store_max_bytes", "max_background_responses"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("render_timeout", "request_timeout", "keep_alive_timeout", "read_timeout",
                     "write_timeout"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.sse_keep_alive_interval)
                and self.sse_keep_alive_interval >= 0):
            raise ConfigError(f"sse_keep_alive_interval must be >= 0 seconds, "
                              f"got {self.sse_keep_alive_interval}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ConfigError(f"shutdown_timeout must be >= 0 seconds, "
                              f"got {self.shutdown_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"max_log_len must be >= 0, got {self.max_log_len}")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0, got "
                              f"{self.max_queued_requests}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"chat_template_content_format must be one of "
                              f"{', '.join(CONTENT_FORMATS)}, got "
                              f"{self.chat_template_content_format!r}")
        name = self.tool_call_parser
        if (name is not None and self.tool_parser_plugin is None
                and name not in TOOL_PARSER_NAMES and not any(c in name for c in ":.")):
            raise ConfigError(f"unknown tool call parser {name!r}; choose one of "
                              f"{', '.join(TOOL_PARSER_NAMES)}, name a ToolParser class "
                              f"(package.module:Class), or give --tool-parser-plugin")
        if self.tool_parser_plugin is not None and self.tool_call_parser is None:
            raise ConfigError("--tool-parser-plugin needs --tool-call-parser naming one of "
                              "its parsers")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
        self.media_policy()  # a local media path that is no directory: refused now
        if self.default_chat_template_kwargs is not None:
            if not isinstance(self.default_chat_template_kwargs, dict):
                raise ConfigError(f"default_chat_template_kwargs must be a JSON object, "
                                  f"got {self.default_chat_template_kwargs!r}")
            reserved = sorted(self.default_chat_template_kwargs.keys()
                              & RESERVED_TEMPLATE_KWARGS)
            if reserved:
                raise ConfigError(f"default_chat_template_kwargs may not set "
                                  f"{reserved[0]!r}")
        if (self.chat_template is not None and not is_template_text(self.chat_template)
                and not os.path.isfile(self.chat_template)):
            raise ConfigError(f"chat_template is neither a template nor a file: "
                              f"{self.chat_template!r}")

    def access_log_excluded_paths(self) -> frozenset[str]:
        """--disable-access-log-for-endpoints as a set of paths."""
        value = self.disable_access_log_for_endpoints or ""
        return frozenset(p.strip() for p in value.split(",") if p.strip())

    def media_policy(self) -> MediaPolicy:
        """Where image URLs may point (ConfigError for a path that is no directory)."""
        return MediaPolicy.from_flags(self.allowed_media_domains,
                                      self.allowed_local_media_path)

    def auto_tool_parser(self) -> type[ToolParser] | None:
        """The parser class of tool_choice "auto" (None: auto tool choice is off), for
        the server to resolve once at start-up; ConfigError when it cannot be found."""
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            return None
        try:
            return get_tool_parser(self.tool_call_parser, self.tool_parser_plugin)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def load_chat_template(self) -> str | None:
        """The --chat-template text (read from its file if it names one)."""
        if self.chat_template is None or is_template_text(self.chat_template):
            return self.chat_template
        with open(self.chat_template, encoding="utf-8") as f:
            return f.read()


def is_template_text(value: str) -> bool:
    """A --chat-template value is the template itself when it has Jinja syntax (vLLM
    accepts both forms), else a file path."""
    return any(mark in value for mark in ("{{", "{%", "\n"))
