#!/usr/bin/env bash
# Prints each skipped ctest test with the reason it gave (the GTEST_SKIP
# text), read from the last ctest log of a build directory.
build="${1:-build}"
log="$build/Testing/Temporary/LastTest.log"
[ -f "$log" ] || exit 0
python3 - "$log" <<'PY'
import re, sys
text = open(sys.argv[1], errors="replace").read()
rows = []
for block in re.split(r"\n\d+/\d+ Testing: ", text)[1:]:
    name = block.split("\n", 1)[0].strip()
    if "[  SKIPPED ] " not in block:
        continue
    lines = block.splitlines()
    reason = "(no reason given)"
    for i, line in enumerate(lines):
        if line.endswith(": Skipped") and i + 1 < len(lines):
            reason = lines[i + 1].strip()
            break
    rows.append((name, reason))
if rows:
    print(f"skipped tests ({len(rows)}), each with its reason:")
    for name, reason in rows:
        print(f"  {name}: {reason}")
else:
    print("no test was skipped")
PY
