"""The engine: the one step loop (``llm_engine.LLMEngine``), what it needs from a runner
(``interface.Runner``), what it hands out (``outputs``), what listeners see (``events``) and the loop
for requests that arrive over time (``arrivals``).

It drives the core's scheduler and a runner (the tensor half of a step) and imports no torch: a
runner is passed in, so the same loop runs the model (``minicb.runtime.runner.engine_for``), the
tensor-parallel group (``minicb.distributed``) and the simulator (``minicb.simulate``).
"""
