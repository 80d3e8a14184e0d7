#!/usr/bin/env bash
# The ends of the torch range pyproject.toml declares: for each torch version, a virtual environment of its own
# (outside the project), nanoforge installed into it beside exactly that torch, and the fast test suite run with
# it. Not part of CI (each version is a few GB to install and a suite run takes minutes); the README's
# Development section records what it printed.
#
#   benchmarks/torch_range.sh                    # the oldest and the newest tested: 2.6.0 and 2.14.1
#   benchmarks/torch_range.sh 2.8.0              # any other release
#
# VENVS (default: ../venvs beside the project) holds one venv per version, torch-X, kept for the next run.
# PYTEST_ARGS replaces the selection (default: -m "not slow"). Prints one summary line per version at the end
# and exits non-zero if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENVS="${VENVS:-$(dirname "$ROOT")/venvs}"
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -eq 0 ]] && VERSIONS=(2.6.0 2.14.1)
EXTRAS='.[test,report,export,serve,parquet]'  # what `make setup` installs
if [[ -n "${PYTEST_ARGS:-}" ]]; then read -ra ARGS <<< "$PYTEST_ARGS"; else ARGS=(-m "not slow"); fi
mkdir -p "$VENVS"

summaries=() failed=0
for v in "${VERSIONS[@]}"; do
    venv="$VENVS/torch-$v" log="$VENVS/torch-$v.pytest.log"
    echo "== torch $v in $venv"
    # The constraint makes pip refuse (not silently replace) this torch if a test dependency wanted another.
    if ! { [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"; } ||
       ! "$venv/bin/pip" install -q "torch==$v" ||
       ! "$venv/bin/pip" install -q -e "$EXTRAS" -c <(echo "torch==$v"); then
        summaries+=("torch $v: install failed"); failed=1; continue
    fi
    got=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
    if [[ "${got%%+*}" != "$v" ]]; then
        summaries+=("torch $v: the venv runs torch $got"); failed=1; continue
    fi
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${ARGS[@]}" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [[ $rc -ne 0 ]] && failed=1
    summaries+=("torch $got ($(date -u +%F)): $(grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | tr -d '=' | xargs) [exit $rc]")
done
echo
printf '%s\n' "${summaries[@]}"
exit "$failed"
