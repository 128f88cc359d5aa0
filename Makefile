# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= conf/dev.yaml

.PHONY: run test test-fast dist bench chaos fuzz interop synapse-deps deps test-deps system-deps node-deps clean

# The daemon alone (make run) ...
$(VENV)/.installed-run: setup.cfg setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

# ... and with what the tests and the exporter need (make test, make bench).
$(VENV)/.installed-test: $(VENV)/.installed-run
	$(PY) -m pip install --quiet -e '.[test,spark]'
	touch $@

deps: $(VENV)/.installed-run

test-deps: $(VENV)/.installed-test system-deps node-deps

# The read API's Node.js clients: npm packages pinned, in a project-local
# directory (.node/node_modules; tests put it on NODE_PATH).
NODE_DIR := .node
EVENTSOURCE_VERSION := 4.1.1
$(NODE_DIR)/.installed-eventsource-$(EVENTSOURCE_VERSION): | system-deps
	npm install --silent --no-audit --no-fund --save-exact --prefix $(NODE_DIR) eventsource@$(EVENTSOURCE_VERSION)
	touch $@

# Durable Streams (docs/read-api.md): the official TypeScript client and
# the server conformance suite (it brings vitest, which runs it).
DS_CLIENT_VERSION := 0.2.7
DS_CONFORMANCE_VERSION := 0.3.6
DS_STAMP := $(NODE_DIR)/.installed-durable-streams-$(DS_CLIENT_VERSION)-$(DS_CONFORMANCE_VERSION)
$(DS_STAMP): $(NODE_DIR)/.installed-eventsource-$(EVENTSOURCE_VERSION)
	npm install --silent --no-audit --no-fund --save-exact --prefix $(NODE_DIR) \
		@durable-streams/client@$(DS_CLIENT_VERSION) \
		@durable-streams/server-conformance-tests@$(DS_CONFORMANCE_VERSION)
	touch $@

node-deps: $(NODE_DIR)/.installed-eventsource-$(EVENTSOURCE_VERSION) $(DS_STAMP)

system-deps:
	scripts/ensure-system-deps.sh

run: deps var/http-secret
	$(VENV)/bin/replicator run -c $(CONFIG)

# The write API's secret: made once, readable by its owner only (0600; an
# older world-readable one is made private).
.PHONY: var/http-secret
var/http-secret:
	@mkdir -p var
	@test -s $@ || (umask 077 && $(PY) -c "import secrets; print(secrets.token_urlsafe(32))" > $@)
	@chmod 600 $@

test: test-deps
	$(PY) scripts/run-tests.py $(TESTS)

# The in-memory tests alone (tests/fast.txt): no server, no socket, no wait.
test-fast: $(VENV)/.installed-test
	$(PY) scripts/run-tests.py --fast

# A wheel and an sdist in dist/, built from setup.cfg (the sdist first,
# the wheel from it, so a file missing from the sdist fails here).  Install
# with scripts/install-venv.sh: docs/operations.md, "Install".
$(VENV)/.installed-build:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip build
	touch $@

dist: $(VENV)/.installed-build
	rm -rf dist
	$(PY) -m build --outdir dist .

# Synapse's own server protocol is a baseline of the TCP figures: it runs
# from the interop virtualenv, in a process of its own (AGPL: only run).
bench: test-deps synapse-deps
	SYNAPSE_PYTHON=$(SYNAPSE_VENV)/bin/python $(PY) scripts/bench/run.py $(BENCH)

# The fault suite (tests/chaos): every scenario x transport, 3 fresh seeds each.
# Narrow or replay with SCENARIO=crash,net TRANSPORT=tcp SEED=n SEEDS=n DURATION=s PLANT=drop-rdata
# (or skip-fact, forge-position, late-sql: faults the delivery audit must catch).
chaos: test-deps
	$(PY) -m tests.chaos $(if $(SCENARIO),--scenario $(SCENARIO)) \
	  $(if $(TRANSPORT),--transport $(TRANSPORT)) $(if $(SEED),--seed $(SEED)) \
	  $(if $(SEEDS),--seeds $(SEEDS)) $(if $(DURATION),--duration $(DURATION)) \
	  $(if $(PLANT),--plant $(PLANT))

# The adversarial suite at full size (FUZZ="--phases 1,5 --scale 0.1 --seed 3" for less).
fuzz: test-deps
	$(PY) -m tests.fuzz $(FUZZ)

# The live interop suite beside a real Synapse (tests/interop): Synapse runs
# from its own virtualenv, as a peer process (AGPL: none of its code is ours).
SYNAPSE_VENV := .venv-synapse
SYNAPSE_VERSION := 1.163.2
$(SYNAPSE_VENV)/.installed-$(SYNAPSE_VERSION):
	test -x $(SYNAPSE_VENV)/bin/python || $(PYTHON) -m venv $(SYNAPSE_VENV)
	$(SYNAPSE_VENV)/bin/python -m pip install --quiet 'matrix-synapse[redis,postgres]==$(SYNAPSE_VERSION)'
	touch $@

synapse-deps: $(SYNAPSE_VENV)/.installed-$(SYNAPSE_VERSION)

interop: test-deps synapse-deps
	SYNAPSE_PYTHON=$(SYNAPSE_VENV)/bin/python $(PY) -m tests.interop

clean:
	rm -rf $(VENV) $(SYNAPSE_VENV) $(NODE_DIR) _trial_temp* build dist *.egg-info
