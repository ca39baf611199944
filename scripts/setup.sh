#!/usr/bin/env bash
# Installs what the tests need on a Debian machine, in one place: `scripts/test.sh`
# runs it first (so does CI, through that same command). Idempotent: what is there is
# left alone, so a second run takes seconds.
#
#   - Debian packages (as root, with apt): compilers for the fixtures, binutils (nm) for
#     the export check, python3 with its venv module and shared libpython (a C program
#     that embeds Python through dlopen), libjemalloc2 for the preloaded-allocator tests,
#     chromium (real program, and the HTML report rendered headless), valgrind (verdicts
#     compared), bsdutils (`script`, for the terminal case), and the real programs of
#     tests/real_programs.rs: a JVM, Ruby, node, Go, ffmpeg, a bubblewrap sandbox, Tcl,
#     Lua, PHP, Guile, busybox, gawk, redis, memcached, nginx, firejail, ...
#   - Python packages for the end-to-end tests (pip, for the python3 on PATH): the real
#     CUDA runtime wheel (no GPU here: it must pass "no driver" through unchanged),
#     PyTorch (CPU use; the wheel brings its own CUDA libraries), NumPy, TensorFlow for CPU,
#     pytest.
#   - BVLC Caffe, unpacked from Debian bullseye into /var/cache/leaktrace/caffe
#     (scripts/install_caffe.sh).
#
# Whatever cannot be installed here (not root, no network, another distribution) is
# named in one line at the end, and the tests that need it are counted as skipped by
# scripts/test.sh; under CI (CI set) such a skip fails the test instead.
#
# LEAKTRACE_SETUP=0 skips this script altogether (scripts/test.sh --no-setup does too).
set -uo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
if [ "${LEAKTRACE_SETUP:-1}" = 0 ]; then
    echo "setup: LEAKTRACE_SETUP=0: nothing installed"
    exit 0
fi
start=$(date +%s)
not_installed=()

debs=(gcc g++ binutils python3 python3-venv libpython3-dev libjemalloc2 chromium valgrind bsdutils
    default-jdk-headless ruby nodejs golang-go perl git make sqlite3 xz-utils ffmpeg
    bubblewrap openssh-client openssl util-linux mount tar gzip mawk curl
    tcl lua5.4 php-cli guile-3.0 busybox gawk redis-server redis-tools memcached nginx-light firejail strace)
missing=()
for pkg in "${debs[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: apt-get install ${missing[*]}"
        if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
            not_installed+=("Debian packages (${missing[*]})")
        fi
    else
        not_installed+=("Debian packages (not root: sudo apt-get install ${missing[*]})")
    fi
fi

# Python packages, for the python3 the tests run (pyenv's, a venv's or the system's).
pip_install() {
    python3 -m pip install -q "$@" 2>/dev/null || python3 -m pip install -q --break-system-packages "$@"
}
have_module() {
    python3 -c "import $1" >/dev/null 2>&1
}
for pair in nvidia.cuda_runtime:nvidia-cuda-runtime-cu12 torch:torch numpy:numpy pytest:pytest tensorflow:tensorflow-cpu; do
    module=${pair%%:*}
    package=${pair#*:}
    have_module "$module" && continue
    echo "setup: pip install $package"
    pip_install "$package" >/dev/null || not_installed+=("$package (python3 -m pip install $package)")
done

# BVLC Caffe (bullseye's, unpacked into a cache that later runs on this machine reuse).
caffe_prefix=${LEAKTRACE_CAFFE_PREFIX:-/var/cache/leaktrace/caffe}
if [ ! -x "$caffe_prefix/usr/bin/caffe" ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "setup: scripts/install_caffe.sh $caffe_prefix"
        scripts/install_caffe.sh "$caffe_prefix" >/dev/null || not_installed+=("Caffe (scripts/install_caffe.sh)")
    else
        not_installed+=("Caffe (not root: sudo scripts/install_caffe.sh)")
    fi
fi

if [ "${#not_installed[@]}" -gt 0 ]; then
    echo "setup: not installed, the tests that need them will be skipped: ${not_installed[*]}"
fi
echo "setup: done in $(($(date +%s) - start)) s"
exit 0
