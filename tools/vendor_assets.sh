#!/usr/bin/env bash
# Refresh the JavaScript the built site serves itself instead of loading from CDNs:
# require.js, the Jupyter widgets HTML manager (renders the sliders without a kernel)
# and MathJax 3. The files are committed under book/_extra/_static/vendor/, so
# `make book` works on a machine without npm; run this only to change a version.
# (The "Plan your run" page's Pyodide is not committed: tools/plan_page.py, run by every
# site build, fetches it from the npm registry once and records its version there.)
set -euo pipefail
REQUIREJS=2.3.8
HTML_MANAGER=1.0.13   # @jupyter-widgets/html-manager for ipywidgets 8
MATHJAX=3.2.2

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/book/_extra/_static/vendor"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm install --silent --no-audit --no-fund --ignore-scripts \
    "requirejs@$REQUIREJS" "@jupyter-widgets/html-manager@$HTML_MANAGER" "mathjax@$MATHJAX"
rm -rf "$out" && mkdir -p "$out/html-manager" "$out/mathjax/output/chtml/fonts"
cp node_modules/requirejs/require.js "$out/require.js"
cp node_modules/@jupyter-widgets/html-manager/dist/embed-amd.js "$out/html-manager/"
# Browsers that run the widget manager all take the woff2 fonts listed first.
cp node_modules/@jupyter-widgets/html-manager/dist/*.woff2 "$out/html-manager/"
cp node_modules/mathjax/es5/tex-mml-chtml.js "$out/mathjax/"
cp -r node_modules/mathjax/es5/output/chtml/fonts/woff-v2 "$out/mathjax/output/chtml/fonts/"
cat > "$out/VERSIONS.txt" <<TXT
requirejs $REQUIREJS (MIT)
@jupyter-widgets/html-manager $HTML_MANAGER (BSD-3-Clause; bundles Font Awesome 5 fonts, SIL OFL 1.1)
mathjax $MATHJAX (Apache-2.0)
Fetched from the npm registry by tools/vendor_assets.sh.
TXT
du -sh "$out"
