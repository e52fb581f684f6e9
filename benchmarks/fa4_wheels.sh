#!/usr/bin/env bash
# Builds .fa4/1 and .fa4/2 (git-ignored): FlashAttention-4's CuTeDSL package and what it needs, for
# FlexAttention's FLASH backend (`kernel_options={"BACKEND": "FLASH"}`) on the H200 image (Python 3.12, CUDA 13),
# installed into a folder, xz-compressed (71 MiB; the wheels are ~110 MB) and cut in two halves, each under a device
# call's 64 MiB carry. From PyPI on a machine that reaches it, whatever Python runs this. On the H200: stage
# `fa4-site-1` of run_h200.sh (carry .fa4/1) keeps the first half in /tmp, then, on the same warm machine,
# `flex-flash-backend` (carry .fa4/2 .whl) joins and unpacks them.
#
#   bash benchmarks/fa4_wheels.sh
set -euo pipefail
WHL=${WHL:-.fa4}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# shellcheck source=benchmarks/wheel_target.sh
source "$(dirname "$0")/wheel_target.sh"
mkdir -p "$WHL/1" "$WHL/2" "$TMP/wheels"
python3 -m pip download -q --no-deps --pre "${TARGET[@]}" -d "$TMP/wheels" flash-attn-4==4.0.0b40 \
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
  einops==0.8.1 cuda-bindings==13.5.0 cuda-pathfinder protobuf
python3 -m pip install -q --no-index --no-deps --no-compile "${TARGET[@]}" --target "$TMP/site" "$TMP"/wheels/*.whl
tar cf - -C "$TMP/site" . | xz -T0 -9e >"$TMP/fa4_site.tar.xz"
split -n 2 -d "$TMP/fa4_site.tar.xz" "$TMP/fa4_site.tar.xz.part-"
mv "$TMP/fa4_site.tar.xz.part-00" "$WHL/1/"
mv "$TMP/fa4_site.tar.xz.part-01" "$WHL/2/"
du -sh "$WHL/1" "$WHL/2"
