"""The CPU fast paths: everything minicb does to run the reference model faster on a CPU, fenced off.

``minicb.model`` is the reference a learner reads (the LLaMA forward on flat tokens, the paged KV
tensors, the PyTorch attention). It imports nothing from here. This package changes a loaded model
in place and hands its runner faster pieces; with it off (``LLM(fast_paths=False)``,
``minicb generate --reference``) the reference code is exactly what runs, and the tests hold the
two to the same greedy tokens in float64::

    install.py      cpu_fast_paths(model, device): the one function that installs them on a model;
                    runner_kwargs(): the runner's attention backends and greedy argmax
    settings.py     every MINICB_* switch, read from the environment in one place
    backends.py     the reference backends plus cpu-paged (auto's choice on the CPU)
    cpu_paged.py    the paged decode attention kernel (csrc/paged_decode.c)
    cpu_fused.py    RMSNorm (+ residual), rotary embedding, SiLU * up, argmax as C loops (csrc/fused_ops.c)
    cpu_linear.py   every linear layer packed once for oneDNN (or MKL), chosen at load
    skinny_gemm.py  products of few rows reading each weight once (csrc/skinny_gemm.c)
    int8_gemm.py    opt-in: products on int8-rounded activations x a GGUF's Q4_1 blocks (csrc/int8_gemm.c)
    layer_stack.py  a step of decode rows through every layer in one C call (csrc/layer_stack.c)
    host_memory.py  the skinny kernel's weight copies on 2 MiB pages
    ckernels.py     compiling the C sources with the machine's compiler on first use, cached

The C sources are in ``csrc/``. Entry points import ``minicb.fastpaths.install``. The switches are
listed in ``docs/fast_paths_switches.md``.
"""
