# Thin wrappers: the logic lives in scripts/ so CI and humans run the same thing.
.PHONY: setup test test-fast lint demo clean distclean

setup:
	bash scripts/setup.sh

test: setup
	bash scripts/test.sh

# The inner loop (a few minutes): ruff, then the tests that need neither the broker nor the engine.
test-fast: setup
	bash scripts/test.sh fast

lint: setup
	bash scripts/test.sh lint

demo: setup
	.venv/bin/mmworker demo

# Caches and build output only; `distclean` also removes the virtualenv (a ~3.5 GB reinstall).
clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache *.egg-info
	find . -path ./.venv -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf .venv
