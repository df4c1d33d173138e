#!/bin/bash
# The exported ABI of a built library is exactly the expected list: every defined dynamic
# symbol with its version (nm -D --defined-only; the version nodes themselves, type A, are
# left out: each symbol names its node). A symbol added, removed or re-versioned fails here,
# so the ABI cannot change by accident; update the list (and the version script) on purpose.
# Usage: check_symbols.sh LIBRARY EXPECTED_LIST
set -euo pipefail
library=$1
expected=$2
actual=$(nm -D --defined-only "$library" | awk '$2 != "A" { print $3 }' | LC_ALL=C sort)
want=$(grep -v '^#' "$expected" | LC_ALL=C sort)
if [[ "$actual" != "$want" ]]; then
  echo "exported symbols of $library differ from $expected (- expected, + actual):"
  diff <(echo "$want") <(echo "$actual") || true
  exit 1
fi
echo "$library exports exactly the $(echo "$want" | wc -l) symbols of $expected"
