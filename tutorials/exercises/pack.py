"""Exercise 9 (the build-it track): the ragged packer.

A step's plan (``minicb.core.plan.StepPlan``) lists the rows the scheduler
chose; the model runs them as ONE flat batch, every row's new tokens end to
end, with no padding between them. You write ``pack``: the plan in, the flat
batch's values out, as plain Python lists. The checker compares them with
minicb's packer and then runs a tiny model on YOUR lists inside a real
engine: its tokens must equal a padded batch's.

A plan has ``block_size`` and ``seqs``: per row (``ScheduledSeq``) its
``request_id``, ``token_ids`` (the tokens computed this step: a prompt, a
chunk of one, or one decode token), ``start_pos`` (the tokens of that
request already in the KV cache: the position of ``token_ids[0]``),
``block_table`` (its KV blocks, in order, covering every position up to the
end of this step), ``sample`` (this row reaches the request's last token: a
next token is sampled from its logits) and ``forks`` (children that sample
from the same row too). ``padding`` lists the lengths of padding rows (the
padded policies' wasted rows), packed after the real ones.

Return a dict of lists:

* ``input_ids``, ``positions``, ``slot_mapping``: one entry per packed token.
  ``positions`` are each token's position in its OWN request (what RoPE
  rotates by); ``slot_mapping`` is where its K/V is written in the paged
  cache, a flat slot number (block number * block_size + offset); -1 writes
  nothing;
* ``cu_seqlens_q``: where each row's tokens start in the flat batch, and the
  end (B + 1 entries, from 0);
* ``context_lens``: per row, the keys its queries attend over once this
  step's K/V is written; ``cu_seqlens_k``: their running sums, like
  ``cu_seqlens_q``;
* ``block_tables``: one list per row, padded with 0 to the longest;
* ``logits_indices``: the flat rows the model computes logits for (a row's
  next token comes from the logits of its last token), and
  ``sample_request_ids``: whose each is (a fork's children each once more);
* padding rows: token 0 at positions 0, 1, ..., no cache (write nothing,
  attend to themselves only), no block table, never sampled.

Prompt logprobs (``prompt_targets``) are left out of the exercise.

    cp tutorials/exercises/pack.py my_pack.py
    python -m pytest tutorials/exercises/check_pack.py --solution my_pack.py

minicb's answer: ``minicb.runtime.packer.pack`` (chapter 02, the packer's
concepts page).
"""


def pack(plan) -> dict[str, list]:
    """The flat batch of ``plan`` as plain lists (the module docstring)."""
    raise NotImplementedError("exercise 9: pack")
