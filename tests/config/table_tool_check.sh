#!/usr/bin/env bash
# vramswap_config_table --check: accepts a file that holds the generated table (with other
# text around it) and refuses one that does not. Usage: table_tool_check.sh TOOL
set -euo pipefail
tool=$1
file=$(mktemp)
trap 'rm -f "$file"' EXIT
{ printf '# Configuration\n\n'; "$tool"; printf '\nMore text.\n'; } >"$file"
"$tool" --check "$file"
printf '| variable | default |\n' >"$file"
if "$tool" --check "$file" 2>/dev/null; then
  echo "--check accepted a file without the table" >&2
  exit 1
fi
