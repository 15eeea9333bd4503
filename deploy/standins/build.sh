#!/bin/sh
# Builds local stand-ins for the official base images (python, nats, postgres, haproxy, prometheus) from
# Debian's packages, for machines that reach Debian's and PyPI's mirrors but no container image registry:
#
#   deploy/standins/build.sh [PYTHON]     # PYTHON: a Python with modelpool installed (default: .venv/bin/python)
#
# then `docker compose` with PYTHON_IMAGE, NATS_IMAGE, POSTGRES_IMAGE, HAPROXY_IMAGE and PROMETHEUS_IMAGE set as it prints
# (docs/deploy.md).
# Needs root (debootstrap), a running Docker engine and Debian's debootstrap. Every image is built once:
# the Debian root file system is kept in ~/.cache/modelpool/standins and each image is skipped while it exists.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${1:-$here/../../.venv/bin/python}
cache=${MODELPOOL_STANDIN_CACHE:-$HOME/.cache/modelpool/standins}
base=modelpool-standin/debian:bookworm
mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p; s/^deb \(http[^ ]*\) .*/\1/p' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -n 1)}
mirror=${mirror:-http://deb.debian.org/debian}

exists() { docker image inspect "$1" >/dev/null 2>&1; }
say() { echo "[standins] $*" >&2; }

mkdir -p "$cache"
if ! exists "$base"; then
    if [ ! -s "$cache/bookworm-minbase.tar" ]; then
        say "debootstrap bookworm (minbase) from $mirror: a few minutes, once"
        root=$(mktemp -d)
        chmod 755 "$root"  # the image's /: readable by every user, as a root file system is
        debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
            || { tail -n 20 "$cache/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" -cf "$cache/bookworm-minbase.tar.part" .
        mv "$cache/bookworm-minbase.tar.part" "$cache/bookworm-minbase.tar"
        rm -rf "$root"
    fi
    say "importing $base"
    docker import "$cache/bookworm-minbase.tar" "$base" >/dev/null
fi

build() {  # image dockerfile [context]
    if exists "$1"; then return; fi
    say "building $1"
    docker build -t "$1" -f "$here/$2" --build-arg "BASE=$base" "${3:-$here}" >"$cache/build.log" 2>&1 \
        || { tail -n 30 "$cache/build.log" >&2; exit 1; }
}

context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
mkdir "$context/ca"
cp /usr/local/share/ca-certificates/*.crt "$context/ca/" 2>/dev/null || true
cp "$("$python" -c 'import shutil, sys; print(shutil.which("nats-server", path=sys.prefix + "/bin"))')" "$context/nats-server"
build modelpool-standin/python:3.11 python.Dockerfile "$context"
build modelpool-standin/nats:2 nats.Dockerfile "$context"
build modelpool-standin/postgres:15 postgres.Dockerfile
build modelpool-standin/haproxy:2 haproxy.Dockerfile
build modelpool-standin/prometheus:2 prometheus.Dockerfile

echo "PYTHON_IMAGE=modelpool-standin/python:3.11"
echo "NATS_IMAGE=modelpool-standin/nats:2"
echo "POSTGRES_IMAGE=modelpool-standin/postgres:15"
echo "HAPROXY_IMAGE=modelpool-standin/haproxy:2"
echo "PROMETHEUS_IMAGE=modelpool-standin/prometheus:2"
