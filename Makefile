# Ephemeral: two commands on a fresh machine, `make demo` and `make test`; both set up what they need.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
EPH := $(VENV)/bin/ephemeral
# Debian packages. What the demo needs: the gVisor and namespaces sandboxes and the image builder
# (gcc: the default image's preload shims; python3-pip: the host's pip of builds, run by an
# unprivileged uid: sandbox/host_pip.py). What only the tests and microVMs add: QEMU and its
# boot artifacts' tools, Chromium for the page tests, PostgreSQL for the ledger tests, the CNCF
# registry and skopeo for the registry-image tests (a real registry on loopback).
APT_RUNTIME := bubblewrap runsc mmdebstrap gcc libc6-dev util-linux libseccomp2 python3-pip
APT_PACKAGES := $(APT_RUNTIME) qemu-system-x86 e2fsprogs busybox-static cpio chromium postgresql \
                docker-registry skopeo
# One per core; loadfile keeps each file on one worker, in order (module fixtures
# such as tests/cluster's one cluster, and tests that build on the previous one). Files are
# handed out in the order tests/conftest.py sorts them (the longest first); without
# --no-loadscope-reorder pytest-xdist would reorder them by test count.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST_XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10
PYTEST_ARGS ?=

.PHONY: setup demo-setup apt apt-runtime venv venv-runtime harbor-venv image image-default prefect-template \
        demo test test-slow test-fast bench lint fmt serve serve-prefect cluster clean

# Everything the tests need (both images, every package, the dev extra).
setup: apt venv image prefect-template harbor-venv
# Only what the demo needs: runtime packages and dependencies, the `default` image. Another
# image builds with `ephemeral images build NAME`; a run naming one that is not built is refused
# with that command in the error.
demo-setup: apt-runtime venv-runtime image-default prefect-template

# Installed only when one is missing.
define apt_install
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
endef
apt:
	$(call apt_install,$(APT_PACKAGES))
apt-runtime:
	$(call apt_install,$(APT_RUNTIME))

# Two stamps: .runtime (the package and its dependencies) and .installed (plus the dev extra).
# A venv the demo made is upgraded by the first `make test`; a dev venv serves the demo as is.
venv: $(VENV)/.installed
venv-runtime: $(VENV)/.runtime
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@ $(VENV)/.runtime
$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	[ $(VENV)/.installed -nt pyproject.toml ] || $(PY) -m pip install -q -e .
	touch $@

# Harbor (issue 23) needs Python >= 3.12; the project venv stays on 3.11, so Harbor and this
# package get a second venv of their own: `harbor run -e ephemeral.harbor:EphemeralEnvironment`
# runs from it (docs/integrations.md). Skipped, with a notice, when no Python 3.12 is found.
HARBOR_VENV ?= .venv-harbor
HARBOR_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3) $(shell command -v python3.12))
harbor-venv: $(HARBOR_VENV)/.installed
$(HARBOR_VENV)/.installed: pyproject.toml
	@if [ -z "$(HARBOR_PYTHON)" ]; then echo "harbor-venv: no Python 3.12 found: the Harbor tests will skip"; exit 0; fi; \
	set -e; test -x $(HARBOR_VENV)/bin/python || $(HARBOR_PYTHON) -m venv $(HARBOR_VENV); \
	$(HARBOR_VENV)/bin/python -m pip install -q -U pip; \
	$(HARBOR_VENV)/bin/python -m pip install -q "harbor==0.25.0" -e .; \
	touch $@

# The sandbox image is cached by the hash of its definition: a second build takes seconds.
image: venv
	$(EPH) images build
	$(EPH) images build python-dev
image-default: venv-runtime
	$(EPH) images build

prefect-template: venv-runtime
	$(PY) -c "from ephemeral.prefect_setup import ensure_template; from ephemeral.settings import Settings; print(ensure_template(Settings.load()))"

# The product page's sample, offline (replayed model turns, real sandbox, real Prefect flow).
demo: demo-setup
	$(EPH) run recipes/sandbox-proof.yaml

# The whole suite but the `tcg_slow` tests, on TEST_WORKERS processes, the ten slowest listed
# at the end. CI (.ci/run) also sets EPHEMERAL_TEST_REQUIRE_DRIVERS, so a missing gvisor or
# namespaces driver fails the run instead of skipping its tests.
test: setup
	$(PY) -m pytest $(PYTEST_XDIST) -m "not tcg_slow" $(PYTEST_ARGS)

# The TCG microVM variants outside the smoke set that `make test` keeps (tests/conftest.py).
test-slow: setup
	$(PY) -m pytest $(PYTEST_XDIST) -m tcg_slow $(PYTEST_ARGS)

# The inner loop: everything but the markers that cost minutes (TCG microVMs and other `slow`
# tests, the Prefect server, PostgreSQL, Chromium). Real sandboxes still run.
FAST_MARKERS := not slow and not prefect and not postgres and not browser
test-fast: setup
	$(PY) -m pytest $(PYTEST_XDIST) -m "$(FAST_MARKERS)" $(PYTEST_ARGS)

bench: setup
	$(PY) bench/sandbox.py
	$(PY) bench/run.py
	$(PY) bench/api.py
	$(PY) bench/records.py
	$(PY) bench/seccomp.py
	$(PY) bench/side_channels.py
	$(PY) bench/images.py
	$(PY) bench/agent_runtime.py
	$(PY) bench/ledger.py
	$(PY) bench/broker.py
	$(PY) bench/gateway.py
	$(PY) bench/soak.py --runs 100 --levels 16,64
	$(PY) bench/throughput.py --runs 40 --clients 8,32
	$(PY) bench/prefect_floor.py --runs 40 --clients 8,32
	$(PY) bench/tti.py --n 30 --burst 100
	$(PY) bench/inspect_sandbox.py
	$(PY) bench/harbor.py

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
# EPHEMERAL_EXECUTOR=dispatch and two workers (hosts a and b). Ctrl-C stops them all.
cluster: setup
	$(PY) -m tests.cluster.run --port $${EPHEMERAL_PORT:-8000}

clean:
	rm -rf $(VENV) $(HARBOR_VENV) .pytest_cache .mypy_cache .ruff_cache test-artifacts
