"""Configuration values: the model's shape and the scheduler's limits. Torch-free, frozen, validated.

``SchedulerConfig`` uses vLLM's names:

* ``max_num_seqs``: slots, i.e. the most sequences in one step's batch;
* ``max_num_batched_tokens``: the token budget of one step (continuous policy);
* ``long_prefill_chunk``: the most prompt tokens one sequence may take of that budget in a step
  (``None``: the whole budget);
* ``max_prefill_tokens_while_decoding``, ``prefill_tokens_per_seq``: stall-free batching (continuous
  policy, ``planner``): in a step that runs decodes, the prompt tokens of all sequences together stay
  within ``max_prefill_tokens_while_decoding + N * prefill_tokens_per_seq``, ``N`` the sequences the
  scheduler holds (running, swapped, waiting; at most ``max_num_seqs``), so that the step, and
  the running streams' next tokens, are not held up by a long prompt; a step without decodes still gives
  prompts the whole budget (``None`` or ``0``: no cap, ``LLM()``'s default; ``minicb serve``'s is measured);
* ``block_size`` / ``num_blocks``: the paged KV pool, ``num_blocks * block_size`` token slots;
* ``num_host_blocks``: the host (CPU) pool that swap preemption copies blocks into;
* ``policy``: ``continuous`` (iteration-level), ``dynamic`` (naive dynamic batching: batch whatever
  waits, run it to completion) or ``static`` (wait for ``max_num_seqs`` requests, run to completion);
* ``preemption_mode``: ``recompute`` or ``swap`` (which falls back to recompute when the host pool is full).
* ``max_n``: the most children one request may fork into (``SamplingParams.n``, parallel sampling):
  each child is a sequence with its own slot and blocks, so ``n`` is bounded like the other limits.
* ``max_logprob_entries``: the most logprob entries one request may ask for, counted before any work
  as rows x (top-k + 1): ``(prompt tokens - 1) x (prompt_logprobs + 1)`` plus ``n x max_tokens x
  (logprobs + 1)``. Each entry is a few dozen bytes of response (``engine.inputs.LOGPROB_ENTRY_BYTES``)
  and some work, so this bounds what one request may cost; past it ``add_request`` refuses the request
  (``InvalidArgument``: a 400 through the server, ``--max-logprob-entries``).
* ``enable_prefix_caching``: share the KV blocks of common prompt prefixes between requests (on by
  default; ``continuous`` only, see ``block_manager``).
* ``scheduling_policy``: ``fcfs`` (arrival order; ``priority`` is ignored) or ``priority``: as in
  vLLM, a *lower* ``priority`` value is more important; it picks the next waiting request to admit,
  the running order and the preemption victim (the least important). ``priority_aging``: a request
  gains one level for every that many requests that arrive after it, so a steady stream of important
  requests cannot starve a less important one (0: strict priority). ``continuous`` only; the padded
  baselines stay FIFO.
"""

from __future__ import annotations

from dataclasses import dataclass

from minicb.core.errors import InvalidArgument, as_int, check_float, check_int

POLICIES = ("continuous", "dynamic", "static")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The shape of a LLaMA-architecture model (names follow Hugging Face's ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            check_int(name, getattr(self, name), lo=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument("num_attention_heads must be a multiple of num_key_value_heads, got "
                                  f"{self.num_attention_heads} and {self.num_key_value_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise InvalidArgument("hidden_size must be divisible by num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_int("head_dim", self.head_dim, lo=2)
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even for RoPE, got {self.head_dim}")
        # Bounded where a value stops meaning anything: theta <= 1 gives every dimension the same
        # rotation; an epsilon of 1 or more swamps the mean square it guards.
        check_float("rope_theta", self.rope_theta, lo=1.0, hi=1e12, lo_open=True, finite=True)
        check_float("rms_norm_eps", self.rms_norm_eps, lo=0.0, hi=1.0, finite=True)
        for name in ("bos_token_id", "eos_token_id"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=0)

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs for one token: 2 x (matmul parameters) plus attention over ``context_len`` keys."""
        h, d = self.hidden_size, self.head_dim
        matmul_params = self.num_params - self.vocab_size * h * (1 if self.tie_word_embeddings else 2) \
            + self.vocab_size * h
        attn = 4 * self.num_hidden_layers * self.num_attention_heads * d * context_len
        return 2.0 * matmul_params + attn


# The one tiny random model of the CLIs and tutorials (``minicb bench/trace --model tiny``): 2 layers,
# 4 query / 2 KV heads, vocabulary 256 (EOS = 3). Instant on a CPU; random weights, so its text is noise.
TINY_MODEL = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=4096, eos_token_id=3)


_INT_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk", "block_size", "num_blocks",
               "num_host_blocks", "max_model_len", "priority_aging", "max_n", "max_logprob_entries",
               "max_prefill_tokens_while_decoding", "prefill_tokens_per_seq")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """The scheduler's limits and policies (module docstring); validated, frozen."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    long_prefill_chunk: int | None = None
    max_prefill_tokens_while_decoding: int | None = None   # stall-free cap (None or 0: none) ...
    prefill_tokens_per_seq: int = 0                         # ... raised by this much per sequence held
    block_size: int = 16
    num_blocks: int = 1024
    num_host_blocks: int = 0
    max_model_len: int = 2048
    policy: str = "continuous"
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"            # "fcfs", or "priority" (lower Sequence.priority first)
    priority_aging: int = 32                   # priority: +1 level per this many later arrivals (0: strict)
    enable_prefix_caching: bool = True         # reuse cached prefix blocks (continuous only, as vLLM)
    max_n: int = 16                            # the most children of one request (SamplingParams.n)
    max_logprob_entries: int = 500_000         # rows x (top-k + 1) one request may ask for (~40 MB of JSON)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:       # numpy / torch integers are stored as plain ints (frozen: set once)
            value = as_int(getattr(self, name))
            if value is not None:
                object.__setattr__(self, name, value)
        check_int("max_num_seqs", self.max_num_seqs, lo=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, lo=1)
        check_int("block_size", self.block_size, lo=1)
        check_int("num_blocks", self.num_blocks, lo=1)
        check_int("num_host_blocks", self.num_host_blocks, lo=0)
        check_int("max_model_len", self.max_model_len, lo=1)
        check_int("priority_aging", self.priority_aging, lo=0)
        check_int("max_n", self.max_n, lo=1)
        check_int("max_logprob_entries", self.max_logprob_entries, lo=0)
        check_int("prefill_tokens_per_seq", self.prefill_tokens_per_seq, lo=0)
        if self.long_prefill_chunk is not None:
            check_int("long_prefill_chunk", self.long_prefill_chunk, lo=1, hi=self.max_num_batched_tokens)
        if self.max_prefill_tokens_while_decoding is not None:     # 0 is "no cap" too: stored as None
            check_int("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, lo=0)
            if self.max_prefill_tokens_while_decoding == 0:
                object.__setattr__(self, "max_prefill_tokens_while_decoding", None)
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise InvalidArgument(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.preemption_mode, str) or self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidArgument(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not isinstance(self.scheduling_policy, str) or self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidArgument(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidArgument(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.num_blocks < self.max_num_seqs:
            raise InvalidArgument(f"num_blocks must be at least max_num_seqs (one block per slot), got "
                                  f"num_blocks={self.num_blocks} < max_num_seqs={self.max_num_seqs}")

    @property
    def chunk_cap(self) -> int:
        return self.long_prefill_chunk or self.max_num_batched_tokens

    @property
    def prefix_caching(self) -> bool:
        """Is prefix caching in effect? Only for ``continuous``: the padded policies reserve whole
        private tables up front and stay the plain baseline."""
        return bool(self.enable_prefix_caching) and self.policy == "continuous"
