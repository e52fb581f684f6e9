#!/usr/bin/env bash
# Builds .whl/hybrid (git-ignored), the packages benchmarks/hybrid_env.sh installs on the H200, from PyPI on a machine
# that reaches it: Linux x86-64 wheels for the H200 image's Python 3.12, whatever Python runs this. ~45 MiB, under a
# device call's 64 MiB carry.
#
#   bash benchmarks/hybrid_wheels.sh
set -euo pipefail
WHL=${WHL:-.whl/hybrid}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# shellcheck source=benchmarks/wheel_target.sh
source "$(dirname "$0")/wheel_target.sh"
download() {  # download FOLDER REQUIREMENT...
  local folder=$1
  shift
  mkdir -p "$folder"
  python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$folder" "$@"
}
download "$WHL/fla06" flash-linear-attention==0.6.0 fla-core==0.6.0
download "$WHL/fla042" flash-linear-attention==0.4.2 fla-core==0.4.2
download "$WHL/flashqla" flash-qla==0.1.3
# TileLang and what it needs, installed into a folder and xz-compressed (the wheels alone are 82 MB)
download "$TMP/wheels" tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
python3 -m pip install -q --no-index --no-deps --no-compile "${TARGET[@]}" --target "$TMP/site" "$TMP"/wheels/*.whl
tar cf - -C "$TMP/site" . | xz -T0 -9e >"$WHL/tilelang_site.tar.xz"
du -sh "$WHL"
