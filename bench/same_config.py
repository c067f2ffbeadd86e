"""W2 through minicb continuous with one fixed, explicit configuration, on whatever commit is checked out.

For comparing commits (did a refactor cost speed?): the configuration does not follow ``LLM()``'s
defaults, so two commits run the very same schedule (the script prints the step count: equal counts
mean equal schedules). Run it in two checkouts, alternating, on a quiet machine::

    git worktree add /tmp/old <commit>
    (cd /tmp/old && PYTHONPATH=src python $PWD/bench/same_config.py old)
    PYTHONPATH=src python bench/same_config.py new

SmolLM2-135M in float32, one torch thread, ``max_num_seqs=16``, a 512-token step, 1,024 blocks of 16,
the cpu-paged decode kernel and every other CPU fast path ``LLM()`` installs on a model it loads
(``cpu_fast_paths``; ``--reference``: none, the reference model as it reads); W2 from
``bench/workloads.py`` (64 requests, EOS ignored).
"""

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from workloads import w2  # noqa: E402

try:                                    # the layout since the core moved into subpackages
    from minicb.core.sampling_params import SamplingParams  # noqa: E402
    from minicb.entrypoints.llm import LLM  # noqa: E402
    from minicb.model.weights.loader import load_model  # noqa: E402
except ImportError:                     # commits before it: flat modules
    from minicb.llm import LLM  # noqa: E402
    from minicb.model.loader import load_model  # noqa: E402
    from minicb.sampling_params import SamplingParams  # noqa: E402
from minicb.model.llama import LlamaForCausalLM  # noqa: E402


def install_fast_paths(model) -> dict:
    """Put ``model`` on the fast paths as ``LLM()`` does for a model it loads; what ``LLM`` is given."""
    try:                                # since the fast paths were fenced off (minicb/fastpaths)
        from minicb.fastpaths.install import cpu_fast_paths
    except ImportError:                 # before: in minicb/model
        from minicb.model.fast_paths import cpu_fast_paths
    cpu_fast_paths(model, "cpu")
    return {"attn_backend": "cpu-paged"}


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--reference"]
    label = args[0] if args else "this commit"
    torch.set_num_threads(1)
    loaded = load_model(None, dtype=torch.float32)
    model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, torch.float32, "cpu")
    wl = w2()
    kw = {"fast_paths": False} if "--reference" in sys.argv else install_fast_paths(model)
    llm = LLM(model, max_num_seqs=16, max_num_batched_tokens=512, num_blocks=1024, block_size=16, **kw)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    steps = getattr(llm.engine, "stats", None)
    steps = steps.num_steps if steps is not None else "?"      # commits before engine.stats: not shown
    print(f"{label}: {n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s; {steps} steps", flush=True)


if __name__ == "__main__":
    main()
