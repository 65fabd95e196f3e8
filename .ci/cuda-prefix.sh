# shellcheck shell=bash
# Source from a crate's root on a CI machine with no GPU, no driver and no CUDA toolkit:
#     source .ci/cuda-prefix.sh
# Afterwards `cargo build` / `cargo test --no-run` of crates using candle-core's `cuda` feature
# (cudarc `dynamic-linking` + `cuda-version-from-build-system`, candle-kernels' nvcc build) work.
# The binaries link against stub libraries and must only be *run* on a machine with the driver and
# the CUDA 13 libraries (see shared/design/CUDA-BUILD-WITHOUT-TOOLKIT.md).
# Sourced, so: everything lives in a function with locals, errors `return` instead of exiting, and
# the caller's shell options are left alone.

_cuda_prefix_setup() {
  # Pinned to one CUDA release: nvcc's "release 13.0" picks cudarc's cuda-13000 bindings, and the
  # runtime wheel's libcudart.so.13 matches what the H200 machine has.
  local pins="nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
              nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85"
  # Own --target folder, not the user site: the user site may hold other nvidia-* versions
  # (mixing crt/nvvm of 13.5 with nvcc 13.0 breaks nvcc), and ~/.cache survives `cargo clean`.
  local wheels="${CUDA_PREFIX_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/cuda-prefix-13.0}"
  local stamp="$wheels/.pins"
  if [[ "$(cat "$stamp" 2>/dev/null)" != "$pins" ]]; then
    # One pip call for all wheels, --upgrade: pip --target only replaces (never merges) an existing
    # top-level folder, and all five wheels share nvidia/cu13/.
    # shellcheck disable=SC2086
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
      --upgrade --target "$wheels" $pins || { echo "cuda-prefix: pip install failed" >&2; return 1; }
    printf '%s' "$pins" >"$stamp"
  fi
  local prefix="$wheels/nvidia/cu13"
  [[ -x "$prefix/bin/nvcc" ]] || { echo "cuda-prefix: no nvcc in $prefix" >&2; return 1; }

  # cargo metadata resolves (and downloads) the caller's dependency graph, so cudarc's sources are
  # present, and it names the target folder that cargo will really use.
  local meta
  meta="$(cargo metadata --format-version 1)" || { echo "cuda-prefix: cargo metadata failed" >&2; return 1; }
  local target cudarc_dirs
  target="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' <<<"$meta")"
  cudarc_dirs="$(python3 -c 'import json,sys,os
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == "cudarc": print(os.path.dirname(p["manifest_path"]))' <<<"$meta")"
  [[ -n "$cudarc_dirs" ]] || { echo "cuda-prefix: cudarc is not in this crate's dependencies" >&2; return 1; }

  # Link-time stubs: every C symbol cudarc's sys modules can reference, over all CUDA versions
  # (union; the real libraries have the ones of the version built for). Taken from the bodies of
  # the `extern "C" { fn NAME(...) }` blocks, which skips cudarc's own helpers (culib, ...).
  # Sonames are the real libraries' so the executables ask for what the GPU machine has installed.
  local stubs="$target/cuda-stubs" tmp
  tmp="$(mktemp -d)" || return 1
  mkdir -p "$stubs" || return 1
  local lib name mod soname dir
  for lib in cuda:driver:libcuda.so.1 nvrtc:nvrtc:libnvrtc.so.13 curand:curand:libcurand.so.10 \
             cublas:cublas:libcublas.so.13 cublasLt:cublaslt:libcublasLt.so.13; do
    IFS=: read -r name mod soname <<<"$lib"
    for dir in $cudarc_dirs; do
      awk '/extern "C" \{/ {e = 1; next} e && /^ *\}/ {e = 0} e' "$dir/src/$mod/sys/mod.rs"
    done | sed -nE 's/^\s*(pub )?(unsafe )?fn ([A-Za-z_][A-Za-z0-9_]*)\(.*/\3/p' | sort -u \
         | sed 's/.*/void &(void) {}/' >"$tmp/$name.c"
    [[ -s "$tmp/$name.c" ]] || { echo "cuda-prefix: no symbols for lib$name" >&2; rm -rf "$tmp"; return 1; }
    # Rebuild only when the symbol list changed: keeps the stubs' mtimes stable between runs.
    if ! cmp -s "$tmp/$name.c" "$stubs/$name.c" || [[ ! -e "$stubs/$soname" ]]; then
      cc -shared -fPIC -Wl,-soname,"$soname" -o "$stubs/$soname" "$tmp/$name.c" \
        || { echo "cuda-prefix: building the lib$name stub failed" >&2; rm -rf "$tmp"; return 1; }
      cp "$tmp/$name.c" "$stubs/$name.c"
    fi
    ln -sfn "$soname" "$stubs/lib$name.so"
  done
  rm -rf "$tmp"
  # candle-kernels links -lcudart: the wheel's real library (soname libcudart.so.13) is fine to link.
  ln -sfn "$prefix/lib/libcudart.so.13" "$stubs/libcudart.so"

  # CUDA 13.0's host_config.h rejects GCC > 15: point nvcc at an older gcc when the default is newer.
  local gmaj v
  gmaj="$(cc -dumpversion 2>/dev/null | cut -d. -f1)"
  if [[ "$gmaj" =~ ^[0-9]+$ ]] && (( gmaj > 15 )); then
    for v in 15 14 13 12; do command -v "g++-$v" >/dev/null && { export NVCC_CCBIN="g++-$v"; break; }; done
  fi

  # nvcc on PATH: cudarc runs `nvcc --version` and cudaforge (candle-kernels) takes the toolkit root
  # from nvcc's location. CUDA_ROOT/CUDA_PATH make cudarc's link search use the prefix instead of
  # /usr. No nvidia-smi here, so the compute capability must be given. LIBRARY_PATH is read by the
  # linker only; LD_LIBRARY_PATH is deliberately untouched (never run against the stubs).
  # Sourcing twice must not grow PATH/LIBRARY_PATH.
  [[ ":$PATH:" == *":$prefix/bin:"* ]] || export PATH="$prefix/bin:$PATH"
  [[ ":${LIBRARY_PATH:-}:" == *":$stubs:"* ]] || export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export CUDA_ROOT="$prefix" CUDA_PATH="$prefix"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  echo "cuda-prefix: nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') at $prefix; stubs in $stubs" >&2
}
_cuda_prefix_setup || { unset -f _cuda_prefix_setup; return 1; }
unset -f _cuda_prefix_setup
