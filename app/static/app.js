// The qloc page: plain JavaScript over the v1 API (same origin). No framework, no build step.
"use strict";

const KEY_STORAGE = "qloc.apiKey";  // sessionStorage only: the key lives as long as this tab
const SVG = "http://www.w3.org/2000/svg";
const TERMINAL = new Set(["succeeded", "failed", "canceled"]);
const STEP_MS = 450;

const $ = (sel) => document.querySelector(sel);
const state = { set: null, exemplars: [], adaptFiles: [], job: null, pollTimer: null, players: [] };

// ---------------------------------------------------------------- API calls and their errors

class ApiError extends Error {
  constructor(status, detail) {
    super(status ? `HTTP ${status}: ${detail}` : detail);
    this.status = status;
    this.detail = detail;
  }
}

/** The API's ``detail`` as one readable line: a message, or FastAPI's list of validation issues. */
function describeDetail(body, text, statusText) {
  const detail = body && typeof body === "object" ? body.detail : undefined;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail.map((issue) => {
      const where = (issue.loc || []).filter((p) => p !== "body" && p !== "query").join(".");
      return where ? `${where}: ${issue.msg}` : issue.msg;
    }).join("; ");
  }
  if (detail !== undefined) return JSON.stringify(detail);
  return (text || "").trim().slice(0, 300) || statusText || "no detail given";
}

async function api(method, path, { form, query } = {}) {
  const headers = new Headers();
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers.set("X-API-Key", key);
  let url = path;
  if (query) {
    const qs = new URLSearchParams();
    for (const [k, v] of Object.entries(query)) if (v !== undefined && v !== null && v !== "") qs.set(k, String(v));
    if ([...qs].length) url += `?${qs}`;
  }
  let resp;
  try {
    resp = await fetch(url, { method, body: form, headers });
  } catch (e) {
    throw new ApiError(0, `cannot reach the API (${e.message})`);
  }
  if (resp.status === 204) return null;
  const text = await resp.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch { body = null; }
  if (!resp.ok) throw new ApiError(resp.status, describeDetail(body, text, resp.statusText));
  return body;
}

function showError(context, err) {
  console.error(context, err);
  const box = document.createElement("div");
  box.className = "error";
  box.dataset.context = context;
  if (err && err.status !== undefined) box.dataset.status = String(err.status);
  const msg = document.createElement("span");
  msg.className = "msg";
  msg.textContent = `${context}: ${err && err.message ? err.message : String(err)}`;
  const close = document.createElement("button");
  close.type = "button";
  close.title = "Dismiss";
  close.textContent = "×";
  close.addEventListener("click", () => box.remove());
  box.append(msg, close);
  $("#errors").append(box);
}

function clearErrors() { $("#errors").replaceChildren(); }

function say(text) { $("#status").textContent = text; }

/** Run an action: its errors are shown, never swallowed; its button is disabled meanwhile. */
async function act(context, button, fn) {
  if (button) button.disabled = true;
  try {
    const done = await fn();
    // this action went through: an error it showed before (a retry's first try) is stale now
    for (const box of $("#errors").querySelectorAll(".error")) if (box.dataset.context === context) box.remove();
    return done;
  } catch (e) {
    showError(context, e);
    return undefined;
  } finally {
    if (button) button.disabled = false;
  }
}

window.addEventListener("unhandledrejection", (ev) => showError("Unexpected error", ev.reason));

// ---------------------------------------------------------------- small helpers

const PAGE = 200;  // the API's largest page

async function listAll(path) {
  // every item of a paged list (the API pages by limit/offset and says the count): a 201st set is not cut off
  const data = [];
  for (;;) {
    const res = await api("GET", path, { query: { limit: PAGE, offset: data.length } });
    data.push(...res.data);
    if (!res.data.length || data.length >= res.count) return { data, count: res.count };
  }
}

const shortId = (id) => (id ? String(id).slice(0, 8) : "—");
const fmt = (v, digits = 3) => (typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : v ?? "—");

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function fillInfo(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v] of pairs) dl.append(el("dt", { text: k }), el("dd", { text: v ?? "—" }));
}

function setRect(rect, box) {
  const [x1, y1, x2, y2] = box;
  rect.setAttribute("x", x1);
  rect.setAttribute("y", y1);
  rect.setAttribute("width", Math.max(0, x2 - x1));
  rect.setAttribute("height", Math.max(0, y2 - y1));
}

/** An image's pixel size, as the browser decodes it. */
function imageSize(url) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve([img.naturalWidth, img.naturalHeight]);
    img.onerror = () => reject(new Error("the browser cannot decode this file as an image"));
    img.src = url;
  });
}

/** A drop zone: files dropped on it or chosen with its input go to ``onFiles``. */
function dropZone(zone, input, onFiles) {
  input.addEventListener("change", () => { onFiles([...input.files]); input.value = ""; });
  zone.addEventListener("dragover", (ev) => { ev.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (ev) => {
    ev.preventDefault();
    zone.classList.remove("over");
    onFiles([...(ev.dataTransfer ? ev.dataTransfer.files : [])]);
  });
}

function needSet() {
  if (!state.set) throw new ApiError(0, "choose or create an exemplar set first");
  return state.set;
}

// ---------------------------------------------------------------- actions named from the boxes

// models/core/actions.py: shrink toward a corner or the centre, stay, move, and (photo bundles) aspect changes.
const ACTION_LABELS = {
  shrink_tl: "shrink ↖ (keep top-left)", shrink_tr: "shrink ↗ (keep top-right)",
  shrink_bl: "shrink ↙ (keep bottom-left)", shrink_br: "shrink ↘ (keep bottom-right)",
  shrink_center: "shrink to centre", stay: "stay", left: "move left ←", right: "move right →",
  up: "move up ↑", down: "move down ↓", taller: "taller ↕", wider: "wider ↔", narrower: "narrower",
  shorter: "shorter", move: "move",
};

/** The action that took box ``a`` to box ``b``, told from their edges (the API returns boxes, not actions). */
function actionName(a, b) {
  const tol = 1e-3 * Math.max(1, a[2] - a[0], a[3] - a[1]);
  const eq = (u, v) => Math.abs(u - v) <= tol;
  const [ax1, ay1, ax2, ay2] = a;
  const [bx1, by1, bx2, by2] = b;
  const aw = ax2 - ax1, ah = ay2 - ay1, bw = bx2 - bx1, bh = by2 - by1;
  if (a.every((v, i) => eq(v, b[i]))) return "stay";
  if (eq(aw, bw) && eq(ah, bh)) {
    const dx = bx1 - ax1, dy = by1 - ay1;
    if (Math.abs(dx) >= Math.abs(dy)) return dx < 0 ? "left" : "right";
    return dy < 0 ? "up" : "down";
  }
  const wUp = bw > aw + tol, hUp = bh > ah + tol, wDown = bw < aw - tol, hDown = bh < ah - tol;
  if (!wUp && !hUp && (wDown || hDown)) {
    const keepL = eq(ax1, bx1), keepT = eq(ay1, by1), keepR = eq(ax2, bx2), keepB = eq(ay2, by2);
    if (wDown && hDown) {
      if (keepL && keepT) return "shrink_tl";
      if (keepR && keepT) return "shrink_tr";
      if (keepL && keepB) return "shrink_bl";
      if (keepR && keepB) return "shrink_br";
      return "shrink_center";
    }
    if (wDown) return keepL !== keepR ? (keepL ? "shrink_tl" : "shrink_tr") : "narrower";
    return keepT !== keepB ? (keepT ? "shrink_tl" : "shrink_bl") : "shorter";
  }
  if (hUp && !wUp) return "taller";
  if (wUp && !hUp) return "wider";
  return "move";
}

// ---------------------------------------------------------------- API key

function initKey() {
  const input = $("#api-key");
  input.value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("#key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = input.value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key); else sessionStorage.removeItem(KEY_STORAGE);
    say(key ? "API key set for this tab." : "No API key.");
    clearErrors();
    loadBundles();
    loadSets();
  });
  $("#key-clear").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    input.value = "";
    say("API key forgotten.");
  });
}

// ---------------------------------------------------------------- bundles and sets

async function loadBundles() {
  await act("Loading the bundles", null, async () => {
    const res = await api("GET", "/v1/bundles");
    const sel = $("#bundle-select");
    const options = res.data.map((b) => el("option", { value: b.name, text: b.default ? `${b.name} (default)` : b.name }));
    // No bundle sent: the server picks its default, or its photo default for crops that look like photos.
    if (res.default_photo) options.unshift(el("option", { value: "", text: `auto: ${res.default}, or ${res.default_photo} for photos` }));
    sel.replaceChildren(...options);
    if (res.default_photo) sel.value = "";
    else if (res.data.some((b) => b.name === res.default)) sel.value = res.default;
  });
}

async function loadSets(selectId) {
  await act("Loading the exemplar sets", null, async () => {
    const res = await listAll("/v1/exemplar-sets");
    const sel = $("#set-select");
    const keep = selectId ?? sel.value;
    sel.replaceChildren(el("option", { value: "", text: res.data.length ? "— choose a set —" : "— none yet —" }),
      ...res.data.map((s) => el("option", { value: s.id, text: `${s.name || "(unnamed)"} · ${s.bundle} · ${shortId(s.id)}` })));
    if (keep && res.data.some((s) => s.id === keep)) sel.value = keep;
    else if (!keep && res.data.length) sel.value = res.data[0].id;
    await chooseSet(sel.value || null);
  });
}

async function chooseSet(id) {
  if (!id) {
    state.set = null;
    showSet();
    $("#checkpoints tbody").replaceChildren();
    return;
  }
  state.set = await api("GET", `/v1/exemplar-sets/${id}`);
  showSet();
  await loadCheckpoints();
}

function showSet() {
  const s = state.set;
  const info = $("#set-info");
  info.dataset.setId = s ? s.id : "";
  if (!s) { info.replaceChildren(); return; }
  fillInfo(info, [["id", s.id], ["name", s.name || "(unnamed)"], ["bundle", s.bundle],
    ["exemplars", `${s.num_exemplars} (${s.num_labeled} with a box)`], ["active policy", shortId(s.active_checkpoint_id)],
    ["created", new Date(s.created_at).toLocaleString()]]);
}

function initSets() {
  $("#set-select").addEventListener("change", (ev) =>
    act("Opening the set", null, () => chooseSet(ev.target.value || null)));
  $("#sets-refresh").addEventListener("click", () => loadSets());
  $("#set-delete").addEventListener("click", (ev) => act("Deleting the set", ev.target, async () => {
    const s = needSet();
    if (!confirm(`Delete the set ${s.name || s.id} with its jobs and checkpoints?`)) return;
    await api("DELETE", `/v1/exemplar-sets/${s.id}`);
    say(`Deleted set ${shortId(s.id)}.`);
    await loadSets("");
  }));
}

// ---------------------------------------------------------------- new set: crops, or whole images with a drawn box

function drawMode() { return document.querySelector("input[name=mode]:checked").value === "boxes"; }

async function addExemplars(files) {
  for (const file of files) {
    const url = URL.createObjectURL(file);
    let size = null;
    try { size = await imageSize(url); } catch (e) { showError(`${file.name}`, e); }
    state.exemplars.push({ file, url, size, box: null });
  }
  renderExemplars();
}

function svgPoint(svg, ev) {
  const pt = svg.createSVGPoint();
  pt.x = ev.clientX;
  pt.y = ev.clientY;
  return pt.matrixTransform(svg.getScreenCTM().inverse());
}

function renderExemplars() {
  const wrap = $("#exemplar-previews");
  const drawing = drawMode();
  wrap.classList.toggle("drawing", drawing);
  $("#draw-hint").hidden = !drawing;
  wrap.replaceChildren(...state.exemplars.map((item, i) => {
    const [w, h] = item.size || [1, 1];
    const svg = el("svg:svg", { viewBox: `0 0 ${w} ${h}`, "data-index": i });
    svg.append(el("svg:image", { href: item.url, x: 0, y: 0, width: w, height: h, preserveAspectRatio: "none" }));
    const rect = el("svg:rect", { class: "drawn" });
    const caption = el("figcaption", { text: item.file.name, title: item.file.name });
    const boxText = el("figcaption", { class: "box-text" });
    const show = () => {
      if (item.box) { setRect(rect, item.box); rect.style.display = ""; boxText.textContent = `[${item.box.join(", ")}]`; }
      else { rect.style.display = "none"; boxText.textContent = drawing ? "no box yet" : ""; }
      svg.dataset.box = item.box ? JSON.stringify(item.box) : "";
    };
    if (drawing && item.size) {
      svg.append(rect);
      let start = null;
      const clamp = (p) => [Math.min(w, Math.max(0, p.x)), Math.min(h, Math.max(0, p.y))];
      const boxOf = (a, b) => [Math.min(a[0], b[0]), Math.min(a[1], b[1]), Math.max(a[0], b[0]), Math.max(a[1], b[1])]
        .map((v) => Math.round(v));
      svg.addEventListener("pointerdown", (ev) => {
        ev.preventDefault();
        svg.setPointerCapture(ev.pointerId);
        start = clamp(svgPoint(svg, ev));
      });
      svg.addEventListener("pointermove", (ev) => {
        if (!start) return;
        item.box = boxOf(start, clamp(svgPoint(svg, ev)));
        show();
      });
      const end = (ev) => {
        if (!start) return;
        const box = boxOf(start, clamp(svgPoint(svg, ev)));
        start = null;
        item.box = box[2] > box[0] && box[3] > box[1] ? box : null;
        show();
      };
      svg.addEventListener("pointerup", end);
      svg.addEventListener("pointercancel", end);
    }
    show();
    const remove = el("button", { type: "button", text: "remove", onclick: () => {
      URL.revokeObjectURL(item.url);
      state.exemplars.splice(i, 1);
      renderExemplars();
    } });
    return el("figure", { "data-filename": item.file.name }, svg, caption, boxText, remove);
  }));
}

function initCreate() {
  dropZone($("#exemplar-drop"), $("#exemplar-files"), addExemplars);
  for (const r of document.querySelectorAll("input[name=mode]")) r.addEventListener("change", renderExemplars);
  $("#exemplar-clear").addEventListener("click", () => {
    state.exemplars.forEach((x) => URL.revokeObjectURL(x.url));
    state.exemplars = [];
    renderExemplars();
  });
  $("#create-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Creating the exemplar set", $("#create-btn"), async () => {
      if (!state.exemplars.length) throw new ApiError(0, "drop at least one exemplar image first");
      const form = new FormData();
      for (const x of state.exemplars) form.append("files", x.file, x.file.name);
      if (drawMode()) {
        const missing = state.exemplars.filter((x) => !x.box).map((x) => x.file.name);
        if (missing.length) throw new ApiError(0, `draw the object's box on every image (missing: ${missing.join(", ")})`);
        form.append("boxes", JSON.stringify(state.exemplars.map((x) => x.box)));
      }
      const name = $("#set-name").value.trim();
      if (name) form.append("name", name);
      if ($("#bundle-select").value) form.append("bundle", $("#bundle-select").value);
      const created = await api("POST", "/v1/exemplar-sets", { form });
      say(`Created set ${created.name || ""} ${shortId(created.id)} from ${created.num_exemplars} exemplar(s), on bundle ${created.bundle}.`);
      state.exemplars.forEach((x) => URL.revokeObjectURL(x.url));
      state.exemplars = [];
      renderExemplars();
      $("#set-name").value = "";
      await loadSets(created.id);
    });
  });
}

// ---------------------------------------------------------------- localize, with the trajectory played step by step

let localizeFiles = [];

async function localize() {
  const s = needSet();
  if (!localizeFiles.length) throw new ApiError(0, "drop images to search first");
  const form = new FormData();
  for (const f of localizeFiles) form.append("files", f, f.name);
  const trajectory = $("#opt-trajectory").checked;
  const res = await api("POST", `/v1/exemplar-sets/${s.id}/localize`, { form, query: {
    trajectory, samples: $("#opt-samples").value, nearest: $("#opt-nearest").value, checkpoint: $("#opt-checkpoint").value,
    max_instances: $("#opt-instances").value, rerank: $("#opt-rerank").checked,
  } });
  renderResults(res, localizeFiles);
  say(`Localized ${res.results.length} image(s) with policy ${shortId(res.checkpoint_id)}.`);
}

function stopPlayers() { state.players.forEach((p) => p.stop()); state.players = []; }

function renderResults(res, files) {
  stopPlayers();
  const wrap = $("#results");
  wrap.dataset.checkpointId = res.checkpoint_id;
  wrap.replaceChildren(...res.results.map((r, i) => {
    const url = URL.createObjectURL(files[i]);
    const svg = el("svg:svg", { viewBox: `0 0 ${r.width} ${r.height}`, class: "result-svg" });
    svg.append(el("svg:image", { href: url, x: 0, y: 0, width: r.width, height: r.height, preserveAspectRatio: "none" }));
    const [x1, y1, x2, y2] = r.box;
    const final = el("svg:rect", { class: "final-box", "data-x1": x1, "data-y1": y1, "data-x2": x2, "data-y2": y2 });
    setRect(final, r.box);
    final.append(el("svg:title", { text: `answer [${r.box.map((v) => fmt(v, 1)).join(", ")}]` }));
    const numbers = [`score ${fmt(r.score)}`];
    if (r.confidence !== undefined && r.confidence !== null) numbers.push(`confidence ${fmt(r.confidence)}`);
    numbers.push(`box [${r.box.map((v) => fmt(v, 1)).join(", ")}]`, `${r.width}×${r.height}`);
    const fig = el("figure", { class: "result", "data-index": i, "data-filename": r.filename ?? "" }, svg,
      el("figcaption", {}, el("div", { class: "name", text: r.filename || `image ${i + 1}` }),
        el("div", { class: "numbers", text: numbers.join(" · ") })));
    for (const [k, inst] of (r.instances || []).entries()) {  // several objects: each box, best first
      const rect = el("svg:rect", { class: `instance-box${inst.found === false ? " not-found" : ""}`, "data-rank": k });
      setRect(rect, inst.box);
      const conf = inst.confidence === undefined || inst.confidence === null ? "" : ` · confidence ${fmt(inst.confidence)}`;
      rect.append(el("svg:title", { text: `instance ${k + 1}: score ${fmt(inst.score)}${conf}` }));
      svg.append(rect);
    }
    if (r.instances) numbers.push(`${r.instances.length} instance(s)`);
    if (r.trajectory && r.trajectory.length > 1) {
      const step = el("svg:rect", { class: "step-box" });
      svg.append(step);  // under the answer's box
      fig.querySelector("figcaption").append(player(fig, step, r.trajectory));
    }
    svg.append(final);
    return fig;
  }));
}

/** Controls that play an episode: box k of the trajectory, and the action that led to it. */
function player(fig, rect, boxes) {
  const actions = boxes.slice(1).map((b, k) => actionName(boxes[k], b));
  fig.dataset.steps = String(boxes.length - 1);
  fig.dataset.actions = JSON.stringify(actions);
  const slider = el("input", { type: "range", min: 0, max: boxes.length - 1, value: 0, "aria-label": "step" });
  const label = el("span", { class: "action-name" });
  const list = el("ol", { class: "actions" }, ...actions.map((a) => el("li", { text: ACTION_LABELS[a] || a, "data-action": a })));
  const playBtn = el("button", { type: "button", class: "play", text: "▶ play" });
  let timer = null;
  const show = (k) => {
    slider.value = k;
    setRect(rect, boxes[k]);
    rect.dataset.box = JSON.stringify(boxes[k]);
    fig.dataset.step = String(k);
    label.textContent = k === 0 ? "start: whole image" : `step ${k}: ${ACTION_LABELS[actions[k - 1]] || actions[k - 1]}`;
    label.dataset.action = k === 0 ? "" : actions[k - 1];
    [...list.children].forEach((li, j) => li.classList.toggle("current", j === k - 1));
  };
  const stop = () => {
    if (timer) clearInterval(timer);
    timer = null;
    fig.dataset.playing = "false";
    playBtn.textContent = "▶ play";
  };
  const play = () => {
    stop();
    let k = 0;
    show(k);
    fig.dataset.playing = "true";
    playBtn.textContent = "■ stop";
    timer = setInterval(() => {
      k += 1;
      if (k >= boxes.length) { stop(); return; }
      show(k);
    }, STEP_MS);
  };
  playBtn.addEventListener("click", () => (timer ? stop() : play()));
  slider.addEventListener("input", () => { stop(); show(Number(slider.value)); });
  show(boxes.length - 1);
  stop();
  state.players.push({ stop });
  return el("div", {}, el("div", { class: "player" }, playBtn, slider), label, list);
}

function initLocalize() {
  dropZone($("#localize-drop"), $("#localize-files"), (files) => {
    localizeFiles = files;
    if (files.length) act("Localizing", $("#localize-btn"), localize);
  });
  $("#localize-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Localizing", $("#localize-btn"), localize);
  });
}

// ---------------------------------------------------------------- adaptation jobs, polled live

function addAdaptFiles(files) {
  state.adaptFiles = files;
  $("#adapt-previews").replaceChildren(...files.map((f) => el("figure", { title: f.name },
    el("svg:svg", { viewBox: "0 0 1 1" }, el("svg:image", { href: URL.createObjectURL(f), width: 1, height: 1 })))));
}

function showJob(job) {
  state.job = job;
  $("#job").hidden = false;
  $("#job-id").textContent = shortId(job.id);
  $("#job-id").title = job.id;
  const status = $("#job-status");
  status.textContent = job.status + (job.cancel_requested && !TERMINAL.has(job.status) ? " (cancel requested)" : "");
  status.dataset.status = job.status;
  const p = job.progress || {};
  $("#job-progress").max = p.total || 1;
  $("#job-progress").value = p.iteration || 0;
  $("#job-cancel").hidden = TERMINAL.has(job.status);
  const phase = p.phase === "setup" ? " (setting up: reward repair and probes)" : p.phase === "finishing" ? " (finishing)" : "";
  const pairs = [["iteration", `${p.iteration ?? 0} / ${p.total ?? "?"}${phase}`], ["mean reward", fmt(p.mean_reward, 4)],
    ["images", job.params ? job.params.num_images : "—"], ["activate", job.params ? job.params.activate : "—"]];
  if (job.verdict) pairs.push(["verdict", job.verdict]);
  if (job.checkpoint_id) pairs.push(["checkpoint", shortId(job.checkpoint_id)]);
  if (job.error) pairs.push(["error", job.error]);
  if (job.attempts > 1) pairs.push(["attempts", job.attempts]);
  fillInfo($("#job-info"), pairs);
  const v = job.validation;
  const box = $("#job-validation");
  box.replaceChildren();
  if (v) {
    const score = (s) => (s ? `${fmt(s.corloc, 1)}% CorLoc, IoU ${fmt(s.mean_iou, 3)} (n=${s.n})` : "—");
    const rows = [["start", v.base && v.base.select, v.base && v.base.held]];
    if (v.best) rows.push([`best (iteration ${v.best.iteration})`, v.best.select, v.best.held]);
    box.append(el("p", { class: "validation-message", text: v.message || "" }),
      el("table", { class: "scores" },
        el("thead", {}, el("tr", {}, el("th", { text: "policy" }), el("th", { text: "selection probes" }), el("th", { text: "held-out probes" }))),
        el("tbody", {}, ...rows.map(([name, sel, held]) => el("tr", {}, el("td", { text: name }), el("td", { text: score(sel) }), el("td", { text: score(held) }))))),
      el("p", { class: "hint", text: `probes: ${Object.entries(v.probes || {}).map(([k, n]) => `${k} ${n}`).join(", ")}`
        + (v.faithfulness ? ` · reward faithfulness: ${Object.entries(v.faithfulness).map(([k, n]) => `${k} ${fmt(n, 2)}`).join(", ")}` : "")
        + (v.reward ? ` · reward: ${v.reward}` : "")
        + (v.reward_choice && v.reward_choice.chosen ? ` (the policy adapted on: ${v.reward_choice.chosen})` : "")
        + (v.activated_iteration != null ? ` · activated: iteration ${v.activated_iteration}` : "")
        + (v.stopped_early ? " · stopped early" : "") }));
  }
}

function pollJob(id) {
  if (state.pollTimer) clearTimeout(state.pollTimer);
  const tick = async () => {
    state.pollTimer = null;
    let job;
    try {
      job = await api("GET", `/v1/adaptations/${id}`);
    } catch (e) {
      showError("Polling the adaptation job", e);
      if (e.status && e.status !== 503 && e.status !== 502) return;  // a lost connection or a busy server: keep polling
    }
    if (job) {
      if (state.job && state.job.id !== id) return;  // another job was started meanwhile
      showJob(job);
      if (TERMINAL.has(job.status)) {
        say(`Adaptation job ${shortId(id)} ${job.status}${job.verdict ? `: ${job.verdict}` : ""}.`);
        if (state.set && state.set.id === job.exemplar_set_id) await act("Reloading the set", null, () => chooseSet(state.set.id));
        return;
      }
    }
    state.pollTimer = setTimeout(tick, 700);
  };
  state.pollTimer = setTimeout(tick, 300);
}

function initAdapt() {
  dropZone($("#adapt-drop"), $("#adapt-files"), addAdaptFiles);
  $("#adapt-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    act("Starting the adaptation", $("#adapt-btn"), async () => {
      const s = needSet();
      if (!state.adaptFiles.length) throw new ApiError(0, "drop images to adapt on first");
      const form = new FormData();
      for (const f of state.adaptFiles) form.append("files", f, f.name);
      const it = $("#adapt-iterations").value.trim();
      if (it) form.append("iterations", it);
      form.append("activate", $("#adapt-activate").value);
      const job = await api("POST", `/v1/exemplar-sets/${s.id}/adaptations`, { form });
      showJob(job);
      say(`Adaptation job ${shortId(job.id)} queued.`);
      pollJob(job.id);
    });
  });
  $("#job-cancel").addEventListener("click", (ev) => act("Canceling the job", ev.target, async () => {
    if (!state.job) return;
    showJob(await api("POST", `/v1/adaptations/${state.job.id}/cancel`));
    pollJob(state.job.id);
  }));
}

// ---------------------------------------------------------------- checkpoints: lineage, metrics, activate

async function loadCheckpoints() {
  const s = state.set;
  const body = $("#checkpoints tbody");
  if (!s) { body.replaceChildren(); return; }
  const res = await listAll(`/v1/exemplar-sets/${s.id}/checkpoints`);
  const byId = new Map(res.data.map((c) => [c.id, c]));
  const lineage = (c) => {
    const chain = [];
    for (let x = c; x && chain.length < 50; x = x.parent_id ? byId.get(x.parent_id) : null) {
      chain.unshift(x.kind === "base" ? "base" : `${shortId(x.id)}@${x.iteration}`);
    }
    return chain.join(" → ");
  };
  body.replaceChildren(...res.data.map((c) => {
    const metrics = Object.entries(c.metrics || {}).map(([k, v]) => `${k}=${fmt(v, 3)}`).join("  ");
    const btn = el("button", { type: "button", class: "activate", text: c.active ? "active" : "Activate" });
    btn.disabled = c.active;
    btn.addEventListener("click", () => act("Activating the checkpoint", btn, async () => {
      state.set = await api("POST", `/v1/checkpoints/${c.id}/activate`);
      showSet();
      say(`Checkpoint ${c.kind === "base" ? "base" : shortId(c.id)} is now the set's active policy.`);
      await loadCheckpoints();
    }));
    return el("tr", { "data-id": c.id, "data-kind": c.kind, "data-active": String(c.active) },
      el("td", { text: c.active ? "●" : "", title: c.active ? "active" : "" }),
      el("td", { text: c.kind }),
      el("td", { text: String(c.iteration) }),
      el("td", { class: "lineage", text: lineage(c), title: `id ${c.id}${c.job_id ? `, job ${c.job_id}` : ""}` }),
      el("td", { class: "metrics", text: metrics || "—" }),
      el("td", { text: new Date(c.created_at).toLocaleString() }),
      el("td", {}, btn));
  }));
}

function initCheckpoints() {
  $("#checkpoints-refresh").addEventListener("click", (ev) => act("Loading the checkpoints", ev.target, loadCheckpoints));
}

// ---------------------------------------------------------------- start

document.addEventListener("DOMContentLoaded", async () => {
  initKey();
  initSets();
  initCreate();
  initLocalize();
  initAdapt();
  initCheckpoints();
  await Promise.all([loadBundles(), loadSets()]);
  document.body.dataset.ready = "true";
});
