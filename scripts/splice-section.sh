#!/usr/bin/env bash
# Replaces the lines between `<!-- NAME: begin -->` and `<!-- NAME: end -->` in FILE with the text
# on stdin (the markers stay); appends the section, markers included, where FILE has none yet.
# Used by the validation scripts, which each own one section of docs/simulator-validation.md.
#
#   some-command | scripts/splice-section.sh FILE NAME
set -euo pipefail
file="${1:?usage: splice-section.sh FILE NAME < text}"
name="${2:?usage: splice-section.sh FILE NAME < text}"
begin="<!-- $name: begin -->"
end="<!-- $name: end -->"
text=$(mktemp)
trap 'rm -f "$text" "$text.new"' EXIT
cat >"$text"
touch "$file"
if grep -qF "$begin" "$file" && grep -qF "$end" "$file"; then
  awk -v b="$begin" -v e="$end" -v t="$text" '
    $0 == b { print; while ((getline line < t) > 0) print line; skip = 1; next }
    $0 == e { skip = 0 }
    !skip { print }' "$file" >"$text.new"
else
  { cat "$file"; echo "$begin"; cat "$text"; echo "$end"; } >"$text.new"
fi
mv "$text.new" "$file"
