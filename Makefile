# Everything a fresh machine needs: `make demo`, `make test` (ruff, then the suite).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
TORCHRUN := .venv/bin/torchrun
STAMP   := .venv/.installed

.PHONY: demo test train bench venv clean

venv: $(STAMP)

# torch is pinned and installed first: a CPU wheel of 2.13.0 is available on these
# machines, while an unpinned torch would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml
	test -d .venv || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 .venv/bin/micscompile demo

test: $(STAMP)
	.venv/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

# a small GPT on the Python standard library's source: clipping, schedule, evaluation, checkpoints
# (runs/train_lm; started again it resumes), loss_curve.png at the end; ARGS="--steps 600" etc.
train: $(STAMP)
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc-per-node 4 examples/train_lm.py $(ARGS)

# mc.compile prices its default schedule on this machine's calibration: made once (2 min), then cached
bench: $(STAMP)
	$(PIP) install -q -e ".[bench]"
	test -f $(HOME)/.cache/micscompile/local_cluster.json || OMP_NUM_THREADS=1 $(PY) -m micscompile calibrate --nproc 4
	OMP_NUM_THREADS=1 $(TORCHRUN) --standalone --nproc-per-node 4 benchmarks/bench_peers.py

clean:
	rm -rf .venv build *.egg-info
