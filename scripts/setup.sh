#!/usr/bin/env bash
# Installs every build and test dependency of nflash from Debian packages (root or sudo).
# Why each package: see README.md, "Dependencies".
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build ccache pkg-config \
  libz3-dev libzstd-dev libcli11-dev nlohmann-json3-dev liburing-dev \
  libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev libcpp-httplib-dev \
  python3 python3-numpy python3-jinja2 gnuplot-nox >/dev/null
echo "setup: dependencies installed"
