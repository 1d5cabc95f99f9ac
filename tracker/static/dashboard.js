// The swarm dashboard: vanilla JavaScript drawing SVG from /v1/dashboard/events (server-sent events).
// Every string that comes from nodes or gateways is untrusted: it only ever reaches the page through
// textContent or setAttribute, never as HTML.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100) return v.toFixed(0);
  return v.toFixed(digits);
}

function fmtSeconds(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  return s.toFixed(2) + " s";
}

function ago(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(0) + " s";
  if (s < 3600) return (s / 60).toFixed(0) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function short(id) { return id ? id.slice(0, 8) : "–"; }

function coverageColor(n) {
  if (n <= 0) return "var(--c0)";
  if (n === 1) return "var(--c1)";
  if (n === 2) return "var(--c2)";
  if (n === 3) return "var(--c3)";
  return "var(--c4)";
}

function lastKnown(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
}

// ---------------------------------------------------------------- KPIs

function renderKpis(state) {
  const box = document.getElementById("kpis");
  const s = state.series || {};
  const counts = state.node_counts || {};
  const routable = (state.models || []).filter((m) => m.gaps.length === 0).length;
  const models = (state.models || []).length;
  const tps = lastKnown(s.tokens_per_s || []);
  const ttft = lastKnown(s.ttft_p95_s || []);
  const rps = lastKnown(s.requests_per_s || []);
  const tiles = [
    ["Live nodes", fmt(counts.live || 0, 0),
      `${counts.late || 0} late · ${counts.expired || 0} expired · ${counts.left || 0} left`,
      (counts.live || 0) === 0 ? "bad" : counts.late ? "warn" : ""],
    ["Models routable", `${routable}/${models}`, models ? "every layer held by a live node" : "no model yet",
      routable < models ? "bad" : ""],
    ["Tokens / s", fmt(tps === null ? state.now.node_tokens_per_s : tps),
      tps === null ? "positions/s reported by nodes" : `generated; nodes: ${fmt(state.now.node_tokens_per_s)} pos/s`, ""],
    ["Active sessions", fmt(state.now.gateway_sessions || state.now.node_sessions, 0),
      `${state.now.node_sessions} stage sessions on nodes`, ""],
    ["TTFT p95", fmtSeconds(ttft), "time to first token", ttft !== null && ttft > 5 ? "warn" : ""],
    ["Requests / s", fmt(rps), `${(state.gateways || []).filter((g) => g.live).length} gateways reporting`, ""],
  ];
  box.replaceChildren(...tiles.map(([label, value, sub, cls]) =>
    el("div", { class: "kpi " + cls, "data-kpi": label },
      el("div", { class: "label", text: label }),
      el("div", { class: "value", text: value }),
      el("div", { class: "sub", text: sub }))));
}

// ---------------------------------------------------------------- coverage

function laneLayout(spans) {
  // spans: [start, end, id] sorted by start; greedy interval colouring into lanes
  const lanes = [];
  const placed = [];
  for (const [a, b, id] of spans) {
    let lane = lanes.findIndex((end) => end <= a);
    if (lane < 0) { lane = lanes.length; lanes.push(b); } else lanes[lane] = b;
    placed.push({ a, b, id, lane });
  }
  return { placed, lanes: lanes.length };
}

function renderModel(m, names) {
  const card = el("div", { class: "model", "data-model": m.fingerprint });
  // Which fingerprint the name resolves to, and why (registered, trusted nodes, or not at all).
  const res = (names || {})[m.name];
  const mine = res && res.fingerprint === m.fingerprint;
  const ok = m.gaps.length === 0;
  const thin = m.coverage.filter((c) => c === 1).length;
  card.append(el("div", { class: "model-head" },
    el("span", { class: "name", text: m.name }),
    el("span", { class: "fp", text: m.fingerprint.slice(0, 16) }),
    el("span", { class: "muted", text: `${m.n_layers} layers · ${m.live_nodes} live nodes` }),
    el("span", { class: "badge " + (ok ? "ok" : "bad"), "data-routable": ok ? "yes" : "no",
      text: ok ? "routable" : "gap: layers " + m.gaps.map(([a, b]) => `${a}–${b - 1}`).join(", ") }),
    thin && ok ? el("span", { class: "badge warn", text: `${thin} layers on one node only` }) : null,
    res ? el("span", { class: "badge " + (mine ? "ok" : "warn"), "data-name-resolves": mine ? "yes" : "no",
      title: res.reason,
      text: mine ? `name → this model (${res.registered ? "registered" : "trusted nodes"})`
        : res.fingerprint ? `name → ${res.fingerprint.slice(0, 16)}` : "name resolves to nothing" }) : null));

  const W = 1000, cellH = 26, laneH = 16, pad = 2;
  const n = m.n_layers;
  const cw = W / n;
  const { placed, lanes } = laneLayout(m.spans);
  const maxLanes = Math.min(lanes, 14);
  const H = cellH + 14 + maxLanes * (laneH + 3) + 6;
  const root = svg("svg", { class: "coverage", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none",
    "data-layers": n, role: "img", "aria-label": `coverage of ${m.name}` });
  m.coverage.forEach((c, i) => {
    const cell = svg("rect", { x: i * cw + 0.5, y: 0, width: Math.max(0.5, cw - 1), height: cellH, rx: 2,
      fill: coverageColor(c), "data-layer": i, "data-count": c });
    cell.append(svg("title", {}, `layer ${i}: ${c} node${c === 1 ? "" : "s"}`));
    root.append(cell);
    if (cw >= 14 || i % Math.ceil(14 / cw) === 0) {
      root.append(svg("text", { x: i * cw + cw / 2, y: cellH + 11, "text-anchor": "middle" }, String(i)));
    }
  });
  for (const p of placed) {
    if (p.lane >= maxLanes) continue;
    const y = cellH + 16 + p.lane * (laneH + 3);
    const g = svg("g", { "data-span": `${p.a}:${p.b}`, "data-node": p.id });
    g.append(svg("rect", { x: p.a * cw + pad, y, width: Math.max(2, (p.b - p.a) * cw - 2 * pad), height: laneH,
      rx: 4, fill: "var(--accent)", opacity: 0.85 }));
    g.append(svg("title", {}, `${p.id}: layers ${p.a}–${p.b - 1}`));
    if ((p.b - p.a) * cw > 70) {
      g.append(svg("text", { x: p.a * cw + pad + 6, y: y + laneH - 4, class: "lane-label" },
        `${p.id}  [${p.a}, ${p.b})`));
    }
    root.append(g);
  }
  card.append(root);
  const legend = el("div", { class: "legend" },
    ...[[0, "no node"], [1, "1 node"], [2, "2 nodes"], [3, "3"], [4, "4+"]].map(([c, label]) =>
      el("span", {}, el("i", { style: `background:${coverageColor(c)}` }), label)));
  if (lanes > maxLanes) legend.append(el("span", { text: `+${placed.filter((p) => p.lane >= maxLanes).length} more spans not drawn` }));
  card.append(legend);
  return card;
}

function renderModels(state) {
  const box = document.getElementById("models");
  if (!state.models.length) {
    box.replaceChildren(el("div", { class: "empty-note", text: "No model yet: start a node (swarm-node start --tracker …)." }));
    return;
  }
  const names = Object.fromEntries((state.names || []).map((n) => [n.name, n]));
  box.replaceChildren(...state.models.map((m) => renderModel(m, names)));
}

// ---------------------------------------------------------------- charts

function lineChart(id, t, lines, opts = {}) {
  const root = document.getElementById(id);
  const W = Math.max(240, Math.round(root.getBoundingClientRect().width) || 600), H = 150, L = 52, R = 8, T = 10, B = 20;
  root.setAttribute("viewBox", `0 0 ${W} ${H}`);
  root.replaceChildren();
  const all = lines.flatMap((l) => l.values).filter((v) => v !== null && v !== undefined && isFinite(v));
  if (!all.length) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      opts.empty || "no gateway reports yet"));
    return;
  }
  let max = Math.max(...all, opts.minMax || 0);
  if (max <= 0) max = 1;
  if (opts.integer) {
    max = Math.max(3, Math.ceil(max / 3) * 3);  // three grid steps of whole numbers
  } else {
    const nice = Math.pow(10, Math.floor(Math.log10(max)));
    max = Math.ceil(max / nice) * nice;
  }
  const t0 = t[0], t1 = t[t.length - 1];
  const x = (ti) => L + ((ti - t0) / Math.max(1e-9, t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - v / max) * (H - T - B);
  for (let k = 0; k <= 3; k++) {
    const v = (max * k) / 3;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    root.append(svg("text", { x: L - 6, y: y(v) + 3, "text-anchor": "end" }, opts.format ? opts.format(v) : fmt(v)));
  }
  const span = t1 - t0;
  root.append(svg("text", { x: L, y: H - 4 }, `−${Math.round(span / 60)} min`));
  root.append(svg("text", { x: W - R, y: H - 4, "text-anchor": "end" }, "now"));
  for (const line of lines) {
    let d = "";
    let area = "";
    let pen = false;
    let runStart = 0;
    let prevX = 0;
    line.values.forEach((v, i) => {
      if (v === null || v === undefined || !isFinite(v)) {
        if (pen && line.fill) area += `L${prevX},${y(0)}L${runStart},${y(0)}Z`;
        pen = false;
        return;
      }
      const px = x(t[i]).toFixed(1), py = y(v).toFixed(1);
      d += (pen ? "L" : "M") + px + "," + py;
      if (line.fill) area += (pen ? "L" : `M${px},${y(0)}L`) + px + "," + py;
      if (!pen) runStart = px;
      prevX = px;
      pen = true;
    });
    if (pen && line.fill) area += `L${prevX},${y(0)}L${runStart},${y(0)}Z`;
    if (area) root.append(svg("path", { d: area, fill: line.color, opacity: 0.1 }));
    root.append(svg("path", { d, fill: "none", stroke: line.color, "stroke-width": 2, "stroke-linejoin": "round",
      "data-series": line.name }));
    // dots where a single sample has no neighbour, so isolated points stay visible
    line.values.forEach((v, i) => {
      const prev = line.values[i - 1], next = line.values[i + 1];
      if (v !== null && v !== undefined && (prev === null || prev === undefined) && (next === null || next === undefined)) {
        root.append(svg("circle", { cx: x(t[i]), cy: y(v), r: 2.5, fill: line.color }));
      }
    });
  }
}

function renderCharts(state) {
  const s = state.series;
  lineChart("chart-tokens", s.t, [
    { name: "generated", values: s.tokens_per_s, color: "var(--accent)", fill: true },
    { name: "prompt", values: s.prompt_tokens_per_s, color: "var(--accent-2)" },
  ]);
  lineChart("chart-sessions", s.t, [{ name: "sessions", values: s.sessions, color: "var(--ok)", fill: true }],
    { format: (v) => v.toFixed(0), integer: true });
  lineChart("chart-ttft", s.t, [
    { name: "p50", values: s.ttft_p50_s, color: "var(--accent)" },
    { name: "p95", values: s.ttft_p95_s, color: "var(--warn)" },
  ], { format: fmtSeconds, empty: "no first tokens yet" });
}

// ---------------------------------------------------------------- routes, nodes, ledger

function renderRoutes(state) {
  const box = document.getElementById("routes");
  if (!state.routes.length) {
    box.replaceChildren(el("div", { class: "empty-note", text: "No traffic in the last minute." }));
    return;
  }
  const best = Math.max(...state.routes.map((r) => r.tokens_per_s), 1e-9);
  box.replaceChildren(...state.routes.map((r) => {
    const hops = el("div", { class: "hops" });
    r.hops.forEach((h, i) => {
      if (i) hops.append(el("span", { class: "arrow", text: "→" }));
      hops.append(el("span", { class: "hop" }, h.node, h.start !== null ? el("small", { text: `${h.start}–${h.end - 1}` }) : null));
    });
    const pct = Math.round((100 * r.tokens_per_s) / best);
    return el("div", { class: "route", "data-route": r.route_id }, hops,
      el("div", { class: "figures" },
        el("span", {}, el("b", { text: String(r.sessions) }), " sessions"),
        el("span", {}, el("span", { class: "bar" }, el("span", { style: `width:${pct}%` })),
          el("b", { text: fmt(r.tokens_per_s) }), " tok/s"),
        el("span", {}, el("b", { text: String(r.requests) }), " req/min")));
  }));
}

function loadBar(active, max) {
  const frac = max ? Math.min(1, active / max) : 0;
  const cls = frac >= 1 ? "bar full" : frac >= 0.75 ? "bar hot" : "bar";
  return el("span", {}, el("span", { class: cls }, el("span", { style: `width:${Math.round(frac * 100)}%` })),
    `${active ?? "–"}/${max ?? "–"}`);
}

function renderNodes(state) {
  const c = state.node_counts;
  document.getElementById("node-counts").textContent =
    `${c.live} live · ${c.late} late · ${c.expired} expired · ${c.left} left` +
    (state.nodes_truncated ? ` (first ${state.nodes.length} shown)` : "");
  const body = document.querySelector("#nodes tbody");
  const models = Object.fromEntries(state.models.map((m) => [m.fingerprint, m.name]));
  body.replaceChildren(...state.nodes.map((n) => {
    const hw = n.hardware;
    const hwText = `${hw.cpu_cores ?? "?"} cores · ${hw.ram_gb} GB` + (hw.gpus.length ? " · " + hw.gpus.join(", ") : "") +
      (hw.backends.length ? ` · ${hw.backends.join("/")}` : "");
    const where = n.relay ? "via gateway relay" : n.address;
    const known = (v) => v !== null && v !== undefined;
    // used / pool size (free), from the node's heartbeat; without a pool size: used / used + free.
    const kv = known(n.kv_pool_tokens)
      ? `${known(n.kv_used_tokens) ? fmt(n.kv_used_tokens, 0) : "?"} / ${fmt(n.kv_pool_tokens, 0)}` +
        (known(n.kv_free_tokens) ? ` (${fmt(n.kv_free_tokens, 0)} free)` : "")
      : known(n.kv_used_tokens)
        ? `${fmt(n.kv_used_tokens, 0)} / ${fmt(n.kv_used_tokens + (n.kv_free_tokens || 0), 0)}`
        : known(n.kv_free_tokens) ? `${fmt(n.kv_free_tokens, 0)} free` : "–";
    // Since the node started: sessions it preempted for room, steps it refused for want of KV.
    const pressure = (n.kv_preemptions ? ` · ${fmt(n.kv_preemptions, 0)} preempted` : "") +
      (n.kv_refusals ? ` · ${fmt(n.kv_refusals, 0)} refused` : "");
    const kvTitle = [
      known(n.kv_session_max_tokens) ? `one session: at most ${n.kv_session_max_tokens} positions` : "",
      known(n.kv_preemptions) || known(n.kv_refusals)
        ? `since start: ${n.kv_preemptions ?? "?"} sessions preempted, ` +
          `${n.kv_refusals ?? "?"} steps refused for want of KV`
        : "",
    ].filter(Boolean).join("; ");
    const dim = n.state === "expired" || n.state === "left";
    return el("tr", { class: dim ? "dim" : "", "data-node": n.node_id, "data-state": n.state },
      el("td", {}, el("span", { class: "state" }, el("span", { class: "dot " + n.state }), n.state)),
      el("td", { class: "mono", title: n.node_id, text: short(n.node_id) }),
      el("td", {}, n.region ? el("span", { text: n.region + " · " }) : null, el("span", { class: "mono", text: where })),
      el("td", { class: "mono", title: models[n.model] || "" ,
        text: n.start !== null ? `[${n.start}, ${n.end})` : "–" }),
      el("td", { class: "muted", text: hwText }),
      el("td", { class: "num", text: fmt(n.decode_ms_per_token) }),
      el("td", { class: "num", text: fmt(n.tokens_per_s) }),
      el("td", {}, loadBar(n.active_sessions, n.max_sessions)),
      el("td", { class: "num", text: n.queue_depth ?? "–" }),
      el("td", { class: "num", text: kv + pressure, title: kvTitle }),
      el("td", { class: "muted", text: n.version || "–" }),
      el("td", { class: "num", text: ago(n.last_seen_age_s) }));
  }));
}

function renderContributors(state) {
  const box = document.getElementById("contributors");
  const rows = state.top_contributors_24h;
  if (!rows.length) {
    box.replaceChildren(el("div", { class: "empty-note", text: "The ledger has no entries in the last 24 hours." }));
    return;
  }
  const best = Math.max(...rows.map((r) => r.tokens), 1);
  const table = el("table", {}, el("thead", {}, el("tr", {},
    el("th", { text: "node" }), el("th", { text: "tokens" }), el("th", { class: "num", text: "requests" }))));
  const tbody = el("tbody");
  for (const r of rows) {
    tbody.append(el("tr", { "data-contributor": r.key },
      el("td", { class: "mono", title: r.key, text: short(r.key) }),
      el("td", {}, el("span", { class: "bar" }, el("span", { style: `width:${Math.round((100 * r.tokens) / best)}%` })),
        fmt(r.tokens, 0)),
      el("td", { class: "num", text: String(r.requests) })));
  }
  table.append(tbody);
  box.replaceChildren(el("div", { class: "table-wrap" }, table));
}

function renderGateways(state) {
  const box = document.getElementById("gateways");
  if (!state.gateways.length) {
    box.replaceChildren(el("div", { class: "empty-note", text: "No gateway has reported in the plotted window." }));
    return;
  }
  const table = el("table", {}, el("thead", {}, el("tr", {},
    el("th", { text: "gateway" }), el("th", { text: "url" }), el("th", { class: "num", text: "sessions" }),
    el("th", { class: "num", text: "queued" }), el("th", { class: "num", text: "last report" }))));
  const tbody = el("tbody");
  for (const g of state.gateways) {
    const link = /^https?:\/\//.test(g.url) ? el("a", { href: g.url, text: g.url, rel: "noopener" }) : el("span", { class: "muted", text: g.url || "–" });
    tbody.append(el("tr", { class: g.live ? "" : "dim" },
      el("td", { class: "mono", title: g.gateway_id, text: short(g.gateway_id) }),
      el("td", {}, link),
      el("td", { class: "num", text: String(g.sessions_active) }),
      el("td", { class: "num", text: String(g.requests_queued) }),
      el("td", { class: "num", text: ago(state.time - g.at_s) })));
  }
  table.append(tbody);
  box.replaceChildren(el("div", { class: "table-wrap" }, table));
}

// ---------------------------------------------------------------- wiring

let lastState = null;

function render(state) {
  if (state.error) {
    let banner = document.getElementById("error-banner");
    if (!banner) {
      banner = el("div", { id: "error-banner", class: "error-banner" });
      document.querySelector("main").prepend(banner);
    }
    banner.textContent = `The tracker cannot read its database right now (${state.error.message}); showing the last picture.`;
    return;
  }
  document.getElementById("error-banner")?.remove();
  lastState = state;
  document.getElementById("tracker-id").textContent = "tracker " + short(state.tracker_id);
  document.getElementById("replicas").textContent =
    `${state.replicas.length} replica${state.replicas.length === 1 ? "" : "s"}`;
  renderKpis(state);
  renderModels(state);
  renderCharts(state);
  renderRoutes(state);
  renderNodes(state);
  renderContributors(state);
  renderGateways(state);
  document.getElementById("updated").textContent = "updated " + new Date(state.time * 1000).toLocaleTimeString();
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

function setConnected(on) {
  document.getElementById("conn-dot").className = "dot " + (on ? "on" : "off");
  document.getElementById("conn-text").textContent = on ? "live" : "reconnecting…";
}

function connect() {
  const source = new EventSource("/v1/dashboard/events");
  source.addEventListener("open", () => setConnected(true));
  source.addEventListener("error", () => setConnected(false));
  source.addEventListener("state", (ev) => {
    setConnected(true);
    try { render(JSON.parse(ev.data)); } catch (err) { console.error("bad dashboard state", err); }
  });
}

fetch("/v1/dashboard/state").then((r) => r.json()).then((s) => { if (!lastState) render(s); }).catch(() => {});
connect();
