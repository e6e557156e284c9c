# Shared by launchers/lab, launchers/test, launchers/release and launchers/grade (sourced, not run).
# Creates the course environment in <repo>/.venv the first time, and again whenever
# requirements.txt or pyproject.toml change; afterwards it is reused in about a second.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
STAMP="$VENV/.lablib-installed"
PYTHON_BIN="${PYTHON:-python3}"

say() { printf '[labs] %s\n' "$*" >&2; }

_want_stamp() { cat "$REPO/requirements.txt" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1; }

ensure_env() {
  local want; want="$(_want_stamp)"
  if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  if ! "$PYTHON_BIN" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
    say "Python 3.10 or newer is needed (found: $("$PYTHON_BIN" --version 2>&1 || echo none))."
    say "Install Python 3.11, or point PYTHON at one: PYTHON=/path/to/python3.11 $0"
    exit 1
  fi
  if [ -L "$VENV" ]; then
    say "$VENV is a link to $(readlink -f "$VENV"), another checkout's environment; installing here would change it."
    say "Remove the link (rm $VENV) and run the command again: this checkout gets an environment of its own."
    exit 1
  fi
  local t0=$SECONDS
  say "First run: creating the course environment in $VENV (one time, a few minutes)."
  [ -x "$VENV/bin/python" ] || "$PYTHON_BIN" -m venv "$VENV"
  say "Step 1/3: pip itself."
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  say "Step 2/3: torch 2.13.0, JupyterLab, nbgrader and the rest of requirements.txt (the slow part)."
  # requirements.txt is also passed as constraints, so no dependency can move torch off 2.13.0.
  local log="$VENV/install.log"
  set +o pipefail
  "$VENV/bin/python" -m pip install --progress-bar off -r "$REPO/requirements.txt" -c "$REPO/requirements.txt" 2>&1 \
    | tee "$log" | grep --line-buffered -E '^(Collecting|Successfully installed|ERROR)' | sed 's/^/[labs]   /' >&2
  local rc=${PIPESTATUS[0]}
  set -o pipefail
  if [ "$rc" -ne 0 ]; then
    tail -n 25 "$log" >&2
    say "pip failed (exit $rc); the full log is $log. Fix the error above and run the command again."
    exit 1
  fi
  say "Step 3/3: lablib (editable) and the JupyterLab extensions."
  "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$REPO" 2>/dev/null \
    || "$VENV/bin/python" -m pip install --quiet --no-deps -e "$REPO"
  "$VENV/bin/python" - <<'PY'
import sys, importlib.metadata as md
want = {"torch": "2.13.0", "nbgrader": "0.9.6", "jupyterlab": "4.6.6"}
bad = {k: md.version(k) for k, v in want.items() if not md.version(k).startswith(v)}
if bad:
    sys.exit(f"[labs] wrong versions installed: {bad}; expected {want}. Delete .venv and run again.")
PY
  "$VENV/bin/jupyter" server extension enable --sys-prefix nbgrader.server_extensions.formgrader >/dev/null 2>&1 || true
  echo "$want" > "$STAMP"
  say "Environment ready in $((SECONDS - t0)) s."
}

ensure_env
# A .venv borrowed from another checkout runs that checkout's lablib: say so (the install step above refuses to
# install into a linked .venv, which would re-point the other checkout's environment at this one).
lablib_home="$("$VENV/bin/python" -I -c 'import importlib.util as u; s = u.find_spec("lablib"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null || true)"
if [ "$(cd "$lablib_home" 2>/dev/null && pwd -P)" != "$(cd "$REPO/lablib" && pwd -P)" ]; then
  say "Note: $VENV runs lablib from ${lablib_home:-nowhere}, not from this checkout ($REPO/lablib); to run this"
  say "checkout's code, remove $VENV (a link or a copy from elsewhere) and run the command again."
fi
export PATH="$VENV/bin:$PATH"
export PYTHONNOUSERSITE=1
# Tiny Shakespeare: use the copy next to the repository when there is one (CI, course machines).
if [ -z "${LABLIB_SHAKESPEARE:-}" ] && [ -f "$REPO/../shared/data/tinyshakespeare.txt" ]; then
  export LABLIB_SHAKESPEARE="$REPO/../shared/data/tinyshakespeare.txt"
fi
