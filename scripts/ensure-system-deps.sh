#!/usr/bin/env bash
# Installs the Debian packages the tests and the exporter need, only when one
# is missing: a real redis-server (and redis-sentinel), PostgreSQL server binaries, the JDBC drivers
# Spark reads through, Java, Prometheus (promtool) for the alert rules,
# chromium (headless, for the status page and EventSource tests), logrotate
# (the jsonl output rotated by it), nginx (a caching proxy in front of the
# read API) and Node.js with npm (the read API's JavaScript clients).
set -euo pipefail

need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

have_cmd redis-server || need+=(redis-server)
have_cmd redis-sentinel || need+=(redis-sentinel)  # the Sentinel failover test
{ have_cmd initdb || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; } || need+=(postgresql)
have_pkg libpostgresql-jdbc-java || need+=(libpostgresql-jdbc-java)
have_pkg libxerial-sqlite-jdbc-java || need+=(libxerial-sqlite-jdbc-java)
have_cmd java || need+=(default-jre-headless)
have_cmd systemd-analyze || need+=(systemd)
{ have_cmd promtool && have_cmd prometheus; } || need+=(prometheus)
have_cmd chromium || need+=(chromium)  # the status page's browser test
{ have_cmd logrotate || [ -x /usr/sbin/logrotate ]; } || need+=(logrotate)
{ have_cmd nginx || test -x /usr/sbin/nginx; } || need+=(nginx)  # proxy_cache in front of the read API
have_cmd node || need+=(nodejs)  # fetch and EventSource clients of the read API
have_cmd npm || need+=(npm)
have_cmd curl || need+=(curl)  # the read API by hand: pages, long-poll, events

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
echo "installing Debian packages: ${need[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "error: need root to apt-get install ${need[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
