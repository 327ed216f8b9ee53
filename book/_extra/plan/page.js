// The "Plan your run" page: a form for `python -m trainscale.planner`, and its plan drawn.
//
// The form's inputs become the command line's flags (shown under the form, and carried by
// the page's URL); worker.js runs trainscale.planner.cli.plan_json on them under Pyodide.
// This file only turns flags into a request and the returned JSON into HTML: every number
// on the page is the planner's.

const app = document.getElementById("plan-app");
const form = document.getElementById("plan-form");
const statusBox = document.getElementById("plan-status");
const output = document.getElementById("plan-output");
const CUSTOM = "";

// [flag, label, kind, where, hint]; kind: int, number, bool, select, stages.
const FIELDS = [
  ["--model", "Model", "select", "model", ""],
  ["--layers", "Layers", "int", "shape", ""],
  ["--hidden", "Hidden size", "int", "shape", ""],
  ["--heads", "Attention heads", "int", "shape", ""],
  ["--kv-heads", "Key-value heads", "int", "shape", "empty: as many as heads"],
  ["--ffn", "MLP width", "int", "shape", "empty: 4 × hidden"],
  ["--gated-mlp", "Gated MLP (SwiGLU)", "bool", "shape", ""],
  ["--vocab", "Vocabulary", "int", "shape", ""],
  ["--experts", "Experts", "int", "shape", "empty: a dense model"],
  ["--experts-per-token", "Experts per token", "int", "shape", ""],
  ["--params", "Parameters", "number", "shape", "empty: counted from the shape"],
  ["--seq-len", "Sequence length (tokens)", "int", "run", ""],
  ["--global-batch", "Global batch (sequences)", "int", "run", ""],
  ["--gpu", "GPU", "select", "cluster", ""],
  ["--nodes", "Nodes", "int", "cluster", ""],
  ["--gpus-per-node", "GPUs per node", "int", "cluster", ""],
  ["--software", "Software stack", "select", "cluster", ""],
  ["--max-tp", "Largest TP degree", "int", "limits", "empty: any"],
  ["--zero-stages", "ZeRO stages", "stages", "limits", "none ticked: the stack's"],
];
const SHAPE = { "--layers": "layers", "--hidden": "hidden", "--heads": "heads",
  "--kv-heads": "kv_heads", "--ffn": "ffn_hidden", "--gated-mlp": "gated_mlp",
  "--vocab": "vocab", "--experts": "experts", "--experts-per-token": "top_k",
  "--params": "params" };
// The book's colours for each part (trainscale.figures.style: MEMORY_COLOURS, TIME_COLOURS).
const COLOURS = {
  "weights": "#0072B2", "gradients": "#E69F00", "optimiser state": "#CC79A7",
  "activations": "#009E73",
  "compute": "#0072B2", "recomputation": "#56B4E9", "tensor-parallel traffic": "#E69F00",
  "context-parallel traffic": "#D55E00", "expert-parallel traffic": "#CC79A7",
  "pipeline sends": "#F0E442", "data-parallel traffic": "#009E73", "optimiser step": "#555555",
  "pipeline bubble": "#999999",
};
const GIB = 2 ** 30;

let choices = null;
let worker = null;
let asked = 0;
let shown = null; // the plan on the page
const timings = (window.planTimings = { opened: performance.now() });

const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
};
const id = (flag) => "plan" + flag.replace(/-/g, "_");
const field = (flag) => document.getElementById(id(flag));
const pct = (x) => (x === null ? "–" : `${(100 * x).toFixed(1)}%`);
const gib = (x) => (x === null ? "–" : `${(x / GIB).toFixed(1)} GiB`);
const secs = (x) => (x === null ? "–" : `${x.toFixed(2)} s`);

// --------------------------------------------------------------------------- the form

function buildForm() {
  const groups = { model: "Model", shape: "Shape (your own model)", run: "Batch",
    cluster: "Cluster", limits: "Constraints (optional)" };
  const sets = {};
  for (const [key, title] of Object.entries(groups)) {
    sets[key] = el("fieldset", { class: `plan-group plan-${key}` }, el("legend", { text: title }));
  }
  for (const [flag, label, kind, where, hint] of FIELDS) {
    let input;
    if (kind === "select") input = el("select", { id: id(flag), name: flag });
    else if (kind === "bool") input = el("input", { id: id(flag), name: flag, type: "checkbox" });
    else if (kind === "stages") {
      input = el("span", { id: id(flag), class: "plan-stages", role: "group",
        "aria-label": label });
      for (const z of [0, 1, 2, 3]) {
        input.append(el("label", {}, el("input", { type: "checkbox", value: String(z) }), ` ${z}`));
      }
    } else {
      input = el("input", { id: id(flag), name: flag, type: "text", inputmode: "numeric",
        autocomplete: "off", spellcheck: "false" });
    }
    const error = el("span", { class: "plan-error", id: id(flag) + "_error", role: "alert" });
    input.setAttribute?.("aria-describedby", error.id);
    const row = el("div", { class: "plan-field", "data-flag": flag },
      el("label", { for: id(flag), text: label }), input,
      hint ? el("span", { class: "plan-hint", text: hint }) : null, error);
    sets[where].append(row);
  }
  form.append(...Object.values(sets),
    el("div", { class: "plan-actions" },
      el("button", { type: "submit", id: "plan-go", class: "btn btn-primary", text: "Plan" }),
      el("code", { id: "plan-argv", class: "plan-argv" })));
}

function fillChoices() {
  const models = field("--model");
  const own = el("option", { value: CUSTOM, text: "Your own shape (fill in below)" });
  const shapes = el("optgroup", { label: "Model shapes" });
  const runs = el("optgroup", { label: "Published runs (each on its own cluster)" });
  for (const [name, preset] of Object.entries(choices.models)) {
    (preset.published ? runs : shapes).append(el("option", { value: name, text: preset.title }));
  }
  models.append(shapes, runs, own);
  for (const name of Object.keys(choices.gpus)) {
    field("--gpu").append(el("option", { value: name, text: name }));
  }
  field("--software").append(el("option", { value: "", text: "the preset's own (or the planner's default)" }));
  for (const [name, title] of Object.entries(choices.software)) {
    field("--software").append(el("option", { value: name, text: `${title} (${name})` }));
  }
}

// The flags a preset sets by itself, as the form shows them.
function presetValues(name) {
  const preset = choices.models[name];
  const m = preset.model;
  const values = { "--model": name, "--seq-len": m.seq_len, "--global-batch": preset.global_batch,
    "--gpu": preset.gpu, "--nodes": preset.nodes,
    "--gpus-per-node": choices.gpus[preset.gpu].gpus_per_node, "--software": preset.software };
  for (const [flag, key] of Object.entries(SHAPE)) values[flag] = m[key] ?? "";
  values["--experts-per-token"] = m.experts ? m.top_k : "";
  return values;
}

function setValue(flag, value) {
  const input = field(flag);
  if (flag === "--zero-stages") {
    const on = String(value || "").split(",");
    for (const box of input.querySelectorAll("input")) box.checked = on.includes(box.value);
  } else if (input.type === "checkbox") input.checked = value === true || value === "1";
  else input.value = value === null || value === undefined ? "" : String(value);
}

function getValue(flag) {
  const input = field(flag);
  if (flag === "--zero-stages") {
    return [...input.querySelectorAll("input:checked")].map((b) => b.value).join(",");
  }
  if (input.type === "checkbox") return input.checked ? "1" : "0";
  return input.value.trim();
}

function showShape() {
  const own = getValue("--model") === CUSTOM;
  for (const flag of Object.keys(SHAPE)) {
    field(flag).disabled = !own;
  }
  form.classList.toggle("plan-own-shape", own);
}

// The command line's flags for the form as it stands: what a preset sets by itself (and
// a GPU's own count per node) is left out, as a reader typing the command would.
function flags() {
  const name = getValue("--model");
  const own = name === CUSTOM;
  const base = own ? {} : presetValues(name);
  const argv = own ? [] : ["--model", name];
  for (const [flag, , kind] of FIELDS) {
    const shape = flag in SHAPE;
    if (flag === "--model" || (shape && !own)) continue; // a preset's shape is the preset's
    const value = getValue(flag);
    if (!(shape && own) && value === String(base[flag] ?? "")) continue;
    if (kind === "bool") argv.push(value === "1" ? flag : "--no-" + flag.slice(2));
    else if (value !== "") argv.push(flag, value);
  }
  const i = argv.indexOf("--gpus-per-node");
  if (i >= 0 && Number(argv[i + 1]) === choices.gpus[getValue("--gpu")]?.gpus_per_node) {
    argv.splice(i, 2);
  }
  return argv;
}

function fromQuery() {
  const query = new URLSearchParams(location.search);
  const name = query.has("model") ? query.get("model") : "70b";
  if (name !== CUSTOM && name in choices.models) {
    for (const [flag, value] of Object.entries(presetValues(name))) setValue(flag, value);
  } else {
    setValue("--model", CUSTOM);
    setValue("--gpu", choices.default_gpu); // the command line's defaults, as with no flag
    setValue("--software", "");
  }
  if (!query.has("gpu")) setValue("--gpus-per-node", choices.gpus[getValue("--gpu")].gpus_per_node);
  for (const [flag] of FIELDS) {
    const key = flag.slice(2);
    if (flag !== "--model" && query.has(key)) setValue(flag, query.get(key));
  }
  if (query.has("model") && !(name in choices.models) && name !== CUSTOM) {
    return ["--model", name]; // an unknown preset: let the planner say so
  }
  showShape();
  return null;
}

function toQuery(argv) {
  const query = new URLSearchParams();
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (flag.startsWith("--no-")) query.set(flag.slice(5), "0");
    else if (i + 1 < argv.length && !argv[i + 1].startsWith("--")) query.set(flag.slice(2), argv[++i]);
    else query.set(flag.slice(2), "1");
  }
  if (!argv.includes("--model")) query.set("model", CUSTOM);
  history.replaceState(null, "", `${location.pathname}?${query}${location.hash}`);
}

// --------------------------------------------------------------------------- running

function setState(state, text = "") {
  app.dataset.state = state;
  statusBox.hidden = state === "done" || state === "error";
  statusBox.querySelector(".plan-status-text").textContent = text;
}

function plan(argv) {
  asked += 1;
  const ask = asked;
  for (const box of form.querySelectorAll(".plan-error")) box.textContent = "";
  for (const bad of form.querySelectorAll("[aria-invalid]")) bad.removeAttribute("aria-invalid");
  document.getElementById("plan-argv").textContent =
    "python -m trainscale.planner " + argv.map((a) => (/^[\w.,=-]+$/.test(a) ? a : `'${a}'`)).join(" ");
  toQuery(argv);
  timings.asked = performance.now();
  setState("planning", "Planning…");
  worker.postMessage({ id: ask, argv });
}

function received(event) {
  const message = event.data;
  if (message.status) {
    setState("loading", `Loading ${message.detail}…`);
  } else if (message.failed) {
    setState("error");
    output.replaceChildren(el("p", { class: "plan-failed", text: `The planner could not start: ${message.failed}` }));
  } else if (message.ready) {
    choices = message.choices;
    timings.loaded = (performance.now() - timings.opened) / 1000;
    fillChoices();
    const unknown = fromQuery();
    plan(unknown || flags());
  } else if (pending.has(message.id)) {
    pending.get(message.id)(message.result);
    pending.delete(message.id);
  } else if (message.id === asked) {
    const now = performance.now();
    timings.lastPlan = (now - timings.asked) / 1000;
    if (timings.firstPlan === undefined) timings.firstPlan = (now - timings.opened) / 1000;
    show(message.result);
    setState(message.result.error && !message.result.request ? "error" : "done");
  }
}

// --------------------------------------------------------------------------- the plan

function fault(message, flag) {
  const named = flag || (message.match(/^--[a-z][a-z-]*/) || [])[0];
  const row = named && form.querySelector(`[data-flag="${named}"]`);
  if (row && !row.hidden && !row.querySelector("[disabled]")) {
    row.querySelector(".plan-error").textContent = message;
    (row.querySelector("input, select") || row).setAttribute("aria-invalid", "true");
    return true;
  }
  return false;
}

function stacked(parts, total, scale, labelOf) {
  const bar = el("div", { class: "plan-bar", role: "img" });
  const legend = el("ul", { class: "plan-legend" });
  Object.entries(parts).forEach(([name, value]) => {
    const colour = COLOURS[name] || "#333333";
    if (value > 0) {
      bar.append(el("span", { class: "plan-segment", title: `${name}: ${labelOf(value)}`,
        style: `width:${(100 * value) / scale}%;background:${colour}` }));
    }
    legend.append(el("li", {}, el("span", { class: "plan-swatch", style: `background:${colour}` }),
      `${name}: ${labelOf(value)}${total ? ` (${((100 * value) / total).toFixed(1)}%)` : ""}`));
  });
  bar.setAttribute("aria-label", [...legend.children].map((li) => li.textContent).join("; "));
  return [bar, legend];
}

function details(layout, data) {
  const cluster = data.request.cluster;
  const capacity = cluster.memory_bytes;
  const scale = Math.max(capacity, layout.memory_bytes);
  const [memBar, memLegend] = stacked(layout.memory_parts, layout.memory_bytes, scale, gib);
  const usable = el("span", { class: "plan-mark plan-usable",
    style: `left:${(100 * capacity * cluster.usable_memory) / scale}%`,
    title: `${pct(cluster.usable_memory)} of the GPU: what the planner fills` });
  const full = el("span", { class: "plan-mark plan-capacity", style: `left:${(100 * capacity) / scale}%`,
    title: `the GPU's ${gib(capacity)}` });
  memBar.append(usable, full);
  const [timeBar, timeLegend] = stacked(layout.times, layout.step_seconds, layout.step_seconds, secs);
  return el("section", { class: "plan-details", "aria-label": `layout ${layout.name}` },
    el("h3", { text: `${layout.name} (${layout.settings}${layout.virtual_stages > 1 ? `, V ${layout.virtual_stages}` : ""})` }),
    el("p", { text: `Memory per GPU: ${gib(layout.memory_bytes)} of ${gib(capacity)}` +
      ` (the planner fills at most ${pct(cluster.usable_memory)}: the rest is left for what it` +
      " does not count, the CUDA context, NCCL's buffers and fragmentation)." }),
    memBar, memLegend,
    el("p", { text: `Step time: ${secs(layout.step_seconds)}, MFU ${pct(layout.mfu)}` +
      (layout.mfu_range ? ` (range ${pct(layout.mfu_range[0])}–${pct(layout.mfu_range[1])})` : "") +
      ". Communication is the part left exposed after overlap." }),
    timeBar, timeLegend);
}

function table(data) {
  const body = el("tbody");
  data.best.forEach((layout, i) => {
    const pick = el("button", { type: "button", class: "plan-pick", text: layout.name,
      "aria-pressed": String(i === 0) });
    pick.addEventListener("click", () => {
      for (const b of body.querySelectorAll(".plan-pick")) b.setAttribute("aria-pressed", "false");
      pick.setAttribute("aria-pressed", "true");
      output.querySelector(".plan-details").replaceWith(details(layout, data));
    });
    body.append(el("tr", {}, el("td", { text: String(i + 1) }), el("td", {}, pick),
      el("td", { text: layout.settings + (layout.virtual_stages > 1 ? `, V ${layout.virtual_stages}` : "") }),
      el("td", { text: `${pct(layout.mfu)}` + (layout.mfu_range ? ` (${pct(layout.mfu_range[0])}–${pct(layout.mfu_range[1])})` : "") }),
      el("td", { text: secs(layout.step_seconds) }), el("td", { text: gib(layout.memory_bytes) })));
  });
  const head = el("tr", {}, ...["#", "Layout", "Settings", "MFU (range)", "Step", "Memory/GPU"]
    .map((t) => el("th", { scope: "col", text: t })));
  return el("table", { class: "plan-table" }, el("thead", {}, head), body);
}

function copyable(text) {
  const code = el("pre", { class: "plan-command" }, el("code", { text }));
  const button = el("button", { type: "button", class: "btn btn-secondary plan-copy", text: "Copy" });
  button.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
    } catch {
      const range = document.createRange();
      range.selectNodeContents(code);
      getSelection().removeAllRanges();
      getSelection().addRange(range);
      document.execCommand("copy");
    }
    button.textContent = "Copied";
  });
  return el("div", { class: "plan-copyable" }, code, button);
}

function show(data) {
  shown = window.planShown = data;
  output.classList.toggle("plan-stale", Boolean(data.error && !data.request));
  if (data.error && !data.request) {
    if (!fault(data.error, data.flag)) {
      output.replaceChildren(el("p", { class: "plan-failed", role: "alert", text: data.error }));
    }
    return;
  }
  const parts = [el("p", { class: "plan-summary" }, ...data.summary.flatMap((line) => [line, el("br")]))];
  if (data.error) {
    if (!fault(data.error, data.flag)) parts.push(el("p", { class: "plan-failed", text: data.error }));
    output.replaceChildren(...parts);
    return;
  }
  const counts = Object.entries(data.verdicts).map(([v, n]) => `${n.toLocaleString("en")} ${v}`).join(", ");
  parts.push(el("p", { text: `${data.layouts_tried.toLocaleString("en")} layouts tried: ${counts}.` }));
  if (data.best && data.best.length) {
    parts.push(el("h3", { text: `The fastest layouts (software: ${data.request.software.title})` }),
      table(data), details(data.best[0], data));
  }
  if (data.nothing_fits) parts.push(el("pre", { class: "plan-nothing", text: data.nothing_fits.join("\n") }));
  if (data.rejected.length) {
    const list = el("ul", { class: "plan-rejected" });
    for (const layout of data.rejected) {
      const v = layout.virtual_stages > 1 ? `, V ${layout.virtual_stages}` : "";
      list.append(el("li", {}, el("strong", { text: `${layout.name}, ${layout.settings}${v}: ${layout.verdict}` }),
        ` (${layout.notes.join("; ")})`));
    }
    parts.push(el("h3", { text: "Why faster layouts are rejected" }),
      el("p", { text: "For each reason the planner rejects a layout, the fastest layout it rejects:" }),
      list);
  }
  for (const line of data.without_context_parallel || []) parts.push(el("p", { class: "plan-note", text: line }));
  if (data.published) parts.push(el("p", { class: "plan-published", text: data.published.join(" ") }));
  for (const note of data.notes || []) parts.push(el("p", { class: "plan-note", text: `Note: ${note}` }));
  if (data.command) {
    parts.push(el("h3", { text: `To train layout ${data.command.layout}, ${data.command.where}` }),
      copyable(data.command.text));
    for (const note of data.command.notes) parts.push(el("p", { class: "plan-note", text: note }));
  }
  parts.push(el("details", { class: "plan-text" },
    el("summary", { text: "The same plan as python -m trainscale.planner prints it" }),
    el("pre", {}, el("code", { text: data.text.join("\n") }))));
  output.replaceChildren(...parts);
}

// The plan of any flags, from the page's own worker, leaving the form alone (for the book's
// tests and `make bench`, which compare it with `python -m trainscale.planner --json`).
const pending = new Map();
window.planWith = (argv) =>
  new Promise((resolve) => {
    const ask = `with ${pending.size + 1} ${performance.now()}`;
    pending.set(ask, resolve);
    worker.postMessage({ id: ask, argv });
  });

// --------------------------------------------------------------------------- start

buildForm();
statusBox.hidden = false;
setState("loading", "Loading Python (Pyodide)…");
const tick = setInterval(() => {
  if (app.dataset.state === "done" || app.dataset.state === "error") return;
  const s = Math.round((performance.now() - (app.dataset.state === "planning" ? timings.asked : timings.opened)) / 1000);
  statusBox.querySelector(".plan-elapsed").textContent = `${s} s`;
}, 500);
window.addEventListener("pagehide", () => clearInterval(tick));
worker = new Worker(new URL("worker.js", import.meta.url), { type: "module" });
worker.addEventListener("message", received);
worker.addEventListener("error", (e) => received({ data: { failed: e.message || "the worker failed" } }));
form.addEventListener("submit", (event) => {
  event.preventDefault();
  if (choices) plan(flags());
});
form.addEventListener("change", (event) => {
  if (event.target === field("--model")) {
    const name = getValue("--model");
    if (name !== CUSTOM) for (const [flag, value] of Object.entries(presetValues(name))) setValue(flag, value);
    else setValue("--params", ""); // your own shape: its parameters counted from it
    showShape();
  } else if (event.target === field("--gpu")) {
    setValue("--gpus-per-node", choices.gpus[getValue("--gpu")].gpus_per_node);
  }
});
