// tollgate dashboard: polls /v1/status and /v1/status/history every second and draws
// them. The key comes from the URL fragment (#key=…, never sent to the server) or the
// form, and is kept for this tab only.
"use strict";

const POLL_MS = 1000;
const COLORS = ["#2f81f7", "#e5534b", "#57ab5a", "#c69026", "#8250df", "#39c5cf", "#d16ba5", "#6b7480"];

function key() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) sessionStorage.setItem("tollgate-key", decodeURIComponent(m[1]));
  return sessionStorage.getItem("tollgate-key");
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + key() } });
  const body = await r.json().catch(() => null);
  if (!r.ok) throw new Error((body && body.error && body.error.message) || r.statusText);
  return body;
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fill(id, rows, empty, columns) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colspan: columns }, empty))]));
}

const fmt = (n) => (Math.abs(n) >= 1000 ? Math.round(n).toLocaleString("en") : (+n.toFixed(2)).toString());
const usd = (n) => "$" + (n >= 1 ? n.toFixed(2) : (+n.toPrecision(2)).toString());
const age = (s) => (s >= 3600 ? (s / 3600).toFixed(1) + " h" : s >= 60 ? (s / 60).toFixed(1) + " min" : s.toFixed(1) + " s");

// A line chart: series = [{name, points: [[ms, value], …]}], drawn into an SVG.
function chart(id, series, unit) {
  const svg = document.getElementById(id);
  const box = svg.viewBox.baseVal;
  const W = box.width || 800, H = box.height || 220, L = 50, R = W > 600 ? 170 : 110, T = 10, B = 25;
  const all = series.flatMap((s) => s.points);
  const now = Date.now();
  const t0 = all.length ? Math.min(...all.map((p) => p[0])) : now - 60000;
  const t1 = Math.max(now, t0 + 1000);
  const vmax = Math.max(1, ...all.map((p) => p[1]));
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => H - B - (v / vmax) * (H - T - B);
  const ns = "http://www.w3.org/2000/svg";
  const svgEl = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const parts = [
    svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    svgEl("text", { x: L - 4, y: T + 10, "text-anchor": "end" }, fmt(vmax)),
    svgEl("text", { x: L - 4, y: H - B, "text-anchor": "end" }, "0"),
    svgEl("text", { x: L, y: H - 5 }, age((now - t0) / 1000) + " ago"),
    svgEl("text", { x: W - R, y: H - 5, "text-anchor": "end" }, "now"),
    svgEl("text", { x: L + 4, y: T + 10 }, unit),
  ];
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ");
    parts.push(svgEl("polyline", { points: pts, fill: "none", stroke: color, "stroke-width": 2, "data-series": s.name }));
    const last = s.points.length ? s.points[s.points.length - 1][1] : 0;
    parts.push(svgEl("text", { x: W - R + 8, y: T + 14 + i * 16, fill: color, style: "fill:" + color }, s.name + " " + fmt(last)));
  });
  if (!series.length) parts.push(svgEl("text", { x: W / 2 - R / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
  svg.replaceChildren(...parts);
}

function drawStatus(s) {
  const scope = document.getElementById("scope");
  scope.textContent = s.scope === "all" ? "all tenants (admin)" : "tenant " + s.scope;
  scope.dataset.scope = s.scope;
  document.getElementById("updated").textContent = "updated " + new Date(s.generated_at).toLocaleTimeString("en-GB");
  for (const [id, v] of [
    ["jobs-per-sec", s.rates.jobs_per_sec],
    ["tokens-per-sec", s.rates.tokens_per_sec],
    ["provider-429s", s.rates.provider_429s],
    ["provider-5xxs", s.rates.provider_5xxs],
  ]) {
    const e = document.getElementById(id);
    e.textContent = fmt(v);
    e.dataset.value = v;
  }
  fill("buckets", s.buckets.map((b) => {
    const use = b.capacity > 0 ? b.used / b.capacity : 0;
    // Budgets are kept in micro-USD; people read dollars.
    const money = b.dimension === "spend_micro_usd";
    const amount = (v) => money ? usd(v / 1e6) : fmt(v);
    return el("tr", { "data-bucket": b.bucket, "data-capacity": b.capacity, "data-used": b.used, "data-source": b.source },
      el("td", {}, b.bucket), el("td", {}, money ? "spend (USD)" : b.dimension),
      el("td", {}, el("div", { class: "bar", title: (use * 100).toFixed(0) + "%" }, el("div", { class: use > 0.9 ? "hot" : "", style: "width:" + Math.min(100, use * 100).toFixed(1) + "%" }))),
      el("td", { class: "num" }, amount(b.used)), el("td", { class: "num" }, amount(b.capacity)),
      el("td", { class: b.source === "configured" ? "" : "learned" }, b.source));
  }), "no buckets", 6);
  fill("queues", s.queues.map((q) => el("tr", { "data-queue": q.tenant + "/" + q.class, "data-queued": q.queued, "data-admitted": q.admitted, "data-running": q.running },
    el("td", {}, q.tenant), el("td", {}, q.class), el("td", { class: "num" }, q.queued), el("td", { class: "num" }, q.admitted),
    el("td", { class: "num" }, q.running), el("td", { class: "num" }, age(q.oldest_queued_secs)))), "nothing waiting", 6);
  const oldest = {};
  for (const q of s.queues) if (q.queued > 0) oldest[q.class] = Math.max(oldest[q.class] || 0, q.oldest_queued_secs);
  fill("oldest", Object.entries(oldest).map(([c, a]) => el("tr", { "data-class": c, "data-age": a }, el("td", {}, c), el("td", { class: "num" }, age(a)))), "nothing queued", 2);
  fill("failures", s.recent_failures.map((f) => el("tr", { "data-job": f.id, "data-code": f.code || "" },
    el("td", {}, f.finished_at ? new Date(f.finished_at).toLocaleTimeString("en-GB") : ""), el("td", {}, f.tenant), el("td", {}, f.model),
    el("td", {}, f.code || ""), el("td", { class: "msg" }, f.message || ""), el("td", {}, f.id))), "no failures", 6);
  const batchRows = s.batches.map((b) => {
    const progress = b.completed + b.failed + " / " + b.total + (b.failed ? " (" + b.failed + " failed)" : "");
    return el("tr", { "data-batch": b.id },
      el("td", {}, b.id), el("td", {}, b.tenant), el("td", {}, b.state), el("td", {}, progress));
  });
  fill("batches", batchRows, "no batches in progress", 4);
}

function drawHistory(h) {
  const t = (s) => Date.parse(s.at);
  const names = [...new Set(h.samples.flatMap((s) => Object.keys(s.queued)))].sort();
  chart("chart-queues", names.map((n) => ({ name: n, points: h.samples.map((s) => [t(s), s.queued[n] || 0]) })), "queued jobs");
  const sum = (s, f) => Object.values(s.traffic).reduce((a, x) => a + x[f], 0);
  // Each sample's traffic covers the time since the one before it.
  const per = (s) => s.interval_secs || h.interval_secs;
  chart("chart-throughput", [
    { name: "jobs/s", points: h.samples.map((s) => [t(s), sum(s, "succeeded") / per(s)]) },
  ], "jobs/s");
  chart("chart-tokens", [
    { name: "tokens/s", points: h.samples.map((s) => [t(s), sum(s, "tokens") / per(s)]) },
  ], "tokens/s");
  chart("chart-errors", [
    { name: "429/min", points: h.samples.map((s) => [t(s), (sum(s, "status_429") * 60) / per(s)]) },
    { name: "5xx/min", points: h.samples.map((s) => [t(s), (sum(s, "status_5xx") * 60) / per(s)]) },
  ], "per minute");
}

async function tick() {
  if (!key()) {
    document.getElementById("login").hidden = false;
    return;
  }
  try {
    const [status, history] = await Promise.all([api("/v1/status"), api("/v1/status/history")]);
    drawStatus(status);
    drawHistory(history);
    document.getElementById("error").textContent = "";
    document.getElementById("status").dataset.ready = "1";
  } catch (e) {
    document.getElementById("error").textContent = e.message;
  }
}

document.getElementById("login").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("tollgate-key", document.getElementById("key").value);
  document.getElementById("login").hidden = true;
  tick();
});
tick();
setInterval(tick, POLL_MS);
