#!/bin/sh
# The wheel as a hook author uses it (`make test-dist`): installed with pip into a fresh venv, then,
# as an unprivileged user with nothing else on PATH, its `sluice` checks the examples, runs their
# tests (in WebAssembly cells: no root, no gVisor, and it says so) and checks a hook only Python 3.12+
# parses. Usage: test-wheel.sh WHEEL
set -eu
wheel=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
user=nobody
work=$(mktemp -d /tmp/sluice-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --no-index --no-cache-dir "$wheel"
# What the author has: the examples, in a directory the unprivileged user can read.
cp -r "$repo/examples" "$work/examples"
cp "$repo/gateway/cli/tests/py312.yaml" "$work/py312.yaml"
chmod -R a+rX "$work"
as_author() {
	runuser -u "$user" -- env -i PATH="$work/venv/bin:/usr/bin:/bin" HOME="$work" "$@"
}
test "$(as_author sh -c 'command -v sluice')" = "$work/venv/bin/sluice"
as_author sluice --version
as_author sluice check "$work/examples/"
as_author sluice test "$work/examples/tests/pii-redaction.test.yaml" "$work/examples/tests/library-pii.test.yaml"
as_author sluice check "$work/py312.yaml"
echo "test-wheel: $(basename "$wheel") installed, checked and tested the examples as $user"
