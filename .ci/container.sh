#!/usr/bin/env bash
# Container stage: build the image from the Dockerfile with podman, run the server in it with a
# tiny model, check /health, an SSE stream and the non-root user (tests/deploy/test_container.py).
# Separate from the fast tests: a cold build takes minutes (torch), a cached one well under one.
# How podman/buildah work on these machines: shared/CONTAINERS.md.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE="${STREAMSD_CI_BASE_IMAGE:-localhost/debian:bookworm-min}"
export STREAMSD_CI_BASE_IMAGE="$BASE_IMAGE"
# Inside this stage a missing tool must fail the test, not skip it.
export STREAMSD_CONTAINER_REQUIRED=1

missing=()
for tool in podman buildah debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    echo "container: installing ${missing[*]}"
    # Other jobs on the machine may hold the dpkg lock for a while; wait for it.
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o DPkg::Lock::Timeout=600 \
        podman buildah debootstrap
fi

# No image registry is reachable: bootstrap a Debian base once per machine. podman's image
# store (/var/lib/containers) keeps it, and the build's layer cache, between runs.
if podman image exists "$BASE_IMAGE"; then
    echo "container: base image $BASE_IMAGE cached"
else
    rootfs=$(mktemp -d /tmp/streamsd-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    start=$SECONDS
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
    tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
    echo "container: bootstrapped $BASE_IMAGE in $((SECONDS - start)) s"
fi

# -s: the test prints build time, image size and what the server answered.
rc=0
python -m pytest -m container -p no:cacheprovider -s -v tests/deploy/test_container.py || rc=$?

# Each rebuild leaves the previous image untagged; drop those (the tagged image's layers stay
# as the cache for the next run) so that the disk does not fill up over many runs.
podman image prune -f >/dev/null || true
exit "$rc"
