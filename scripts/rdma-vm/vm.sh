#!/usr/bin/env bash
# scripts/rdma-vm/vm.sh - run one command inside a throw-away QEMU VM that has
# a Soft-RoCE RDMA device (kernel driver rdma_rxe, device "rxe0") and
# rdma-core's user space (libibverbs + rxe provider, perftest, ibv_devinfo).
#
# The host needs no RDMA support at all: the VM brings its own kernel (the
# current Debian 12 linux-image-*-amd64) and boots from a small initramfs
# built from Debian packages fetched with `apt-get download` plus the host's
# glibc (so the host must be Debian 12 or ABI-compatible).
#
# Usage:
#   vm.sh [options] HOSTDIR COMMAND [ARG...]
#       Share HOSTDIR read-write into the guest at the same absolute path, cd
#       there, run COMMAND (an argv; use `sh -c '...'` for shell syntax) with
#       rxe0 ready, stream its stdout+stderr to our stdout and exit with its
#       exit status.
#   vm.sh [options] --prepare
#       Only build the cache (downloads, initramfs), then exit.
#
# Options (environment variable in brackets):
#   --cache DIR      cache directory [DXNET_VM_CACHE, ~/.cache/dxnet-rdma-vm]
#   --timeout S      limit for the whole VM run, seconds [DXNET_VM_TIMEOUT, 600]
#   --mem MB         guest memory [DXNET_VM_MEM, 1536]
#   --smp N          guest CPUs [DXNET_VM_SMP, min(host CPUs, 4), at least 2]
#   --accel A        kvm | tcg | auto [DXNET_VM_ACCEL, auto]
#   --append ARGS    extra guest kernel command line, e.g. tsc=reliable
#                    [DXNET_VM_KERNEL_ARGS]
#   --env NAME=VAL   environment for the command (repeatable); the host's
#                    environment is not passed in
#   --verbose        copy the guest console to stderr [DXNET_VM_VERBOSE=1]
#   --rebuild        rebuild the cache from scratch
#
# The command sees RDMA_VM=1 RDMA_DEV=rxe0 RDMA_PORT=1 RDMA_GID_INDEX=<index of
# the RoCE v2 GID of RDMA_IP> RDMA_IP=10.211.0.1 RDMA_NETDEV=rxenet0, runs as
# root with an unlimited memlock limit and stdin = /dev/null.
#
# Exit status: the command's; 124 when the time limit hit; 125 when the VM
# could not be prepared or died without reporting a status.
#
# Host requirements: bash, apt-get/apt-cache/dpkg-deb, qemu-system-x86_64
# (qemu-system-x86), xz-utils, ldd, flock; ~500 MB temporary disk while the
# image is built (the cache keeps ~80 MB). When run as root, missing packages
# are installed (after `apt-get update` when needed); see ensure_host_tools.
# The guest's busybox (also used here to pack the initramfs), kernel,
# rdma-core 44 and perftest come from `apt-get download`, so no RDMA package
# needs to be installed on the host.

set -euo pipefail

ME=${0##*/}
HERE=$(cd "$(dirname "$0")" && pwd)
log() { printf '%s: %s\n' "$ME" "$*" >&2; }
fail() { log "error: $*"; exit 125; }

CACHE=${DXNET_VM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dxnet-rdma-vm}
TIMEOUT=${DXNET_VM_TIMEOUT:-600}
MEM=${DXNET_VM_MEM:-1536}
NCPU=$(nproc 2>/dev/null || echo 2)
SMP=${DXNET_VM_SMP:-$(( NCPU > 4 ? 4 : (NCPU < 2 ? 2 : NCPU) ))}
ACCEL=${DXNET_VM_ACCEL:-auto}
VERBOSE=${DXNET_VM_VERBOSE:-0}
KERNEL_ARGS=${DXNET_VM_KERNEL_ARGS:-}
VM_IP=10.211.0.1
ACTION=run
REBUILD=0
ENVS=()

# Bump when the cache layout or the image contents change incompatibly.
IMAGE_VERSION=4

# Debian packages unpacked for the guest (the kernel package is added).
PACKAGES=(busybox-static libibverbs1 ibverbs-providers librdmacm1 libibumad3
          ibverbs-utils perftest iproute2 libnl-3-200 libnl-route-3-200
          libmnl0 libbsd0 libmd0 libcap2 libpci3 libudev1 libgcc-s1 bash)
# Programs from those packages that go into the guest.
PROGRAMS=(usr/bin/ibv_devinfo usr/bin/ibv_devices usr/bin/ibv_rc_pingpong
          usr/bin/ib_send_bw usr/bin/ib_send_lat usr/bin/ib_write_bw
          usr/bin/ib_write_lat usr/bin/ib_read_bw usr/bin/ib_read_lat bin/ip
          sbin/ip usr/bin/rdma bin/bash)
# Kernel modules loaded at boot (their dependencies are found and added).
MODULES=(crc32_generic rdma_rxe ib_uverbs dummy virtio_pci 9pnet_virtio 9p)
# Host libraries always put into the guest (glibc and what Rust needs).
HOST_LIBS=(libc.so.6 libm.so.6 libpthread.so.0 libdl.so.2 librt.so.1
           libgcc_s.so.1 libresolv.so.2 libutil.so.1)

while [ $# -gt 0 ]; do
    case $1 in
        --cache) CACHE=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --mem) MEM=$2; shift 2 ;;
        --smp) SMP=$2; shift 2 ;;
        --accel) ACCEL=$2; shift 2 ;;
        --append) KERNEL_ARGS=$2; shift 2 ;;
        --env) ENVS+=("$2"); shift 2 ;;
        --verbose) VERBOSE=1; shift ;;
        --rebuild) REBUILD=1; shift ;;
        --prepare) ACTION=prepare; shift ;;
        -h|--help) sed -n '2,/^$/s/^# \{0,1\}//p' "$0"; exit 0 ;;
        --) shift; break ;;
        -*) fail "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
done

# ---------------------------------------------------------------------------
# Host tools
# ---------------------------------------------------------------------------
apt_updated=0
apt_update_once() {
    [ $apt_updated = 1 ] && return 0
    [ "$(id -u)" = 0 ] || return 1
    log "running apt-get update"
    apt-get update -qq >&2 || return 1
    apt_updated=1
}

ensure_host_tools() {
    local missing=()
    command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
    command -v xz >/dev/null || missing+=(xz-utils)
    command -v dpkg-deb >/dev/null || fail "dpkg-deb missing: this needs a Debian 12 host"
    [ ${#missing[@]} = 0 ] && return 0
    [ "$(id -u)" = 0 ] || fail "missing host packages: ${missing[*]} (apt-get install them as root)"
    log "installing ${missing[*]}"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
        apt_update_once || fail "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 ||
            fail "cannot install ${missing[*]}"
    fi
}

# ---------------------------------------------------------------------------
# Cache: $CACHE/kernel (bootable image), $CACHE/initrd.cpio, $CACHE/id
# ---------------------------------------------------------------------------
kernel_package() {
    apt-cache depends linux-image-amd64 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n 1
}

# The cache is valid when it was built by this image version with the same
# package list and guest init script.
image_id() {
    { echo "v$IMAGE_VERSION ${PACKAGES[*]} ${PROGRAMS[*]} ${MODULES[*]} ${HOST_LIBS[*]}"
      cat "$HERE/guest-init.sh"; } | cksum | cut -d' ' -f1
}

# Unpack the uncompressed ELF kernel from a bzImage: QEMU can boot it directly
# through its PVH entry point, which saves the in-guest decompression (several
# seconds under software emulation).
unpack_vmlinux() {
    local bz=$1 out=$2 magic tool off
    for magic in 'xz:\xfd\x37\x7a\x58\x5a\x00' 'zstd:\x28\xb5\x2f\xfd' 'gzip:\x1f\x8b\x08'; do
        tool=${magic%%:*}
        command -v "$tool" >/dev/null || continue
        for off in $(LC_ALL=C grep -obaUP "${magic#*:}" "$bz" 2>/dev/null | cut -d: -f1); do
            tail -c +"$((off + 1))" "$bz" | "$tool" -dc 2>/dev/null >"$out" || true
            if [ "$(head -c 4 "$out" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; then
                return 0
            fi
        done
    done
    rm -f "$out"
    return 1
}

# module_deps FILE: the module names FILE depends on (from its .modinfo).
module_deps() {
    local cat=cat
    case $1 in *.xz) cat="xz -dc" ;; *.zst) cat="zstd -qdc" ;; *.gz) cat="gzip -dc" ;; esac
    $cat "$1" | tr '\0' '\n' | sed -n 's/^depends=//p' | head -n 1 | tr ',' ' '
}

declare -A MODFILE=() MODSEEN=()
MODLIST=()
add_module() {
    local name=${1//-/_} dep
    [ -n "${MODSEEN[$name]:-}" ] && return 0
    MODSEEN[$name]=1
    if [ -z "${MODFILE[$name]:-}" ]; then
        # not a loadable module: fine if it is built into the kernel
        grep -qE "/${name//_/[-_]}\.ko" "$MODROOT/modules.builtin" 2>/dev/null ||
            log "warning: kernel module $name not found"
        return 0
    fi
    for dep in $(module_deps "${MODFILE[$name]}"); do add_module "$dep"; done
    MODLIST+=("$name")
}

# copy_libs_for ROOT FILE...: copy the shared libraries the ELF files need into
# ROOT's library directory, from the unpacked packages or else from the host.
copy_libs_for() {
    local root=$1 libdir=$1/usr/lib/x86_64-linux-gnu f line name path
    shift
    for f in "$@"; do
        while read -r line; do
            case $line in
                *"not found"*)
                    fail "${f#"$root"} needs ${line%% *}, found neither in the packages nor on the host" ;;
                *"=> /"*)
                    path=${line#*=> }; path=${path%% (*}; name=${path##*/}
                    [ -e "$libdir/$name" ] || cp -L "$path" "$libdir/$name" ;;
            esac
        done < <(LD_LIBRARY_PATH="$libdir" ldd "$f" 2>/dev/null || true)
    done
}

prepare() {
    mkdir -p "$CACHE"
    exec 8>"$CACHE/lock"
    flock 8
    local id
    id=$(image_id)
    if [ $REBUILD = 0 ] && [ -f "$CACHE/id" ] && [ "$(cat "$CACHE/id")" = "$id" ] &&
       [ -f "$CACHE/initrd.cpio" ] && [ -f "$CACHE/kernel" ]; then
        exec 8>&-
        return 0
    fi
    local t0=$SECONDS W=$CACHE/work
    log "preparing the VM image in $CACHE"
    rm -rf "$W"
    mkdir -p "$W/debs" "$W/pkg" "$W/root"

    # --- download ---------------------------------------------------------
    local kpkg
    kpkg=$(kernel_package)
    if [ -z "$kpkg" ] || ! apt-cache show "$kpkg" >/dev/null 2>&1; then
        apt_update_once || fail "no package lists; run 'apt-get update' as root"
        kpkg=$(kernel_package)
    fi
    [ -n "$kpkg" ] || fail "cannot find the Debian kernel package (linux-image-amd64's dependency)"
    download() { ( cd "$W/debs" && apt-get download -qq "$@" ) 2>&1 | grep -v -i unsandboxed >&2 || true; }
    download "$kpkg" "${PACKAGES[@]}"
    local p deb
    for p in "$kpkg" "${PACKAGES[@]}"; do
        if ! ls "$W/debs/${p}"_*.deb >/dev/null 2>&1; then
            # stale package lists (Debian drops superseded versions): refresh once
            apt_update_once || fail "download of $p failed"
            [ "$p" = "$kpkg" ] && { kpkg=$(kernel_package); p=$kpkg; }
            download "$p"
        fi
        deb=$(ls "$W/debs/${p}"_*.deb 2>/dev/null | head -n 1)
        [ -n "$deb" ] || fail "download of $p failed"
        dpkg-deb -x "$deb" "$W/pkg/$p"
    done

    # --- root file system (merged /usr) -----------------------------------
    local R=$W/root L=usr/lib/x86_64-linux-gnu
    mkdir -p "$R"/{usr/bin,usr/sbin,$L,usr/lib64,usr/lib/modules,etc/dxnet-vm,proc,sys,dev,tmp,run,root}
    ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"
    local bb=$W/pkg/busybox-static/bin/busybox applet
    cp "$bb" "$R/usr/bin/busybox"
    for applet in $("$bb" --list); do
        [ -e "$R/usr/bin/$applet" ] || ln -s busybox "$R/usr/bin/$applet"
    done
    local prog src
    for prog in "${PROGRAMS[@]}"; do
        src=$(ls -d "$W"/pkg/*/"$prog" 2>/dev/null | head -n 1)
        [ -n "$src" ] || continue     # e.g. ip lives in either bin/ or sbin/
        rm -f "$R/usr/bin/${prog##*/}"
        cp "$src" "$R/usr/bin/"
    done
    for prog in ibv_devinfo ib_send_bw ib_send_lat ib_write_bw ib_write_lat ib_read_bw \
                ib_read_lat ip rdma bash; do
        [ -x "$R/usr/bin/$prog" ] || fail "$prog missing from the packages"
    done
    # every shared library of the packages (symlinks kept), then libibverbs'
    # provider configuration
    for p in "${PACKAGES[@]}"; do
        for src in "$W/pkg/$p/lib/x86_64-linux-gnu" "$W/pkg/$p/usr/lib/x86_64-linux-gnu"; do
            [ -d "$src" ] && cp -a "$src/." "$R/$L/"
        done
    done
    cp -a "$W/pkg/ibverbs-providers/etc/libibverbs.d" "$R/etc/"
    local lib
    for lib in "${HOST_LIBS[@]}"; do
        # awk reads to the end: exiting at the first match would cut ldconfig
        # off mid-write (SIGPIPE, which pipefail turns into a failure).
        src=$(ldconfig -p | awk -v n="$lib" '$1 == n && /x86-64/ && !found { print $NF; found = 1 }')
        [ -n "$src" ] || fail "host library $lib not found"
        cp -L "$src" "$R/$L/$lib"
    done
    cp -L /lib64/ld-linux-x86-64.so.2 "$R/$L/ld-linux-x86-64.so.2"
    ln -s ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 "$R/usr/lib64/ld-linux-x86-64.so.2"
    copy_libs_for "$R" "$R"/usr/bin/* $(find "$R/$L" -maxdepth 2 -name '*.so*' -type f)
    printf '/usr/lib/x86_64-linux-gnu\n' >"$R/etc/ld.so.conf"
    ldconfig -r "$R" 2>/dev/null || true
    printf 'root:x:0:0:root:/root:/bin/sh\n' >"$R/etc/passwd"
    printf 'root:x:0:\n' >"$R/etc/group"
    printf '127.0.0.1 localhost\n' >"$R/etc/hosts"

    # --- kernel and modules ------------------------------------------------
    local K=$W/pkg/$kpkg f name
    MODROOT=$(ls -d "$K"/lib/modules/* | head -n 1)
    while read -r f; do
        name=${f##*/}; name=${name%%.ko*}; name=${name//-/_}
        MODFILE[$name]=$f
    done < <(find "$MODROOT/kernel" -name '*.ko*')
    for name in "${MODULES[@]}"; do add_module "$name"; done
    : >"$R/etc/dxnet-vm/modules"
    for name in "${MODLIST[@]}"; do
        f=${MODFILE[$name]}
        case $f in
            *.xz) xz -dc "$f" ;;
            *.zst) zstd -qdc "$f" ;;
            *.gz) gzip -dc "$f" ;;
            *) cat "$f" ;;
        esac >"$R/usr/lib/modules/$name.ko"
        echo "$name" >>"$R/etc/dxnet-vm/modules"
    done
    install -m 755 "$HERE/guest-init.sh" "$R/init"

    local bz
    bz=$(ls "$K"/boot/vmlinuz-* | head -n 1)
    if ! grep -q '^CONFIG_PVH=y' "$K"/boot/config-* 2>/dev/null || ! unpack_vmlinux "$bz" "$W/kernel"; then
        cp "$bz" "$W/kernel"
    fi

    ( cd "$R" && find . -mindepth 1 | LC_ALL=C sort | "$bb" cpio -o -H newc 2>/dev/null ) >"$W/initrd.cpio"
    mv -f "$W/kernel" "$CACHE/kernel"
    mv -f "$W/initrd.cpio" "$CACHE/initrd.cpio"
    echo "$kpkg" >"$CACHE/kernel-package"
    echo "$id" >"$CACHE/id"
    rm -rf "$W"
    log "VM image ready in $((SECONDS - t0))s ($kpkg, initramfs $(du -h "$CACHE/initrd.cpio" | cut -f1))"
    exec 8>&-
}

# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------
quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

pick_accel() {
    if [ "$ACCEL" != auto ]; then echo "$ACCEL"; return; fi
    # A /dev/kvm is not enough: some sandboxes expose a paravirtual one
    # (kvm_pvm) that cannot run a stock kernel. Require VT-x/AMD-V as well.
    if [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo && [ ! -d /sys/module/kvm_pvm ]; then
        echo kvm
    else
        echo tcg
    fi
}

QEMU_PID=
RUN=
cleanup() {
    if [ -n "$QEMU_PID" ]; then kill "$QEMU_PID" 2>/dev/null || true; wait "$QEMU_PID" 2>/dev/null || true; fi
    if [ -n "${TAIL_PID:-}" ]; then kill "$TAIL_PID" 2>/dev/null || true; fi
    if [ -n "$RUN" ]; then rm -rf "$RUN"; fi
}

start_qemu() {
    local accel=$1 cpu=max
    [ "$accel" = kvm ] && cpu=host
    : >"$RUN/console.log"
    : >"$RUN/status.log"
    local -a args=(
        -accel "$accel" -cpu "$cpu" -smp "$SMP" -m "$MEM" -M pc
        -nodefaults -no-user-config -display none -no-reboot
        -kernel "$CACHE/kernel" -initrd "$CACHE/initrd.cpio"
        -append "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off 8250.nr_uarts=4${KERNEL_ARGS:+ $KERNEL_ARGS}"
        -serial "file:$RUN/console.log"
        -chardev stdio,id=cmdout,signal=off -serial chardev:cmdout
        -serial "file:$RUN/status.log"
        -fsdev "local,id=ctl,path=$RUN/ctl,security_model=none"
        -device virtio-9p-pci,fsdev=ctl,mount_tag=ctl
    )
    if [ -n "$HOSTDIR" ]; then
        args+=(-fsdev "local,id=host,path=${HOSTDIR//,/,,},security_model=none,multidevs=remap"
               -device virtio-9p-pci,fsdev=host,mount_tag=host)
    fi
    qemu-system-x86_64 "${args[@]}" </dev/null &
    QEMU_PID=$!
}

# wait_status PATTERN SECONDS -> 0 seen, 1 QEMU gone, 2 timeout
wait_status() {
    local until=$((SECONDS + $2))
    while [ $SECONDS -lt $until ]; do
        grep -q "$1" "$RUN/status.log" 2>/dev/null && return 0
        kill -0 "$QEMU_PID" 2>/dev/null || return 1
        sleep 0.1
    done
    return 2
}

run() {
    local dir=$1; shift
    HOSTDIR=
    if [ -n "$dir" ]; then
        [ -d "$dir" ] || fail "$dir is not a directory"
        HOSTDIR=$(cd "$dir" && pwd -P)
    fi
    RUN=$(mktemp -d "${TMPDIR:-/tmp}/dxnet-vm.XXXXXX")
    trap cleanup EXIT
    trap 'cleanup; exit 130' INT
    trap 'cleanup; exit 143' TERM
    mkdir "$RUN/ctl"
    printf 'VM_HOSTDIR=%s\nVM_IP=%s\n' "$(quote "$HOSTDIR")" "$VM_IP" >"$RUN/ctl/vm.conf"
    local e
    : >"$RUN/ctl/env.sh"
    for e in ${ENVS[@]+"${ENVS[@]}"}; do
        case $e in
            [A-Za-z_]*=*) printf 'export %s=%s\n' "${e%%=*}" "$(quote "${e#*=}")" >>"$RUN/ctl/env.sh" ;;
            *) fail "--env needs NAME=VALUE, got '$e'" ;;
        esac
    done
    { printf 'exec'; for e in "$@"; do printf ' %s' "$(quote "$e")"; done; echo; } >"$RUN/ctl/cmd.sh"

    local accel t0=$SECONDS
    accel=$(pick_accel)
    if [ "$VERBOSE" = 1 ]; then
        tail -n +1 -F "$RUN/console.log" >&2 2>/dev/null &
        TAIL_PID=$!
    fi
    start_qemu "$accel"
    if [ "$accel" = kvm ] && [ "$ACCEL" = auto ] && ! wait_status VM_BOOTED 45; then
        log "warning: no boot under KVM within 45 s; using TCG"
        kill "$QEMU_PID" 2>/dev/null || true; wait "$QEMU_PID" 2>/dev/null || true
        accel=tcg
        start_qemu tcg
    fi
    local timed_out=0
    while kill -0 "$QEMU_PID" 2>/dev/null; do
        if [ $((SECONDS - t0)) -ge "$TIMEOUT" ]; then
            log "error: time limit of ${TIMEOUT}s reached; stopping the VM"
            timed_out=1
            kill "$QEMU_PID" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    wait "$QEMU_PID" 2>/dev/null || true
    QEMU_PID=
    local rc ready
    rc=$(sed -n 's/^VM_EXIT=\([0-9]*\).*/\1/p' "$RUN/status.log" | tail -n 1)
    ready=$(sed -n 's/^VM_READY uptime=\([0-9.]*\).*/\1/p' "$RUN/status.log" | tail -n 1)
    log "accel=$accel, rxe0 ready at ${ready:-?}s guest uptime, VM wall time $((SECONDS - t0))s, status ${rc:-none}"
    if [ -z "$rc" ]; then
        if [ "$VERBOSE" != 1 ]; then
            log "the VM ended without a status; last console lines:"
            tail -n 40 "$RUN/console.log" >&2
        fi
        [ $timed_out = 1 ] && return 124
        return 125
    fi
    return "$rc"
}

ensure_host_tools
prepare
case $ACTION in
    prepare) exit 0 ;;
    run)
        [ $# -ge 2 ] || fail "usage: $ME [options] HOSTDIR COMMAND [ARG...] (or --prepare; see --help)"
        d=$1; shift
        set +e
        run "$d" "$@"
        exit $?
        ;;
esac
