// The "Plan your run" page's Web Worker: Pyodide running the book's own planner.
//
// It loads Pyodide (pyodide/, fetched from the npm registry by tools/plan_page.py), unpacks
// trainscale.zip (the package's .py files, zipped from the tree when the site was built)
// and answers each message {id, argv} with {id, result}: the dict of
// trainscale.planner.cli.plan_json(argv), the same function `python -m trainscale.planner
// --json` prints. Nothing is computed here in JavaScript.

import { loadPyodide } from "./pyodide/pyodide.mjs";

const here = new URL(".", import.meta.url);

function status(stage, detail = "") {
  postMessage({ status: stage, detail });
}

async function start() {
  const started = performance.now();
  status("loading", "Python (Pyodide, about 13 MB)");
  const pyodide = await loadPyodide({ indexURL: new URL("pyodide/", here).href });
  status("loading", "the planner");
  const zip = await fetch(new URL("trainscale.zip", here));
  if (!zip.ok) throw new Error(`trainscale.zip: ${zip.status}`);
  pyodide.unpackArchive(await zip.arrayBuffer(), "zip", { extractDir: "/home/pyodide/lib" });
  pyodide.runPython(
    "import sys, json\n" +
      "sys.path.insert(0, '/home/pyodide/lib')\n" +
      "from trainscale.planner import cli\n" +
      "def plan(argv):\n" +
      "    return json.dumps(cli.plan_json(list(argv)), allow_nan=False)\n",
  );
  const plan = pyodide.globals.get("plan");
  const choices = JSON.parse(plan(["--list-models", "--json"]));
  postMessage({ ready: true, choices, seconds: (performance.now() - started) / 1000 });
  return plan;
}

const ready = start().catch((error) => {
  postMessage({ failed: String(error && error.message ? error.message : error) });
  throw error;
});

onmessage = async (event) => {
  const { id, argv } = event.data;
  const plan = await ready;
  const started = performance.now();
  try {
    const result = JSON.parse(plan(argv));
    postMessage({ id, result, seconds: (performance.now() - started) / 1000 });
  } catch (error) {
    postMessage({ id, result: { error: String(error.message || error), flag: null } });
  }
};
