# scripts/rdma-vm/stage.sh - sourced by the scripts that run a release
# binary of this workspace inside the Soft-RoCE VM.
#
# stage_release_binary ROOT PACKAGE BINARY STAGE
#   Builds PACKAGE (release), empties STAGE and copies the binary BINARY
#   there (a private copy: the shared target directory may be rebuilt while
#   the VM runs). Exits the calling script if the binary was not built.
stage_release_binary() {
    local root=$1 package=$2 binary=$3 stage=$4 exe
    (cd "$root" && cargo build --release -p "$package")
    exe=$(cd "$root" && cargo metadata --format-version 1 --no-deps 2>/dev/null |
        grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
    exe=${exe:-$root/target}/release/$binary
    [ -x "$exe" ] || { echo "${0##*/}: $exe was not built" >&2; exit 1; }
    rm -rf "$stage"
    mkdir -p "$stage"
    cp "$exe" "$stage/$binary"
}
