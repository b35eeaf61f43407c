#!/usr/bin/env bash
# Installs every system dependency of Conduit from Debian's packages. Idempotent: when everything is
# present it runs no apt-get at all; otherwise it runs `apt-get update` once, then one install.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libspdlog-dev libfmt-dev zlib1g-dev libsodium-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  openmpi-bin libopenmpi-dev
  iproute2 sudo python3 python3-torch gnuplot-nox shellcheck
  libopenblas-dev
  libtorch-dev libopenblas0-pthread dataset-fashion-mnist
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
