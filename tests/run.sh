#!/usr/bin/env bash
# Install what the tests need into .venv, bring up a real local Slurm when run as root, run pytest.
# This is the README's test command and what CI runs (.ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
# torch is pinned so pip takes the CPU wheel instead of a multi-GB CUDA build
pip install -q torch==2.13.0 -e '.[test]'
if [ "$(id -u)" = 0 ]; then
    bash slurm_templates/local-cluster.sh install
    bash slurm_templates/local-cluster.sh up --fresh
    trap 'bash slurm_templates/local-cluster.sh down' EXIT
else
    echo "not root: no local Slurm is started, so the tests marked 'slurm' are skipped"
fi
# In CI the Slurm tests must run: a cluster that failed to come up fails the run instead of skipping.
if [ "${CI:-}" = true ]; then export ISLANDS_REQUIRE_SLURM=1; fi
# Two pytest-xdist workers: the files that submit to Slurm run on one of them, one after another
# (tests/conftest.py); `-n 0` after it runs everything in this process. The 15 slowest tests are
# listed at the end: what the suite's time goes to stays in sight.
python -m pytest -n 2 --durations=15 "$@"
