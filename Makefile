# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= conf/dev.yaml

.PHONY: run test bench deps system-deps clean

$(STAMP): setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,spark]'
	touch $(STAMP)

deps: $(STAMP)

system-deps:
	scripts/ensure-system-deps.sh

run: deps
	@mkdir -p var
	@test -s var/http-secret || $(PY) -c "import secrets; print(secrets.token_urlsafe(32))" > var/http-secret
	$(VENV)/bin/replicator run -c $(CONFIG)

test: deps system-deps
	$(PY) scripts/run-tests.py $(TESTS)

bench: deps system-deps
	$(PY) scripts/bench/run.py

clean:
	rm -rf $(VENV) _trial_temp* build *.egg-info
