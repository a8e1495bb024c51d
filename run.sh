#!/usr/bin/env bash
# tiermem's two commands:
#   ./run.sh demo   set up, then train a model through an embedded tiermemd
#   ./run.sh test   set up, then run the test suite
# Other forms: ./run.sh setup | bench NAME [ARGS] | lint | shell.
#
# Setup (idempotent, fast the second time): a virtual environment in .venv;
# torch reused when the system Python can import one, else the CPU build
# torch==2.13.0+cpu (never a CUDA build on a machine without a GPU); the
# project installed editable with its dev extra (tests, lint, matplotlib for
# the plots); Debian's libaio1 installed when missing and we are root; promtool
# (for the metrics tests) unpacked from Debian's prometheus package into the
# venv when missing (the package itself, a Prometheus server, is not installed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.tiermem-setup
TORCH_PIN="torch==2.13.0+cpu"
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { printf '[tiermem] %s\n' "$*" >&2; }
# pip warns about every configured local index that lacks a package; keep the real messages only
quiet_pip() { "$VENV/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

ensure_libaio() {
    if /sbin/ldconfig -p 2>/dev/null | grep -q 'libaio\.so\.1'; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        say "libaio.so.1 is missing; the swap tier will use its thread engine."
        say "For Linux AIO install it as root: apt-get install libaio1 (libaio1t64 on Debian 13)."
        return
    fi
    if ! command -v apt-get >/dev/null; then
        say "libaio.so.1 is missing and apt-get is not available; install libaio for Linux AIO."
        return
    fi
    say "installing Debian's libaio1"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q libaio1 >/dev/null 2>&1 && ! apt-get install -y -q libaio1t64 >/dev/null 2>&1; then
        apt-get update -q >/dev/null
        apt-get install -y -q libaio1 >/dev/null 2>&1 || apt-get install -y -q libaio1t64 >/dev/null
    fi
}

ensure_venv() {
    if [ ! -x "$VENV/bin/python" ]; then
        if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
            say "reusing the torch importable by $PYTHON"
            "$PYTHON" -m venv --system-site-packages "$VENV"
        else
            "$PYTHON" -m venv "$VENV"
        fi
    fi
    if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        say "installing $TORCH_PIN (CPU build)"
        quiet_pip install -q "$TORCH_PIN" 2>/dev/null \
            || quiet_pip install -q "$TORCH_PIN" --extra-index-url "$TORCH_CPU_INDEX"
    fi
    local want
    want=$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)
    if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
        say "installing tiermem into $VENV"
        quiet_pip install -q -e '.[dev]'
        echo "$want" >"$STAMP"
    fi
}

ensure_promtool() {
    # promtool only (for 'promtool check metrics' in the tests), unpacked from Debian's prometheus package
    # into the venv: installing the package would also install and start a Prometheus server
    if command -v promtool >/dev/null || [ -x "$VENV/bin/promtool" ]; then
        return
    fi
    if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
        say "promtool is missing (no apt-get); the metrics tests skip 'promtool check metrics'."
        return
    fi
    local tmp
    tmp=$(mktemp -d)
    say "unpacking promtool from Debian's prometheus package into $VENV/bin"
    if ! (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); then
        if [ "$(id -u)" = 0 ]; then
            apt-get update -q >/dev/null 2>&1 || true
        fi
        (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1) || true
    fi
    if ls "$tmp"/prometheus_*.deb >/dev/null 2>&1 && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x" \
        && [ -x "$tmp/x/usr/bin/promtool" ]; then
        cp "$tmp/x/usr/bin/promtool" "$VENV/bin/promtool"
    else
        say "could not get promtool; the metrics tests skip 'promtool check metrics'."
    fi
    rm -rf "$tmp"
}

setup() {
    ensure_libaio
    ensure_venv
    ensure_promtool
}

# pytest-xdist workers for ./run.sh test: one per core, at most 4 (many tests start a daemon and
# several ranks of their own, so more workers than cores only makes them wait); 0 runs in-process.
# TIERMEM_TEST_WORKERS overrides it.
test_workers() {
    local n
    n=${TIERMEM_TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}
    if [ -z "${TIERMEM_TEST_WORKERS:-}" ] && [ "$n" -gt 4 ]; then n=4; fi
    if [ "$n" -le 1 ]; then n=0; fi
    echo "$n"
}

# The suite in two phases: every test but the 'alone' ones over the workers, then those in one process with
# nothing beside them.  A phase that selects nothing (pytest's 5, for a path or -k that has none of its tests)
# is no failure unless neither phase ran anything.
run_tests() {
    local rc=0 rc_alone=0
    "$VENV/bin/python" -m pytest -q -n "$(test_workers)" -m 'not slow and not gpu and not alone' "$@" || rc=$?
    "$VENV/bin/python" -m pytest -q -m 'alone and not slow and not gpu' "$@" || rc_alone=$?
    if [ "$rc" = 5 ] && [ "$rc_alone" = 5 ]; then return 5; fi
    [ "$rc" = 5 ] && rc=0
    [ "$rc_alone" = 5 ] && rc_alone=0
    [ "$rc" = 0 ] && [ "$rc_alone" = 0 ]
}

cmd=${1:-help}
shift || true
case "$cmd" in
    setup) setup ;;
    demo) setup; exec "$VENV/bin/tiermem" demo "$@" ;;
    test) setup; run_tests "$@" ;;
    test-all) setup; exec "$VENV/bin/python" -m pytest -q "$@" ;;
    bench) setup; name=$1; shift; exec "$VENV/bin/python" "benchmarks/bench_$name.py" "$@" ;;
    lint) setup; "$VENV/bin/ruff" check tiermem tiermemd tests benchmarks; "$VENV/bin/mypy" ;;
    shell) setup; exec "$VENV/bin/python" "$@" ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; [ "$cmd" = help ] ;;
esac
