"""The torch-free core: what continuous batching decides, step by step, with no tensor in sight.

``sequence`` (a request's states), ``slot_table`` (batch rows), ``block_manager`` (paged KV blocks and
the prefix cache), ``planner`` (chunked prefill under a token budget), ``preemption`` (victims),
``plan`` (``StepPlan``: one step's decision) and ``scheduler`` (the policies that make plans), plus the
plain values everything shares: ``config``, ``errors``, ``sampling_params``, ``memory``, ``kv_budget``.
Nothing here imports torch, the engine, or anything else of minicb outside this package
(``tests/test_architecture.py``).
"""
