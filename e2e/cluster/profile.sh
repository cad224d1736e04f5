# Sourced by images.sh and previous.sh (after their die()): SLUICE_IMAGE_PROFILE, the Cargo profile
# the images' binaries are built in, as PROFILE, the cargo flags and the directory under target/ the
# binaries land in. `release`, the default, is what `make cluster-install` gives a user and what
# `make bench-cluster` measures; `dev` is the build `make test` has already linked (test.sh's choice).
# `cargo_select` is what images.sh builds: the selection (the whole workspace, with the tests in dev)
# that `make build` and `make bench` (release) and `make test-rust` (dev) build, so that the features
# Cargo resolves are theirs and the images' build compiles nothing they did not (Makefile, TEST_BUILD).
# shellcheck shell=bash
PROFILE=${SLUICE_IMAGE_PROFILE:-release}
case "$PROFILE" in
release) cargo_flags=(--release) cargo_select=(--workspace --bins) cell_profile=release ;;
dev) cargo_flags=() cargo_select=(--workspace --bins --tests) cell_profile=debug ;;
*) die "SLUICE_IMAGE_PROFILE must be release or dev, not $PROFILE" ;;
esac
