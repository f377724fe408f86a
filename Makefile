# Ephemeral: two commands on a fresh machine, `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
EPH := $(VENV)/bin/ephemeral
APT_PACKAGES := bubblewrap runsc qemu-system-x86 mmdebstrap e2fsprogs busybox-static cpio \
                gcc libc6-dev util-linux libseccomp2 \
                chromium postgresql
PYTEST_ARGS ?=

.PHONY: setup apt venv image prefect-template demo test test-fast bench lint fmt serve serve-prefect cluster clean

setup: apt venv image prefect-template

# Debian packages: sandboxes (bubblewrap, gVisor's runsc, QEMU), the image builder, Chromium for
# the page tests and PostgreSQL for the ledger tests. Installed only when one is missing.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The sandbox image is cached by the hash of its definition: a second build takes seconds.
image: venv
	$(EPH) images build
	$(EPH) images build python-dev

prefect-template: venv
	$(PY) -c "from ephemeral.prefect_setup import ensure_template; from ephemeral.settings import Settings; print(ensure_template(Settings.load()))"

# The product page's sample, offline (replayed model turns, real sandbox, real Prefect flow).
demo: setup
	$(EPH) run recipes/sandbox-proof.yaml

# The whole suite. CI (.ci/run) also sets EPHEMERAL_TEST_REQUIRE_DRIVERS, so a missing
# gvisor or namespaces driver fails the run instead of skipping its tests.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The inner loop: everything but the markers that cost minutes (TCG microVMs and other `slow`
# tests, the Prefect server, PostgreSQL, Chromium). Real sandboxes still run.
FAST_MARKERS := not slow and not prefect and not postgres and not browser
test-fast: setup
	$(PY) -m pytest -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/sandbox.py
	$(PY) bench/run.py
	$(PY) bench/api.py
	$(PY) bench/records.py
	$(PY) bench/seccomp.py
	$(PY) bench/side_channels.py
	$(PY) bench/images.py
	$(PY) bench/broker.py
	$(PY) bench/soak.py --runs 100 --levels 16,64
	$(PY) bench/throughput.py --runs 40 --clients 8,32
	$(PY) bench/tti.py --n 30 --burst 100
	$(PY) bench/inspect_sandbox.py

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

serve: setup
	$(EPH) serve

# Served mode on one host (docs/deploy.md): a Prefect server, the process pool, the deployments
# of prefect.yaml and one worker. Ctrl-C stops the worker and then the server.
PREFECT_PORT ?= 4200
serve-prefect: setup
	@set -eu; \
	state=$${EPHEMERAL_STATE_DIR:-$$HOME/.local/state/ephemeral}; \
	export PREFECT_HOME="$$state/prefect-server" PREFECT_API_URL="http://127.0.0.1:$(PREFECT_PORT)/api"; \
	export EPHEMERAL_PROJECT_DIR="$(CURDIR)" PREFECT_WORKER_QUERY_SECONDS=1 \
	       PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1; \
	mkdir -p "$$PREFECT_HOME"; \
	[ -e "$$PREFECT_HOME/prefect.db" ] || cp "$$($(PY) -c 'from ephemeral.prefect_setup import ensure_template; from ephemeral.settings import Settings; print(ensure_template(Settings.load()))')" "$$PREFECT_HOME/prefect.db"; \
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT) & server=$$!; \
	trap 'kill $$worker $$server 2>/dev/null; wait' EXIT INT TERM; worker=; \
	until $(PY) -c "import httpx,sys; sys.exit(httpx.get('$$PREFECT_API_URL/health').status_code != 200)" 2>/dev/null; do sleep 1; done; \
	$(VENV)/bin/prefect work-pool create ephemeral-local --type process --overwrite; \
	$(VENV)/bin/prefect --no-prompt deploy --all; \
	$(VENV)/bin/prefect worker start --pool ephemeral-local --type process & worker=$$!; \
	wait $$worker

# Scale-out on this machine (docs/deploy.md): PostgreSQL, the Prefect server, the API with
# EPHEMERAL_EXECUTOR=prefect and two workers (hosts a and b). Ctrl-C stops them all.
cluster: setup
	$(PY) -m tests.cluster.run --port $${EPHEMERAL_PORT:-8000}

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache test-artifacts
