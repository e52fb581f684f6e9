# Sourced by hybrid_wheels.sh and fa4_wheels.sh: pip's download / install target for the H200 image (Linux x86-64,
# CPython 3.12), whatever Python runs pip here.
PLATFORMS=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")
