"""The engine: the step loop that turns a scheduler's plans into tokens, and the public API.

One step, every iteration (the heart of continuous batching)::

    plan   = scheduler.schedule()        # who runs, which tokens, which blocks (no torch)
    kv.swap_out(plan.swap_out); kv.swap_in(plan.swap_in)
    batch  = pack(plan)                  # flat ids, positions, cu_seqlens, slot_mapping, block_tables
    logits = model(batch)                # one forward over every scheduled token, no padding
    tokens = sampler.sample(logits)      # one token per sequence that reached its end
    done   = scheduler.update(plan, tokens)   # finished requests free their slot and blocks *now*

Two ways in, both vLLM-shaped:

* ``LLM.generate(prompts, sampling_params)``: validates everything first, runs to completion and
  returns ``RequestOutput``s in input order;
* ``LLMEngine.add_request`` / ``step`` / ``abort_request``: streaming; each ``step`` returns the outputs
  that changed (new tokens, or finished).

If the model raises inside a step, the requests of that step end with ``finish_reason == "error"``
(their blocks and slots are freed by the scheduler) and the engine keeps serving the others. A
``KeyboardInterrupt`` inside a step does the same to that step's requests (their outputs come out of
the next ``step()``) and is then re-raised, so an interrupted engine is still consistent.

The error contract (which argument, which range, which exception) is the table in ``docs/errors.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import operator
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from minicb.config import SchedulerConfig
from minicb.errors import InvalidArgument, check_int
from minicb.kv_cache import KVCache
from minicb.model.backends import check_device, make_backend  # attention-backend registry
from minicb.model.llama import DTYPES, LlamaForCausalLM
from minicb.packer import pack
from minicb.plan import StepPlan
from minicb.sampling import Sampler
from minicb.sampling_params import SamplingParams
from minicb.scheduler import Scheduler
from minicb.sequence import Sequence


@dataclass(slots=True)
class RequestOutput:
    """What a request has produced so far (complete once ``finished``)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int] = field(default_factory=list)   # tokens added by the latest step
    new_text: str = ""
    error: str | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Live:
    seq: Sequence
    decoder: object | None
    text: str = ""
    emitted: int = 0


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and the sampler; ``step()`` runs one iteration."""

    def __init__(self, model: LlamaForCausalLM, config: SchedulerConfig, tokenizer=None,
                 seed: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 attn_backend: str = "auto") -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.clock = clock
        if seed is not None:
            check_int("seed", seed, lo=0, hi=2**63 - 1)
        cfg = model.config
        self.kv_cache = KVCache(cfg.num_hidden_layers, config.num_blocks, config.block_size,
                                cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device,
                                config.num_host_blocks)
        self.backend = make_backend(attn_backend, self.kv_cache, model.device)
        self.scheduler = Scheduler(config)
        self.sampler = Sampler(seed)
        self.eos_token_id = cfg.eos_token_id if tokenizer is None else tokenizer.eos_token_id
        self.pad_token_id = 0
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.last_plan: StepPlan | None = None
        self.on_plan: Callable[[StepPlan], None] | None = None   # hook for traces and tensor parallelism
        self._pending: list[RequestOutput] = []   # outputs of a step interrupted by KeyboardInterrupt

    # --- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        """Validate a prompt (text or token ids) and return its token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgument("prompt is text but the engine has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            if ids and max(ids) >= self.model.config.vocab_size:
                raise InvalidArgument(f"prompt text encodes to token id {max(ids)}, outside the model's "
                                      f"vocabulary [0, {self.model.config.vocab_size - 1}]: the tokenizer "
                                      "does not match the model")
        elif isinstance(prompt, (list, tuple)):
            ids = [_token_id(t, i, self.model.config.vocab_size) for i, t in enumerate(prompt)]
        else:
            raise InvalidArgument(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidArgument("prompt must not be empty: it needs at least 1 token (it has 0)")
        return ids

    def make_sequence(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                      arrival_time: float | None = None, priority: int = 0) -> Sequence:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        rid = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidArgument(f"request_id must be a non-empty str, got {rid!r}")
        check_int("priority", priority)
        now = self.clock() if arrival_time is None else arrival_time
        return Sequence(rid, self.tokenize(prompt), params, arrival_time=now, priority=priority,
                        eos_token_id=self.eos_token_id)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Queue one request; a bad one raises here and leaves the engine and other requests untouched."""
        seq = self.make_sequence(prompt, params, request_id, arrival_time, priority)
        if seq.request_id in self._live:
            raise InvalidArgument(f"request_id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        self.sampler.register(seq.request_id, seq.params)
        dec = self.tokenizer.incremental_decoder() if self.tokenizer is not None else None
        self._live[seq.request_id] = _Live(seq, dec)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id, self.clock())
        live = self._live.pop(request_id, None)
        self.sampler.release(request_id)
        return self._output(live) if (seq is not None and live is not None) else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the outputs of the requests that got a token or finished."""
        outs, self._pending = self._pending, []
        plan = self.scheduler.schedule(self.clock())
        self.last_plan = plan
        if self.on_plan is not None:
            self.on_plan(plan)
        if plan.is_empty:
            return outs
        try:
            sampled = self.execute(plan)
        except Exception as exc:   # noqa: BLE001 - a failed step must not take the engine down
            return outs + self._fail_step(plan, exc)
        except BaseException as exc:   # Ctrl-C: end this step's requests so the engine stays consistent
            self._pending = outs + self._fail_step(plan, exc)
            raise
        now = self.clock()
        finished = {s.request_id for s in self.scheduler.update(plan, sampled, now)}
        for rid in sampled:
            live = self._live.get(rid)
            if live is not None:
                outs.append(self._finish(rid) if rid in finished else self._output(live))
        for rid in finished - sampled.keys():
            if rid in self._live:
                outs.append(self._finish(rid))
        return outs

    def _fail_step(self, plan: StepPlan, exc: BaseException) -> list[RequestOutput]:
        """The step's requests end with ``finish_reason == "error"``; their slots and blocks are freed."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        failed = self.scheduler.fail_step(plan, error, self.clock())
        return [self._finish(s.request_id) for s in failed if s.request_id in self._live]

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Swap, pack, forward, sample: the part of a step that touches tensors."""
        self.kv_cache.swap_out(plan.swap_out)
        self.kv_cache.swap_in(plan.swap_in)
        batch = pack(plan, self.model.device, self.pad_token_id)
        if not batch.sample_request_ids and batch.num_tokens == 0:
            return {}
        logits = self.model(batch.input_ids, batch.positions, self.backend, batch.attn,
                            batch.logits_indices)
        params = [self._live[r].seq.params for r in batch.sample_request_ids]
        tokens = self.sampler.sample(logits, batch.sample_request_ids, params)
        return dict(zip(batch.sample_request_ids, tokens))

    def run_until_done(self, progress=None) -> list[RequestOutput]:
        done = []
        while self.scheduler.has_unfinished():
            for out in self.step():
                if out.finished:
                    done.append(out)
                    if progress is not None:
                        progress(out)
        return done

    # --- outputs --------------------------------------------------------------------------------
    def _finish(self, rid: str) -> RequestOutput:
        live = self._live.pop(rid)
        self.sampler.release(rid)
        return self._output(live)

    def _output(self, live: _Live) -> RequestOutput:
        s = live.seq
        new = s.output_token_ids[live.emitted:]
        live.emitted = s.num_output_tokens
        new_text = ""
        if live.decoder is not None:
            new_text = "".join(live.decoder.push(t) for t in new)
            live.text += new_text
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_token_ids,
            token_ids=list(s.output_token_ids), text=live.text, finished=s.is_finished,
            finish_reason=s.finish_reason.value if s.finish_reason else None, new_token_ids=list(new),
            new_text=new_text, error=s.error, arrival_time=s.arrival_time,
            first_scheduled_time=s.first_scheduled_time, first_token_time=s.first_token_time,
            token_times=list(s.token_times), finish_time=s.finish_time,
            num_preemptions=s.num_preemptions, num_cached_tokens=s.num_cached_tokens,
        )


class LLM:
    """``LLM(model=None, dtype="float32", **config)``: the offline, batch API (vLLM's ``LLM``).

    ``model`` is a path (GGUF file or Hugging Face directory), ``None`` for the default SmolLM2, or an
    already built ``LlamaForCausalLM`` (tests pass tiny random ones). Other keyword arguments are
    ``SchedulerConfig`` fields (``max_num_seqs``, ``block_size``, ``num_blocks``, ``policy``, ...).

    ``tensor_parallel_size=N > 1`` splits the model over N processes (``minicb.distributed``: this
    process is rank 0, the others are started here, or it joins a ``torchrun`` job); call
    ``shutdown()`` (or use ``with LLM(...) as llm:``) to stop them.
    """

    def __init__(self, model=None, *, tokenizer=None, dtype: str | torch.dtype = "float32",
                 device: str = "cpu", seed: int | None = None, attn_backend: str = "auto",
                 clock: Callable[[], float] = time.perf_counter, tensor_parallel_size: int = 1,
                 **config) -> None:
        torch_dtype = _dtype(dtype)
        device = check_device(device)
        check_int("tensor_parallel_size", tensor_parallel_size, lo=1)
        _check_config_names(config)
        SchedulerConfig(**{"max_model_len": 1, **config})   # bad limits fail before the model loads
        if not isinstance(model, LlamaForCausalLM):
            from minicb.model.loader import load_model

            loaded = load_model(model, dtype=torch_dtype)
            tokenizer = tokenizer or loaded.tokenizer
            # with tensor parallelism the whole model stays on the CPU: each rank moves its shard
            home = device if tensor_parallel_size == 1 else "cpu"
            model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch_dtype, home)
        sched = SchedulerConfig(**_default_config(model, config))
        if tensor_parallel_size > 1:
            from minicb.distributed import launch

            self.engine = launch(model, sched, tensor_parallel_size, tokenizer=tokenizer, seed=seed,
                                 clock=clock, attn_backend=attn_backend, device=device)
        else:
            self.engine = LLMEngine(model, sched, tokenizer, seed=seed, clock=clock,
                                    attn_backend=attn_backend)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if any (idempotent)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; everything is validated before any work starts."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                                               and _is_int(prompts[0]))
        plist = [prompts] if single else list(prompts) if isinstance(prompts, (list, tuple)) else None
        if not plist:
            raise InvalidArgument("prompts must be a non-empty str, list of str, or list of token-id lists")
        params = _params_list(sampling_params, len(plist))
        eng = self.engine
        base = next(eng._ids)
        seqs = [eng.make_sequence(p, sp, f"gen{base}-{i}") for i, (p, sp) in enumerate(zip(plist, params))]
        for s in seqs:
            eng.scheduler.validate(s)
        eng.scheduler.close_arrivals()
        try:
            for s in seqs:
                eng.add_request(s.request_id, s.prompt_token_ids, s.params, s.arrival_time)
            tick = _progress(len(seqs)) if progress else None
            results = {o.request_id: o for o in eng.run_until_done(tick)}
        finally:
            eng.scheduler.open_arrivals()
        return [results[s.request_id] for s in seqs]


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _token_id(t, i: int, vocab: int) -> int:
    """A prompt token id as a plain int (numpy / torch integers welcome), checked against the vocabulary."""
    try:
        v = None if isinstance(t, bool) else operator.index(t)
    except TypeError:
        v = None
    if v is None or not 0 <= v < vocab:
        raise InvalidArgument(f"prompt token ids must be integers in [0, {vocab - 1}] (the vocabulary), "
                              f"got {t!r} at index {i}")
    return v


def _check_config_names(config: dict) -> None:
    known = {f.name for f in dataclasses.fields(SchedulerConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise InvalidArgument(f"unknown LLM argument(s) {', '.join(unknown)}; accepted: model, tokenizer, "
                              f"dtype, device, seed, attn_backend, clock, tensor_parallel_size and the "
                              f"SchedulerConfig fields "
                              f"{', '.join(sorted(known))}")


def _default_config(model: LlamaForCausalLM, config: dict) -> dict:
    config = dict(config)
    config.setdefault("max_model_len", min(model.config.max_position_embeddings, 8192))
    return config


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
