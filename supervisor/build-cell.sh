#!/usr/bin/env bash
# Builds the cell runtime every sandbox's supervisor loads, beside the binaries of one profile:
#   guest/*.py + wit/cell.wit --componentize-py--> cell.wasm (a pre-initialised CPython component)
#   cell.wasm --sluice-supervisor compile--> target/<profile>/sluice-cell.cwasm (+ .sha256)
# componentize-py (pinned, from PyPI) lives in a cache outside the checkout, and so does the component,
# keyed by its inputs: a second checkout or CI run reuses both. Usage: build-cell.sh debug|release
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-debug}
# The supervisor is built as part of the selection every other build of the profile makes (the
# Makefile's TEST_BUILD and RELEASE_BUILD): `-p sluice-supervisor` alone resolves other features for
# tokio, futures, rustix, object, smallvec and more, and so compiled wasmtime and cranelift a second
# time beside the workspace's build of them.
case "$profile" in
  debug) cargo_flags=(--workspace --bins --tests) ;;
  release) cargo_flags=(--release --workspace --bins) ;;
  *) echo "build-cell.sh: profile must be debug or release, not $profile" >&2; exit 2 ;;
esac
COMPONENTIZE_PY_VERSION=0.25.1
cache=${SLUICE_CELL_CACHE:-/var/cache/sluice/cell}
mkdir -p "$cache"

venv="$cache/componentize-py-$COMPONENTIZE_PY_VERSION"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION"
  touch "$venv/.complete"
fi

key=$( (echo "componentize-py $COMPONENTIZE_PY_VERSION"; cat supervisor/wit/cell.wit supervisor/guest/*.py) | sha256sum | cut -c1-16)
component="$cache/cell-$key.wasm"
if [ ! -f "$component" ]; then
  "$venv/bin/componentize-py" -q -d supervisor/wit -w cell componentize -p supervisor/guest runner -o "$component.tmp"
  mv "$component.tmp" "$component"
fi

cargo build -q "${cargo_flags[@]}"
supervisor="target/$profile/sluice-supervisor"
# The precompiled artefact depends on the component, wasmtime's version and the engine settings
# (supervisor/src/runtime.rs); either profile's supervisor makes the same one, so it is cached too.
wasmtime=$(grep -A1 '^name = "wasmtime"$' Cargo.lock | sed -n 's/^version = "\(.*\)"/\1/p' | head -n 1)
compiled_key=$( (echo "$key wasmtime $wasmtime"; cat supervisor/src/runtime.rs) | sha256sum | cut -c1-16)
compiled="$cache/cell-$compiled_key.cwasm"
if [ ! -f "$compiled" ] || [ ! -f "$compiled.sha256" ]; then
  "$supervisor" compile "$component" "$compiled.tmp"
  mv "$compiled.tmp.sha256" "$compiled.sha256"
  mv "$compiled.tmp" "$compiled"
fi
out="target/$profile/sluice-cell.cwasm"
if ! cmp -s "$compiled.sha256" "$out.sha256" 2>/dev/null || [ ! -f "$out" ]; then
  cp "$compiled" "$out.tmp" && mv "$out.tmp" "$out"
  cp "$compiled.sha256" "$out.sha256"
fi
echo "cell runtime: $out ($(cut -c1-12 "$out.sha256"))"
