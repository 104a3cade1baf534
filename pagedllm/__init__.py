"""pagedllm: an LLM inference and serving engine on a paged KV cache."""

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm import LLM
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InvalidRequestError, ModelLoadError
from pagedllm.inputs import EmbedsPrompt, TextPrompt, TokensPrompt
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import (BeamSearchOutput, BeamSearchSequence, ClassificationOutput,
                              ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, Logprob, PoolingOutput,
                              PoolingRequestOutput, RequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import (BeamSearchParams, GuidedDecodingParams,
                                      RequestOutputKind, SamplingParams,
                                      StructuredOutputsParams)

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "InvalidRequestError", "ModelLoadError",
           "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams",
           "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence", "PoolingParams",
           "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "PoolingOutput", "PoolingRequestOutput",
           "LoRARequest", "TextPrompt", "TokensPrompt", "EmbedsPrompt", "__version__"]
