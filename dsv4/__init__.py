"""dsv4: inference and serving engine for DeepSeek-V4.1-Flash and DeepSeek-V4-Flash."""

from dsv4.engine.outputs import CompletionOutput, RequestOutput
from dsv4.engine.sampling_params import SamplingParams
from dsv4.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
