"""vLLM options that select what pagedllm always does: --config-format hf, --model-impl
vllm (its own implementations) and the deprecated --disable-cascade-attn are taken;
the choices it does not have are refused by name. --scheduler-cls runs a user's
Scheduler subclass."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser, engine_args_from
from pagedllm.errors import ConfigError
from tests.utils import save_tiny_model, tiny_llama_config


def test_taken_and_refused(tmp_path):
    path = str(save_tiny_model(tmp_path, tiny_llama_config()))
    args = engine_args_from(build_parser().parse_args(
        ["serve", path, "--config-format", "hf", "--model-impl", "vllm",
         "--disable-cascade-attn"]))
    assert (args.config_format, args.model_impl, args.disable_cascade_attn) == (
        "hf", "vllm", True)
    assert args.create_engine_config().model.path == path
    for kw, match in [({"model_impl": "transformers"}, "model_impl must be one of"),
                      ({"config_format": "mistral"}, "config_format must be one of")]:
        with pytest.raises(ConfigError, match=match):
            EngineArgs(model=path, **kw).create_engine_config()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", path, "--model-impl", "terratorch"])


class CountingScheduler(Scheduler):
    """A user's scheduler (--scheduler-cls): pagedllm's, counting its steps."""

    def schedule(self):
        self.num_schedules = getattr(self, "num_schedules", 0) + 1
        return super().schedule()


def test_scheduler_cls(tmp_path):
    path = str(save_tiny_model(tmp_path, tiny_llama_config(vocab_size=256)))
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6]}]
    params = SamplingParams(temperature=0, max_tokens=5)
    plain = LLM(path, dtype="float32", skip_tokenizer_init=True,
                scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler")
    assert type(plain.llm_engine.engine_core.scheduler) is Scheduler
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True,
              scheduler_cls=f"{__name__}:CountingScheduler")
    scheduler = llm.llm_engine.engine_core.scheduler
    assert isinstance(scheduler, CountingScheduler)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                         use_tqdm=False)] == want
    assert scheduler.num_schedules >= 5
    llm.shutdown()
    for name, match in [("json:JSONDecoder", "not a subclass"),
                        ("no_such_module:X", "cannot import"), ("Scheduler", "qualified")]:
        with pytest.raises(ConfigError, match=match):
            EngineArgs(model=path, scheduler_cls=name).create_engine_config()
