#!/usr/bin/env bash
# Installs BVLC Caffe (CPU) for the end-to-end test, into a prefix of its own.
#
# Debian bookworm has no Caffe; bullseye's `caffe` (1.0.0+git20180821) runs on bookworm
# when the bullseye-only libraries it needs are unpacked beside it. This script:
#   1. installs from bookworm what bookworm has (BLAS, boost, gflags, hdf5, lmdb, leveldb);
#   2. points a private apt (its own lists and cache: the system's apt is untouched) at
#      bullseye, using the same mirror as the machine's own sources;
#   3. downloads caffe + libcaffe1, unpacks them into PREFIX, and then, until `ldd` finds
#      every library, looks the missing ones up in bullseye's Contents index and unpacks
#      the packages that ship them (never libc or libstdc++: bookworm's are newer).
# Run the result with LD_LIBRARY_PATH set to the last line this script prints.
# Idempotent: a second run with everything in place does nothing (CI caches PREFIX).
#
#   scripts/install_caffe.sh [PREFIX]   (default /var/cache/leaktrace/caffe)
set -euo pipefail
prefix=${1:-/var/cache/leaktrace/caffe}
work="$prefix.apt"
# Every directory of PREFIX that holds a shared library (BLAS and LAPACK live in
# subdirectories, libpcre in /lib): print them as an LD_LIBRARY_PATH.
libdirs() {
    find "$prefix" -name '*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd: -
}
missing() {
    local libdirs
    libdirs=$(libdirs)
    LD_LIBRARY_PATH="$libdirs" ldd "$prefix/usr/bin/caffe" "$prefix"/usr/lib/x86_64-linux-gnu/libcaffe.so.* 2>/dev/null \
        | awk '/not found/ { print $1 }' | sort -u
}
if [ -x "$prefix/usr/bin/caffe" ] && [ -z "$(missing)" ]; then
    echo "caffe: already installed in $prefix; library path:"
    libdirs
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in libblas3 liblapack3 libpcre3 libgflags2.2 libboost-thread1.74.0 libboost-filesystem1.74.0 liblmdb0 libleveldb1d \
    libhdf5-103-1 libhdf5-hl-100 curl; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# The machine's Debian mirror (deb822 or one-line sources), for bullseye.
mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
    | grep -oE 'https?://[^ ]+/debian( |$)' | head -n 1 | tr -d ' ' || true)
mirror=${mirror:-http://deb.debian.org/debian}
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$prefix"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror bullseye main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Dir::State::Status=/dev/null
    -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
[ -s "$work/Contents" ] || curl -fsSL "$mirror/dists/bullseye/main/Contents-amd64.gz" | gunzip \
    | grep -E '^(usr/)?lib/' > "$work/Contents"

unpack() {
    (cd "$work/debs" && apt-get "${apt_opts[@]}" download "$@" >/dev/null)
    for p in "$@"; do
        dpkg -x "$(ls "$work"/debs/"${p}"_*.deb | head -n 1)" "$prefix"
    done
}
unpack caffe libcaffe1
last=""
for round in $(seq 1 30); do
    libs=$(missing)
    [ -z "$libs" ] && break
    if [ "$libs" = "$last" ]; then
        echo "caffe: unpacking did not provide: $(echo $libs)" >&2
        exit 1
    fi
    last=$libs
    pkgs=()
    for lib in $libs; do
        # Where the loader looks first, else anywhere under usr/lib; "section/package[,...]".
        pkg=$(awk -v f="/$lib" -v exact="usr/lib/x86_64-linux-gnu/$lib" '
            { i = index($1, f) }
            $1 == exact || $1 == substr(exact, 5) { hit = $NF; exit }
            i > 0 && i == length($1) - length(f) + 1 && other == "" { other = $NF }
            END { if (hit == "") hit = other; split(hit, first, ","); n = split(first[1], a, "/"); print a[n] }' "$work/Contents")
        case "$pkg" in
            ""|libc6|libstdc++6|libgcc-s1) echo "caffe: no bullseye package ships $lib" >&2; exit 1 ;;
        esac
        pkgs+=("$pkg")
    done
    echo "caffe: round $round: ${pkgs[*]}"
    unpack $(printf '%s\n' "${pkgs[@]}" | sort -u)
done
if [ -n "$(missing)" ]; then
    echo "caffe: still missing: $(missing | tr '\n' ' ')" >&2
    exit 1
fi
echo "caffe: installed in $prefix; library path:"
libdirs
