#!/usr/bin/env bash
# Refresh axe-core, the accessibility checker tests/browser/test_accessibility.py runs in
# every page of the built site. Its minified script and licence are committed under
# tests/browser/vendor/, so the tests need no npm; run this only to change the version.
# It is a test tool, not part of the site: nothing under book/ loads it.
set -euo pipefail
AXE_CORE=4.14.1

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/tests/browser/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm install --silent --no-audit --no-fund --ignore-scripts "axe-core@$AXE_CORE"
rm -rf "$out" && mkdir -p "$out"
cp node_modules/axe-core/axe.min.js "$out/"
cp node_modules/axe-core/LICENSE "$out/axe-core-LICENSE.txt"
cat > "$out/VERSIONS.txt" <<TXT
axe-core $AXE_CORE (MPL-2.0, LICENSE in axe-core-LICENSE.txt)
Fetched from the npm registry by tools/vendor_axe.sh.
TXT
du -sh "$out"
