# The two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both create .venv when missing and (re)install the project when pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mambac-installed

.PHONY: demo test clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "mambac needs Python 3.11 or newer; set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m mambac.demo

# Tests that run in one process (generated kernels under the Triton interpreter, ops, passes,
# conversion, the torch.compile backend) run on two pytest workers; the tests that launch ranks,
# which already keep both cores busy, run after them in one.
ONE_PROCESS_TESTS := tests/codegen tests/ops tests/passes tests/convert tests/models $(wildcard tests/test_backend*.py)

test: $(STAMP)
	$(PY) -m pytest -q -n 2 $(ONE_PROCESS_TESTS)
	$(PY) -m pytest -q $(addprefix --ignore=,$(ONE_PROCESS_TESTS))

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
