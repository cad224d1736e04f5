# Sourced by images.sh and previous.sh (after their die()): SLUICE_IMAGE_PROFILE, the Cargo profile
# the images' binaries are built in, as PROFILE, the cargo flags and the directory under target/ the
# binaries land in. `release`, the default, is what `make cluster-install` gives a user and what
# `make bench-cluster` measures; `dev` is the build `make test` has already linked (test.sh's choice).
# shellcheck shell=bash
PROFILE=${SLUICE_IMAGE_PROFILE:-release}
case "$PROFILE" in
release) cargo_flags=(--release) cell_profile=release ;;
dev) cargo_flags=() cell_profile=debug ;;
*) die "SLUICE_IMAGE_PROFILE must be release or dev, not $PROFILE" ;;
esac
