# Sourced by gpu_hybrid_kernels.sh and gpu_hybrid_rows.sh: the environment and packages of the Gated DeltaNet kernel
# routes on the H200. Installs once per machine (a warm machine keeps /tmp, so a second call made right after the
# first finds everything installed and every compiled kernel and autotuning result on disk).
#
# In:  WHL (default .whl/hybrid), W (work folder, default /tmp/hyb), START (the caller's $SECONDS at its start),
#      AUTOTUNE (Triton autotuning results to start from, default benchmarks/cache/triton_autotune_h200.tgz).
# Out: PATHS / ROUTE (a route label's packages and fla route), COMMON, pypath LABEL (its PYTHONPATH), note TEXT
#      (echoed and kept in $W/status).
#
# Wheels (git-ignored, ~45 MiB, carried as `.whl/hybrid`; benchmarks/hybrid_wheels.sh builds them):
# tilelang_site.tar.xz (tilelang 0.1.15, apache-tvm-ffi 0.1.12, torch-c-dlpack-ext 0.1.5, z3-solver 4.15.4.0,
# installed with pip --target and xz-compressed: the wheels alone are 82 MB), fla06/ (flash-linear-attention +
# fla-core 0.6.0), fla042/ (0.4.2), flashqla/ (flash-qla 0.1.3). causal-conv1d is not carried: PyPI has only its
# source, whose CUDA build takes longer than a call; the short convolution runs on transformers' torch fallback
# (cheap next to the scan).
WHL=${WHL:-.whl/hybrid}
W=${W:-/tmp/hyb}
mkdir -p "$W"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
export USE_HUB_KERNELS=0  # no Hub to fetch the kernels transformers 5.25 swaps in by default
# Compiled kernels and autotuning results on disk, shared by every process (Triton's `cache_results`, which fla turns
# on by default: a process finds the configs an earlier one picked and compiles only those).
export TRITON_CACHE_DIR=$W/triton TILELANG_CACHE_DIR=$W/tilelang TVM_FFI_CACHE_DIR=$W/tvm-ffi FLA_CACHE_RESULTS=1 \
  TILELANG_PRINT_ON_COMPILATION=0
if [ -z "${CUDA_HOME:-}" ]; then  # TileLang's JIT needs nvcc and the CUDA headers
  for home in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
    if [ -x "$home/bin/nvcc" ] && [ -f "$home/include/cuda.h" ]; then export CUDA_HOME=$home; break; fi
  done
fi
note() { echo "$*" | tee -a "$W/status"; }

if [ ! -f "$W/installed" ]; then
  echo "=== install"
  if [ ! -f "$WHL/tilelang_site.tar.xz" ]; then
    echo "no $WHL/tilelang_site.tar.xz: carry .whl/hybrid (see benchmarks/hybrid_env.sh)"
    exit 1
  fi
  python3 - "$WHL/tilelang_site.tar.xz" "$W/tl" <<'PY' || note "tilelang unpack failed"
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    tar.extractall(sys.argv[2], filter="tar")
PY
  for set in fla06 fla042 flashqla; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/$set" "$WHL/$set"/*.whl \
      || note "pip install $set failed"
  done
  # .whl/common (when carried): the transformers release the tests are written for, with its hub / tokenizers,
  # under every route's packages.
  if compgen -G ".whl/common/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/common" .whl/common/*.whl \
      || note "pip install common failed"
  fi
  # Triton's autotuning results from earlier H200 calls (gpu_hybrid_rows.sh brings them back as triton_autotune.tgz;
  # kept in the repository as benchmarks/cache/triton_autotune_h200.tgz, 112 kernels: the 0.8B / 2B benchmarks and
  # the parity tests, fla 0.6 on Triton 3.6, bf16 and fp32): with them a kernel compiles only the config picked before
  # instead of every config it would autotune over. Triton uses a result only while the kernel's source, Triton and
  # the key match. TileLang's compiled kernels are not kept: a fresh machine still compiles for minutes.
  AUTOTUNE=${AUTOTUNE:-benchmarks/cache/triton_autotune_h200.tgz}
  if [ -f "$AUTOTUNE" ]; then
    mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$AUTOTUNE" -C "$TRITON_CACHE_DIR" \
      && note "autotuning results unpacked: $(tar tzf "$AUTOTUNE" | grep -c autotune.json)"
  fi
  touch "$W/installed"
  note "install done at $((SECONDS - ${START:-0})) s"
fi
COMMON=
[ -d "$W/common/transformers" ] && COMMON=$W/common
declare -A PATHS=([flash_qla]="$W/flashqla:$W/fla06:$W/tl" [fla_tilelang]="$W/fla06:$W/tl" [fla_triton]="$W/fla06"
  [fla042]="$W/fla042")
declare -A ROUTE=([flash_qla]=flash_qla [fla_tilelang]=fla_tilelang [fla_triton]=fla_triton [fla042]=fla_triton)
pypath() { echo "${PATHS[$1]:+${PATHS[$1]}:}$PWD${COMMON:+:$COMMON}"; }  # a label's PYTHONPATH (base: torch kernels)
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
nvcc --version | tail -2
echo "CUDA_HOME=${CUDA_HOME:-unset}"
for label in flash_qla fla042; do  # metadata only: importing torch here would cost seconds
  PYTHONPATH=$(pypath $label) python3 -c "import importlib.metadata as m
names = ('torch', 'triton', 'transformers', 'flash-linear-attention', 'fla-core', 'flash-qla', 'tilelang',
         'apache-tvm-ffi', 'torch-c-dlpack-ext', 'z3-solver')
print('$label:', *(f'{n} {m.version(n)}' for n in names if any(d.metadata['Name'] == n for d in m.distributions())))"
done
