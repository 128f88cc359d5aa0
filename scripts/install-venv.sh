#!/bin/sh
# Install replicator from its wheel (`make dist`) into a virtualenv, and
# optionally its systemd units, made to run that virtualenv's console script.
#
#   scripts/install-venv.sh [--spark] [--units DIR] WHEEL [PREFIX]
#
# PREFIX: the virtualenv, /opt/replicator by default (what the units in
#   systemd/ run); made with `${PYTHON:-python3} -m venv` if it is not there,
#   else upgraded in place.
# --spark: with the exporter's extra (PySpark, matplotlib; Spark needs Java).
# --units DIR: copy systemd/*.service, *.target into DIR (e.g.
#   /etc/systemd/system), ExecStart=/ExecReload= pointing into PREFIX.
#
# pip reads its usual settings: to install without a network, point it at a
# directory of wheels (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR).
# Ends with `PREFIX/bin/replicator --version`.
set -eu

usage() { echo "usage: $0 [--spark] [--units DIR] WHEEL [PREFIX]" >&2; exit 2; }

extra= units=
while [ $# -gt 0 ]; do
    case "$1" in
        --spark) extra='[spark]'; shift ;;
        --units) [ $# -ge 2 ] || usage; units=$2; shift 2 ;;
        -h|--help) sed -n '2,17s/^# \{0,1\}//p' "$0"; exit 0 ;;
        -*) usage ;;
        *) break ;;
    esac
done
[ $# -ge 1 ] && [ $# -le 2 ] || usage
wheel=$1
prefix=${2:-/opt/replicator}
case "$wheel" in
    *.whl) [ -f "$wheel" ] || { echo "$0: no such wheel: $wheel" >&2; exit 2; } ;;
    *) echo "$0: not a wheel: $wheel (make dist builds one in dist/)" >&2; exit 2 ;;
esac
case "$prefix" in
    /*) ;;
    *) echo "$0: PREFIX must be an absolute path: $prefix" >&2; exit 2 ;;
esac

[ -x "$prefix/bin/python" ] || "${PYTHON:-python3}" -m venv "$prefix"
"$prefix/bin/python" -m pip install --quiet --upgrade "$wheel$extra"

if [ -n "$units" ]; then
    here=$(cd "$(dirname "$0")/.." && pwd)
    mkdir -p "$units"
    for unit in replicator-master.service replicator-worker@.service replicator.target; do
        sed "s#=/opt/replicator/bin/replicator #=$prefix/bin/replicator #" \
            "$here/systemd/$unit" > "$units/$unit"
        chmod 0644 "$units/$unit"
    done
fi
"$prefix/bin/replicator" --version
