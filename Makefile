# Cursus-py developer entry points. Every target creates the virtual environment it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run cluster test lint bench chaos chaos-long chaos-single clean proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

## make run: a standalone broker on 127.0.0.1 with data under ./data (Ctrl-C stops it cleanly)
run: $(STAMP)
	$(VENV)/bin/cursus-broker --host 127.0.0.1 --log-dir ./data

## make cluster: three brokers on 127.0.0.1 (client ports 9000-9002) as one replicated cluster, data
## under ./data/cluster/node-N, certificates generated on the first run (Ctrl-C stops all three cleanly)
cluster: $(STAMP)
	$(PY) -m cursus.cluster.devcluster --data ./data/cluster

## make test: the whole test suite (unit, integration with real broker processes)
test: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check cursus tests bench chaos
	$(VENV)/bin/mypy cursus

## make proto: regenerate the internal gRPC service code (cursus/internal/v1/) from proto/ (a test fails
## when the committed code is stale)
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/cursus/internal/v1/*.proto

## make bench: benchmarks, one JSON line per measurement
bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

## make chaos: a ~60 s seeded chaos run against a 3-node cluster (private network namespaces, partitions,
## leader kills, pauses, power loss on a minority, corruption; needs root), then the one-broker run and the
## corruption-detection scenario (SEED=N replays a seed; output under chaos-out/; see docs/chaos.md)
CLUSTER_FAULTS := kill,pause,partition,restart,lose-unsynced,corrupt
chaos: $(STAMP)
	$(PY) -m chaos run --nodes 3 --duration 60 --faults $(CLUSTER_FAULTS) $(if $(SEED),--seed $(SEED))
	$(PY) -m chaos run --nodes 1 --duration 60 --faults kill,pause,restart,lose-unsynced,torn-tail $(if $(SEED),--seed $(SEED))
	$(PY) -m chaos corrupt $(if $(SEED),--seed $(SEED))

## make chaos-long: a 600 s cluster chaos run (SEED=N replays a seed)
chaos-long: $(STAMP)
	$(PY) -m chaos run --nodes 3 --duration 600 --faults $(CLUSTER_FAULTS) $(if $(SEED),--seed $(SEED))

## make chaos-single: the one-broker chaos run (stage 1) for 600 s
chaos-single: $(STAMP)
	$(PY) -m chaos run --nodes 1 --duration 600 --faults kill,pause,restart,lose-unsynced,torn-tail $(if $(SEED),--seed $(SEED))
