#!/usr/bin/env bash
# Compile every kernel through numba-hip for AMD GPUs, on a CPU-only Linux machine.
#   bash tools/rocm_compile_check.sh [compile_check args, e.g. --keep DIR]
#
# Builds, inside the repository and nowhere else:
#   .venv-rocm-check/  numba-hip from PyPI (numba 0.63, numpy < 2.4)
#   .rocm-prefix/      ROCm's compiler pieces from Debian's packages, unpacked
#                      with `dpkg-deb -x` (no root, nothing installed system-wide)
# and runs `python -m numba_cp.compile_check --target hip --arch $ARCH`, which
# prints one line per kernel specialisation and arch with the level reached
# (LLVM IR, or an AMDGPU code object) and exits 1 if any kernel misses the
# strongest level. Nothing runs on a GPU.
#
# Why Debian sid: its ROCm 7.0 comgr and HIP 6.4 hipRTC builtins are the newest
# packaged ones. They need glibc >= 2.38 and a newer libstdc++, so sid's libc6
# and libstdc++6 come along too, and Python runs under that libc's loader
# (`ld-linux-x86-64.so.2 --library-path ...`): the host's glibc is not touched.
# numba-hip's bundled LLVM 23 links against TheRock's librocm_sysdeps_{z,zstd}.so.1;
# they are built here from Debian's zlib and zstd.
#
# Needs: x86-64 Linux, bash, python3 (>= 3.10) with venv, apt-get and dpkg-deb
# (Debian/Ubuntu), the Debian archive keyring, and network access to PyPI and a
# Debian mirror. Environment knobs (defaults in brackets):
#   ARCH [gfx90a,gfx942]  VENV [.venv-rocm-check]  ROCM_PREFIX [.rocm-prefix]
#   PYTHON [python3]  NUMBA_HIP_SPEC [numba-hip==0.2.1]
#   DEBIAN_MIRROR [http://deb.debian.org/debian]  DEBIAN_SUITE [sid]
#   COMGR_PACKAGE [libamd-comgr3]  HIPRTC_BUILTINS_PACKAGE [libhiprtc-builtins6]
#   ROCM_CHECK_REFRESH=1  fetch the Debian packages again even if unpacked before
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
start=$(date +%s)
ARCH=${ARCH:-gfx90a,gfx942}
VENV=${VENV:-.venv-rocm-check}
PREFIX=${ROCM_PREFIX:-.rocm-prefix}
case "$PREFIX" in /*) ;; *) PREFIX="$ROOT/$PREFIX" ;; esac
PYTHON=${PYTHON:-python3}
NUMBA_HIP_SPEC=${NUMBA_HIP_SPEC:-numba-hip==0.2.1}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SUITE=${DEBIAN_SUITE:-sid}
COMGR_PACKAGE=${COMGR_PACKAGE:-libamd-comgr3}
HIPRTC_BUILTINS_PACKAGE=${HIPRTC_BUILTINS_PACKAGE:-libhiprtc-builtins6}
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
MULTIARCH=x86_64-linux-gnu

die() { echo "rocm_compile_check: $*" >&2; exit 2; }
# Exit 3 means "could not fetch a package" (registry or network), not a compile failure.
unfetched() { echo "rocm_compile_check: could not fetch $*" >&2; exit 3; }
[ "$(uname -m)" = x86_64 ] || die "needs an x86-64 machine (this is $(uname -m))"
for tool in apt-get apt-cache dpkg-deb; do
  command -v "$tool" >/dev/null || die "needs $tool (Debian or Ubuntu) to fetch ROCm's compiler pieces"
done
[ -r "$KEYRING" ] || die "needs the Debian archive keyring at $KEYRING (apt-get install debian-archive-keyring, or set DEBIAN_KEYRING)"

# --- 1. numba-hip from PyPI --------------------------------------------------
echo "== venv $VENV: $NUMBA_HIP_SPEC"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$NUMBA_HIP_SPEC" "numpy<2.4" \
  || unfetched "$NUMBA_HIP_SPEC from PyPI"

# --- 2. ROCm compiler pieces from Debian, into the private prefix ------------
APT_DIR="$PREFIX/apt"
UNPACKED="$PREFIX/root"
apt_opts=(
  -o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=$APT_DIR/none"
  -o "Dir::Etc::Preferences=$APT_DIR/none/preferences" -o "Dir::Etc::PreferencesParts=$APT_DIR/none"
  -o "Dir::State=$APT_DIR/state" -o "Dir::State::status=$APT_DIR/state/status"
  -o "Dir::Cache=$APT_DIR/cache" -o "APT::Architecture=amd64" -o "APT::Architectures=amd64"
  -o "Debug::NoLocking=1"
)
[ "$(id -u)" = 0 ] && apt_opts+=(-o "APT::Sandbox::User=root")
if [ -n "${ROCM_CHECK_REFRESH:-}" ] || [ ! -f "$PREFIX/.unpacked" ]; then
  echo "== Debian $DEBIAN_SUITE packages into $PREFIX"
  rm -rf "$UNPACKED" "$PREFIX/debs" "$PREFIX/.unpacked"
  mkdir -p "$APT_DIR/none" "$APT_DIR/state/lists/partial" "$APT_DIR/cache/archives/partial" \
           "$PREFIX/debs" "$UNPACKED"
  : > "$APT_DIR/state/status"
  echo "deb [signed-by=$KEYRING] $DEBIAN_MIRROR $DEBIAN_SUITE main" > "$APT_DIR/sources.list"
  apt-get "${apt_opts[@]}" -qq update || unfetched "Debian's package lists"
  # comgr is built against one LLVM; take that LLVM's libclang, lld and device libs.
  llvm_major=$(apt-cache "${apt_opts[@]}" depends "$COMGR_PACKAGE" \
               | sed -n 's/.*Depends: libllvm\([0-9][0-9]*\).*/\1/p' | head -n1)
  [ -n "$llvm_major" ] || die "cannot tell which LLVM $COMGR_PACKAGE ($DEBIAN_SUITE) is built on"
  wanted=("$COMGR_PACKAGE" "$HIPRTC_BUILTINS_PACKAGE" "rocm-device-libs-$llvm_major"
          "libclang1-$llvm_major" "libclang-common-$llvm_major-dev" "lld-$llvm_major"
          "libllvm$llvm_major")
  # Their run-time closure (libc6, libstdc++6, ...) and zlib's static library for the shim.
  mapfile -t packages < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends \
      --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "${wanted[@]}" \
      | grep -v '^[ <]' | sort -u)
  packages+=(zlib1g-dev)
  (cd "$PREFIX/debs" && apt-get "${apt_opts[@]}" -qq download "${packages[@]}") \
    || unfetched "ROCm's compiler packages from Debian"
  : > "$PREFIX/versions.txt"
  for deb in "$PREFIX"/debs/*.deb; do
    dpkg-deb -x "$deb" "$UNPACKED"
    printf '%s %s\n' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)" \
      >> "$PREFIX/versions.txt"
  done
  echo "$llvm_major" > "$PREFIX/llvm_major"
  rm -rf "$PREFIX/debs" "$APT_DIR/cache"
  touch "$PREFIX/.unpacked"
fi
llvm_major=$(cat "$PREFIX/llvm_major")
LIBDIR="$UNPACKED/usr/lib/$MULTIARCH"
LLVMDIR="$UNPACKED/usr/lib/llvm-$llvm_major"
LOADER="$LIBDIR/ld-linux-x86-64.so.2"
[ -x "$LOADER" ] || die "no dynamic loader in $LIBDIR (libc6 did not unpack?)"

# ld.lld, run under the prefix's glibc
rm -rf "$PREFIX/tmp"  # numba-hip caches the HIP device library it builds with comgr here
mkdir -p "$PREFIX/bin" "$PREFIX/sysdeps" "$PREFIX/rocm/lib" "$PREFIX/rocm/llvm/lib" "$PREFIX/tmp"
cat > "$PREFIX/bin/ld.lld" <<EOF
#!/bin/sh
exec "$LOADER" --library-path "$LIBDIR" "$LLVMDIR/bin/lld" -flavor gnu "\$@"
EOF
chmod +x "$PREFIX/bin/ld.lld"

# librocm_sysdeps_z.so.1 / _zstd.so.1 for numba-hip's bundled libLLVM.so: TheRock
# versions their symbols AMDROCM_SYSDEPS_1.0. zlib: its static library relinked with
# that version; zstd: Debian's library defines no symbol versions, which the
# dynamic loader accepts for a versioned reference.
if [ ! -f "$PREFIX/sysdeps/librocm_sysdeps_z.so.1" ]; then
  echo 'AMDROCM_SYSDEPS_1.0 { global: *; };' > "$PREFIX/sysdeps/sysdeps.map"
  "$PREFIX/bin/ld.lld" -shared -soname librocm_sysdeps_z.so.1 \
    --version-script "$PREFIX/sysdeps/sysdeps.map" -o "$PREFIX/sysdeps/librocm_sysdeps_z.so.1" \
    --whole-archive "$LIBDIR/libz.a" --no-whole-archive "$LIBDIR/libc.so.6"
fi
ln -sfn "$LIBDIR/libzstd.so.1" "$PREFIX/sysdeps/librocm_sysdeps_zstd.so.1"

# A ROCM_PATH tree in the layout numba-hip / rocm-bindings look for.
first() { for f in "$@"; do [ -e "$f" ] && { echo "$f"; return; }; done; die "missing: $*"; }
ln -sfn "$(first "$LIBDIR"/libamd_comgr.so.[0-9]*)" "$PREFIX/rocm/lib/libamd_comgr.so"
ln -sfn "$(first "$LIBDIR"/libhiprtc-builtins.so.[0-9]*)" "$PREFIX/rocm/lib/libhiprtc-builtins.so"
ln -sfn "$(first "$LIBDIR"/libclang-"$llvm_major".so.[0-9]*)" "$PREFIX/rocm/llvm/lib/libclang.so"
ln -sfn "$LLVMDIR/lib/clang" "$PREFIX/rocm/llvm/lib/clang"

echo "== ROCm pieces (Debian $DEBIAN_SUITE, unpacked in $PREFIX):"
grep -E '^(libamd-comgr|libhiprtc-builtins|rocm-device-libs|libclang1|libclang-common|lld-|libllvm|libc6 |libstdc\+\+6|zlib1g |libzstd1)' \
  "$PREFIX/versions.txt" | sed 's/^/   /'

# --- 3. the compile check -----------------------------------------------------
echo "== python -m numba_cp.compile_check --target hip --arch $ARCH (no GPU)"
set +e
env ROCM_PATH="$PREFIX/rocm" TMPDIR="$PREFIX/tmp" NUMBA_CP_LLD="$PREFIX/bin/ld.lld" \
    NUMBA_CP_BACKEND=hip NUMBA_CP_COMPILE_ONLY=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
    "$LOADER" --library-path "$LIBDIR:$PREFIX/sysdeps" "$VENV/bin/python" \
    -m numba_cp.compile_check --target hip --arch "$ARCH" --probe-comgr "$@"
status=$?
set -e
echo "== wall time $(( $(date +%s) - start )) s, exit status $status"
exit $status
