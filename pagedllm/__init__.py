"""pagedllm: a fast LLM inference and serving engine (paged KV cache, continuous batching).

    from pagedllm import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from pagedllm.config import EngineArgs
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob",
           "EngineArgs", "__version__"]


def __getattr__(name: str):
    # torch and transformers load only when the engine is asked for
    if name == "LLM":
        from pagedllm.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
