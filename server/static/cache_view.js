// The radix cache, live: polls ./summary (GET /cache) and ./tree (GET /cache/tree) and draws them.
// Plain DOM + SVG, no library. Cached text comes from users' prompts, so it is only ever inserted
// as text (textContent / setAttribute), never as markup.
"use strict";

const REFRESH_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const ROW = 30; // tree: pixels per depth level
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text) {
  const node = tag === "svg" || ["rect", "text", "polyline", "line", "g", "title"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
const pct = (r) => (r === null || r === undefined ? "–" : (100 * r).toFixed(1) + "%");
function ago(t) {
  if (!t) return "–";
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 60 ? s.toFixed(0) + " s ago" : s < 3600 ? (s / 60).toFixed(0) + " min ago" : (s / 3600).toFixed(1) + " h ago";
}

// ------------------------------------------------------------------ figures
function renderFigures(s) {
  const hr = s.hit_rate;
  const cards = [
    ["cached tokens", fmt(s.cached_tokens)], ["locked", fmt(s.locked_tokens)], ["evictable", fmt(s.evictable_tokens)],
    ["free", fmt(s.free_tokens)], ["KV pool", fmt(s.pool_tokens)], ["nodes", fmt(s.nodes)],
    ["hit rate 1 min", pct(hr["1m"].hit_rate)], ["5 min", pct(hr["5m"].hit_rate)], ["15 min", pct(hr["15m"].hit_rate)],
    ["since start", pct(hr.all.hit_rate)], ["running / waiting", `${s.num_running} / ${s.num_waiting}`],
    ["evicted tokens", fmt(s.evictions.tokens)],
  ];
  $("figures").replaceChildren(...cards.map(([label, value]) => {
    const card = el("div", { class: "card" });
    card.append(el("div", { class: "v" }, value), el("div", { class: "l" }, label));
    return card;
  }));
}

// ------------------------------------------------------------------ charts (the last minutes)
function chart(svg, points, lines, unitMax) {
  const W = 320, H = 120, L = 34, B = 16, T = 6;
  const t1 = points.length ? points[points.length - 1].t : 0, t0 = Math.min(points.length ? points[0].t : 0, t1 - 300);
  let max = unitMax || 0;
  for (const p of points) for (const [key] of lines) if (p[key] !== null) max = Math.max(max, p[key]);
  max = max || 1;
  const x = (t) => L + ((t - t0) / Math.max(t1 - t0, 1)) * (W - L - 4);
  const y = (v) => T + (1 - v / max) * (H - T - B);
  const kids = [el("line", { class: "grid", x1: L, x2: W, y1: y(0), y2: y(0) }),
    el("line", { class: "grid", x1: L, x2: W, y1: y(max), y2: y(max) }),
    el("text", { class: "axis", x: 2, y: y(max) + 3 }, max >= 100 ? max.toFixed(0) : max.toPrecision(2)),
    el("text", { class: "axis", x: 2, y: y(0) + 3 }, "0"),
    el("text", { class: "axis", x: L, y: H - 3 }, `-${Math.round((t1 - t0) / 60)} min`),
    el("text", { class: "axis", x: W - 22, y: H - 3 }, "now")];
  for (const [key, color] of lines) {
    let run = [];
    const flush = () => {
      if (run.length) kids.push(el("polyline", { points: run.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
      run = [];
    };
    for (const p of points) {
      if (p[key] === null) flush(); else run.push(`${x(p.t).toFixed(1)},${y(p[key]).toFixed(1)}`);
    }
    if (run.length === 1) run.push(run[0].replace(/^[\d.]+/, (v) => (Number(v) + 2).toFixed(1))); // a lone point shows
    flush();
  }
  svg.replaceChildren(...kids);
}

function renderCharts(series) {
  const pts = series.points;
  chart($("chart-ttft"), pts.map((p) => ({ t: p.t, v: p.ttft_avg === null ? null : 1000 * p.ttft_avg })), [["v", "#1f4e8c"]]);
  chart($("chart-hit"), pts.map((p) => ({ t: p.t, v: p.hit_rate === null ? null : 100 * p.hit_rate })), [["v", "#15803d"]], 100);
  chart($("chart-load"), pts, [["running", "#1f4e8c"], ["waiting", "#c2410c"]]);
}

// ------------------------------------------------------------------ the tree (an icicle: depth down, tokens across)
function hitColor(hits, maxHits) {
  const f = maxHits > 0 ? Math.log1p(hits) / Math.log1p(maxHits) : 0;
  return `hsl(213, 64%, ${(92 - 58 * f).toFixed(0)}%)`;
}

function renderTree(tree) {
  const svg = $("tree");
  const byId = new Map(), kids = new Map();
  for (const n of tree.nodes) {
    byId.set(n.id, n);
    if (!kids.has(n.parent)) kids.set(n.parent, []);
    kids.get(n.parent).push(n);
  }
  const top = kids.get(tree.root) || [];
  const total = top.reduce((a, n) => a + n.subtree_tokens, 0) + tree.root_hidden_tokens;
  const depth = tree.nodes.reduce((a, n) => Math.max(a, n.depth), 0);
  const hiddenDepth = tree.nodes.reduce((a, n) => Math.max(a, n.hidden_tokens ? n.depth + 1 : 0), 0);
  const W = Math.max(svg.clientWidth || 1000, 300), H = Math.max(depth, hiddenDepth, 1) * ROW + 2;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  const maxHits = tree.nodes.reduce((a, n) => Math.max(a, n.hits), 0);
  const shapes = [];
  // children (at `level`) share their parent's width by subtree tokens; what was left out is grey
  const place = (children, hiddenTokens, x0, width, tokens, level) => {
    let x = x0;
    for (const n of children) {
      const w = tokens ? (width * n.subtree_tokens) / tokens : 0;
      draw(n, x, w);
      x += w;
    }
    if (hiddenTokens && tokens) {
      const w = (width * hiddenTokens) / tokens;
      const y = (level - 1) * ROW;
      if (w >= 1) shapes.push(el("rect", { class: "hidden-rest", x, y, width: w, height: ROW - 2 }));
    }
  };
  const draw = (n, x, w) => {
    const y = (n.depth - 1) * ROW;
    const rect = el("rect", {
      class: "node" + (n.locked ? " locked" : ""), x, y, width: Math.max(w, 0.5), height: ROW - 2,
      fill: n.locked ? "#e8833a" : hitColor(n.hits, maxHits),
      "data-id": n.id, "data-hits": n.hits, "data-tokens": n.edge_tokens, "data-prefix-tokens": n.prefix_tokens,
      "data-locked": n.locked, "data-text": n.text,
    });
    rect.addEventListener("mousemove", (ev) => showTip(ev, n));
    rect.addEventListener("mouseleave", hideTip);
    shapes.push(rect);
    if (w > 60) {
      const label = `${fmt(n.edge_tokens)} tok · ${fmt(n.hits)} hits`;
      const dark = !n.locked && maxHits > 0 && Math.log1p(n.hits) / Math.log1p(maxHits) > 0.55;
      shapes.push(el("text", { x: x + 4, y: y + 18, fill: dark ? "#fff" : "#1d232a" }, label.length * 6 < w ? label : fmt(n.edge_tokens)));
    }
    place(kids.get(n.id) || [], n.hidden_tokens, x, w, n.subtree_tokens - n.edge_tokens, n.depth + 1);
  };
  place(top, tree.root_hidden_tokens, 0, W, total, 1);
  svg.replaceChildren(...shapes);
  const shown = tree.nodes.length;
  $("tree-note").textContent = shown
    ? `${fmt(shown)} of ${fmt(tree.nodes_total)} nodes shown (${fmt(tree.cached_tokens)} cached tokens)` +
      (tree.truncated ? "; the tree is larger than one walk: the coldest part is left out" : "")
    : "The cache is empty.";
}

function showTip(ev, n) {
  const tip = $("tip");
  const head = el("div");
  head.append(el("b", {}, `${fmt(n.edge_tokens)} tokens`),
    document.createTextNode(` (prefix ${fmt(n.prefix_tokens)}, subtree ${fmt(n.subtree_tokens)}) · ${fmt(n.hits)} hits · ` +
      `${n.locked ? "locked by a running request" : "evictable"} · last used ${ago(n.last_used)}`));
  tip.replaceChildren(head, el("pre", {}, n.text + (n.edge_tokens > 48 ? " …" : "")));
  tip.hidden = false;
  const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
  const y = ev.clientY + 16 + tip.offsetHeight > window.innerHeight ? ev.clientY - tip.offsetHeight - 10 : ev.clientY + 16;
  tip.style.left = `${Math.max(x, 4)}px`;
  tip.style.top = `${Math.max(y, 4)}px`;
}
function hideTip() { $("tip").hidden = true; }

// ------------------------------------------------------------------ tables
function renderTop(prefixes) {
  if (!prefixes.length) {
    const td = el("td", { colspan: 6, class: "muted" }, "No cached prefix has been reused yet.");
    $("top").tBodies[0].replaceChildren(el("tr", {}, undefined));
    $("top").tBodies[0].firstChild.append(td);
    return;
  }
  $("top").tBodies[0].replaceChildren(...prefixes.map((p) => {
    const tr = el("tr", { "data-id": p.id });
    const text = p.text + (p.tail ? (p.prefix_tokens > 72 ? " … " : "") + p.tail : "");
    tr.append(el("td", { class: "text" }, text), el("td", {}, fmt(p.prefix_tokens)),
      el("td", {}, fmt(p.hits)), el("td", {}, fmt(p.tokens_saved)), el("td", {}, ago(p.last_used)),
      el("td", {}, p.locked ? "locked" : "evictable"));
    return tr;
  }));
}

function renderEvictions(ev, snapshot) {
  $("evictions").tBodies[0].replaceChildren(...Object.entries(ev.by_reason).map(([reason, c]) => {
    const tr = el("tr");
    tr.append(el("td", {}, reason), el("td", {}, fmt(c.events)), el("td", {}, fmt(c.nodes)), el("td", {}, fmt(c.tokens)));
    return tr;
  }));
  const rows = [["file", snapshot.configured ? "configured" : "none (--cache-snapshot)"], ["budget", `${fmt(snapshot.max_tokens)} tokens`]];
  for (const what of ["last_save", "last_load"]) {
    const r = snapshot[what];
    if (r) rows.push([what.replace("_", " "), r.ok ? `${fmt(r.tokens)} tokens, ${r.seconds ?? 0} s, ${ago(r.time)}` : `failed: ${r.message}`]);
  }
  $("snapshot").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

// ------------------------------------------------------------------ the loop
async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store", credentials: "same-origin" });
  if (!r.ok) throw new Error(r.status === 401 ? "the API key is needed (reload the page to sign in)" : `${url}: HTTP ${r.status}`);
  return r.json();
}

async function refresh() {
  const depth = $("depth").value || 8, minTokens = $("min-tokens").value || 0;
  try {
    const [summary, tree] = await Promise.all([getJSON("summary"), getJSON(`tree?depth=${depth}&min_tokens=${minTokens}`)]);
    renderFigures(summary);
    renderCharts(summary.series);
    renderTree(tree);
    renderTop(summary.top_prefixes);
    renderEvictions(summary.evictions, summary.snapshot);
    $("status").textContent = `updated ${new Date().toLocaleTimeString()}`;
    $("status").className = "muted";
    document.body.dataset.ready = "1";
  } catch (e) {
    $("status").textContent = String(e.message || e);
    $("status").className = "error";
  }
}

async function loop() {
  if ($("live").checked && !document.hidden) await refresh();
  setTimeout(loop, REFRESH_MS);
}

$("controls").addEventListener("change", refresh);
$("controls").addEventListener("submit", (ev) => { ev.preventDefault(); refresh(); });
loop();
