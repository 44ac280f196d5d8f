// tollgate console (served as /dashboard/app.js): a hash-routed page over the public API,
// no framework and no build step. This file owns the key (from the fragment #key=…, never
// sent to the server as part of a URL, or from the form; kept in sessionStorage and sent as
// `Authorization: Bearer`), the router, and every page: the overview (/v1/status each
// second; /v1/status/history polled incrementally into a one-hour ring, drawn with the
// vendored uPlot), jobs and a job, batches and a batch, and for the admin key tenants, keys,
// pauses & providers. Every action is confirmed in <dialog id="confirm"> first.
"use strict";

const POLL_MS = 1000; // the overview
const REFRESH_MS = 2000; // a job or a batch that is not finished
const ADMIN_REFRESH_MS = 5000; // pauses and provider keys
const HOUR_MS = 3600e3; // history kept
const WINDOW_MS = 60e3; // the rates' trailing window, as /v1/status counts "last minute"
const KEY = "tollgate-key";
const COLORS = ["#2f81f7", "#e5534b", "#57ab5a", "#c69026", "#8250df", "#39c5cf", "#d16ba5", "#6b7480"];
const JOB_STATES = ["queued", "admitted", "running", "succeeded", "failed", "cancelled"];
const JOB_OPEN = ["queued", "admitted", "running"];
const CLASSES = ["interactive", "standard", "background", "batch"];
const LANES = ["online", "provider_batch"];
const JOB_FILTERS = ["tenant", "state", "class", "model", "endpoint", "lane", "batch", "reason", "created_after", "created_before", "q"];
const BATCH_DONE = ["completed", "failed", "expired", "cancelled"];
const ADMIN_PAGES = ["tenants", "keys", "pauses"];

const $ = (css, root = document) => root.querySelector(css);
const enc = encodeURIComponent;

// ---------------------------------------------------------------- key, API, errors

const key = () => sessionStorage.getItem(KEY);

function setKey(k) {
  if (k) sessionStorage.setItem(KEY, k); else sessionStorage.removeItem(KEY);
  scopePromise = null;
  ring.length = 0; // another key may see other tenants: start the history again
}

/** `#key=<key>` → sessionStorage, and the fragment becomes `#/` so routing can use it. */
function takeKeyFromFragment() {
  const m = location.hash.match(/^#key=([^&]*)/);
  if (!m) return false;
  setKey(decodeURIComponent(m[1]));
  history.replaceState(null, "", location.pathname + location.search + "#/");
  return true;
}

/** Calls the API with the key; throws an Error with the API's `message`, `code` and status. */
async function api(path, { method = "GET", body, raw = false } = {}) {
  const headers = { Authorization: "Bearer " + key() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!r.ok) {
    const b = await r.json().catch(() => null);
    const err = (b && b.error) || {};
    const e = new Error(err.message || r.status + " " + r.statusText);
    e.code = err.code || "http_" + r.status;
    e.status = r.status;
    throw e;
  }
  return raw ? r : r.json();
}

function showError(e) {
  const box = $("#error");
  box.textContent = e ? e.message + (e.code ? " (" + e.code + ")" : "") : "";
  box.dataset.code = (e && e.code) || "";
  if (e && e.status === 401) $("#login").hidden = false;
}

// ---------------------------------------------------------------- DOM helpers

/** Builds an element: attributes (null/false left out, `on…` functions as listeners), children. */
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "class") e.className = v;
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

/** A table in a box that scrolls sideways; a heading starting with "#" is a numeric column. */
function table(id, heads) {
  return el("div", { class: "scroll" },
    el("table", { id },
      el("thead", {}, el("tr", {}, heads.map((h) => el("th", { class: h.startsWith("#") ? "num" : null }, h.replace(/^#/, ""))))),
      el("tbody")));
}

/** Replaces a table's rows (or shows `empty` across all its columns). */
function fill(t, rows, empty) {
  const tab = typeof t === "string" ? document.getElementById(t) : t;
  if (!tab) return;
  const cols = tab.tHead ? tab.tHead.rows[0].cells.length : 1;
  tab.tBodies[0].replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: cols }, empty))]));
}

const card = (cls, title, ...children) => el("section", { class: "card " + cls }, title && el("h2", {}, title), ...children);
const td = (v, cls) => el("td", { class: cls }, v === undefined || v === null ? "" : v);
const num = (v) => td(typeof v === "number" ? fmt(v) : v, "num");
const badge = (text, cls) => el("span", { class: "badge " + (cls || text) }, text);
const jobLink = (id) => el("a", { href: "#/jobs/" + id, class: "id" }, id);
const batchLink = (id) => el("a", { href: "#/batches/" + id, class: "id" }, id);
const json = (v) => JSON.stringify(v, null, 2);

/** A definition list of the pairs whose value is there (0 and false are shown). */
function kv(pairs) {
  return el("dl", { class: "kv" }, pairs
    .filter(([, v]) => v !== undefined && v !== null && v !== "")
    .map(([k, v]) => [el("dt", {}, k), el("dd", {}, typeof v === "boolean" ? String(v) : v)]));
}

/** A progress bar of `part` of `whole`. */
function bar(part, whole, hot) {
  const share = whole > 0 ? Math.min(1, part / whole) : 0;
  return el("div", { class: "bar", title: (share * 100).toFixed(0) + "%" },
    el("div", { class: hot ? "hot" : "", style: "width:" + (share * 100).toFixed(1) + "%" }));
}

// ---------------------------------------------------------------- formatting

const fmt = (n) => (n === null || n === undefined || n === "" ? "" : Math.abs(n) >= 1000 ? Math.round(n).toLocaleString("en") : (+(+n).toFixed(2)).toString());
const usd = (n) => (n === null || n === undefined ? "" : n === 0 ? "$0.00" : "$" + (Math.abs(n) >= 1 ? n.toFixed(2) : (+n.toPrecision(2)).toString()));
const age = (s) => (s >= 3600 ? (s / 3600).toFixed(1) + " h" : s >= 60 ? (s / 60).toFixed(1) + " min" : s.toFixed(1) + " s");
const pad = (n) => String(n).padStart(2, "0");

/** A date from an RFC 3339 string or Unix seconds (the batch API's). */
const date = (v) => (typeof v === "number" ? new Date(v * 1000) : new Date(v));

/** A time as local HH:MM:SS (the date too when not today), the full ISO in its title. */
function when(v) {
  if (v === null || v === undefined || v === "") return "";
  const d = date(v);
  if (isNaN(d)) return String(v);
  const iso = typeof v === "string" ? v : d.toISOString();
  const day = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate());
  const today = d.toDateString() === new Date().toDateString();
  return el("time", { datetime: iso, title: iso }, (today ? "" : day + " ") + d.toLocaleTimeString("en-GB"));
}

/** Seconds from `a` to `b`, as an age, when both are there. */
const span = (a, b) => (a && b ? age(Math.max(0, (date(b) - date(a)) / 1000)) : "");

/** An RFC 3339 time as a datetime-local input's value (local time), and back (UTC). */
function toLocalInput(iso) {
  const d = iso ? new Date(iso) : null;
  if (!d || isNaN(d)) return "";
  return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + "T" + pad(d.getHours()) + ":" + pad(d.getMinutes());
}
const fromLocalInput = (v) => new Date(v).toISOString();

/** Flat objects as "k v · k v" (limits, scopes, rate-limit headers); nested values as JSON. */
function compact(o, strip) {
  if (!o || typeof o !== "object") return o === undefined || o === null ? "" : String(o);
  const parts = Object.entries(o).filter(([, v]) => v !== null && v !== undefined && !(Array.isArray(v) && !v.length));
  if (!parts.length) return "—";
  return el("span", { class: "compact" }, parts.map(([k, v]) =>
    el("span", { title: k + ": " + (typeof v === "object" ? JSON.stringify(v) : v) },
      (strip ? k.replace(strip, "") : k) + " ",
      el("b", {}, Array.isArray(v) ? v.join(", ") : typeof v === "object" ? JSON.stringify(v) : typeof v === "number" ? fmt(v) : String(v)))));
}

const limitsText = (l) => compact(l);
const budgetsText = (bs) => (bs && bs.length ? bs.map((b) => usd(b.usd) + "/" + b.window).join(", ") : "—");

// ---------------------------------------------------------------- confirm and actions

/** Asks in the confirm dialog; resolves true for "yes". */
function ask(text) {
  const d = $("#confirm");
  if (d.open) return Promise.resolve(false);
  $("#confirm-text").textContent = text;
  d.returnValue = "";
  d.showModal();
  return new Promise((resolve) => d.addEventListener("close", () => resolve(d.returnValue === "yes"), { once: true }));
}

/** A button that, once confirmed, calls the API and then `after` (which redraws). */
function action(name, label, question, path, opts, after) {
  return el("button", {
    type: "button", "data-action": name, class: name === "cancel" || name === "revoke" || name === "disable" ? "danger" : null,
    onclick: async (ev) => {
      const b = ev.currentTarget;
      if (!(await ask(question))) return;
      b.disabled = true;
      showError(null);
      try { await api(path, opts); } catch (e) { showError(e); }
      await after();
      b.disabled = false;
    },
  }, label);
}

// ---------------------------------------------------------------- router

let gen = 0; // bumped at every route change: an older page's work stops drawing
let routed = ""; // the URL last drawn
const live = (g) => g === gen;

/** Runs `fn` now and `ms` after each run ends, while page generation `g` is current. */
function every(g, ms, fn) {
  const tick = async () => {
    if (!live(g)) return;
    await fn();
    if (live(g)) setTimeout(tick, ms);
  };
  tick();
}

/** Tells whether an answer is the newest one drawn: `const ok = ticket(); …; if (!ok()) return`. */
function tickets() {
  let asked = 0, shown = 0;
  return () => {
    const n = ++asked;
    return () => (n > shown ? ((shown = n), true) : false);
  };
}

let scope = null;
let scopePromise = null;

/** The key's scope (`all` or its tenant), from /v1/status; asked once per key. */
function whoami() {
  scopePromise = scopePromise || api("/v1/status").then((s) => (showScope(s.scope), s.scope)).catch((e) => {
    scopePromise = null;
    throw e;
  });
  return scopePromise;
}

function showScope(s) {
  scope = s;
  const e = $("#scope");
  e.textContent = s === "all" ? "all tenants (admin)" : s ? "tenant " + s : "";
  e.dataset.scope = s || "";
  for (const a of document.querySelectorAll("nav a[data-nav]")) {
    if (ADMIN_PAGES.includes(a.dataset.nav)) a.hidden = s !== "all";
  }
}

/** Goes to `hash` and draws it now (a filter's submit must not show the old rows meanwhile). */
function go(hash) {
  history.pushState(null, "", hash);
  route();
}

function parseHash() {
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  let name = parts[0] || "overview";
  if (name === "jobs" && parts[1]) name = "job";
  if (name === "batches" && parts[1]) name = "batch";
  return { name, id: parts[1], params: new URLSearchParams(query || "") };
}

const PAGES = { overview, jobs, job, batches, batch, tenants, keys, pauses };

async function route() {
  const g = ++gen;
  routed = location.href;
  showError(null);
  destroyCharts();
  const r = parseHash();
  const page = PAGES[r.name] ? r.name : "overview";
  const section = page === "job" ? "jobs" : page === "batch" ? "batches" : page;
  document.body.dataset.page = page;
  for (const a of document.querySelectorAll("nav a[data-nav]")) {
    if (a.dataset.nav === section) a.setAttribute("aria-current", "page"); else a.removeAttribute("aria-current");
  }
  const main = $("#page");
  main.replaceChildren();
  if (!key()) {
    $("#login").hidden = false;
    $("#logout").hidden = true;
    main.append(el("p", { class: "note" }, "Enter an API key (a tenant's, or the admin key) to see the queue."));
    return;
  }
  $("#logout").hidden = false;
  try {
    await whoami();
  } catch (e) {
    if (live(g)) showError(e);
    return;
  }
  if (!live(g)) return;
  if (ADMIN_PAGES.includes(page) && scope !== "all") {
    main.append(el("p", { class: "note" }, "This page needs the admin key."));
    return;
  }
  PAGES[page](main, r, g);
}

// ---------------------------------------------------------------- charts (uPlot)

/** The last hour of /v1/status/history samples, oldest first, with their traffic summed. */
const ring = [];
const charts = new Map(); // container id → { u, names, height }

async function pollHistory() {
  const newest = ring[ring.length - 1];
  const h = await api("/v1/status/history" + (newest ? "?after=" + enc(newest.at) : ""));
  for (const s of h.samples) {
    const t = Date.parse(s.at);
    if (ring.length && t <= ring[ring.length - 1].t) continue;
    const sum = { succeeded: 0, tokens: 0, status_429: 0, status_5xx: 0 };
    for (const tr of Object.values(s.traffic || {})) for (const f in sum) sum[f] += tr[f] || 0;
    ring.push({ at: s.at, t, secs: s.interval_secs || h.interval_secs, queued: s.queued || {}, sum });
  }
  const cutoff = ring.length ? ring[ring.length - 1].t - HOUR_MS : 0;
  let old = 0;
  while (old < ring.length && ring[old].t <= cutoff) old++;
  ring.splice(0, old);
}

/**
 * For each sample: its traffic summed over the samples taken within the 60 s up to it,
 * and the seconds those cover — what /v1/status calls "the last minute" at that moment.
 */
function trailing(samples) {
  const acc = { succeeded: 0, tokens: 0, status_429: 0, status_5xx: 0, secs: 0 };
  const add = (s, sign) => {
    for (const f in s.sum) acc[f] += sign * s.sum[f];
    acc.secs += sign * s.secs;
  };
  const out = [];
  let j = 0;
  for (const s of samples) {
    add(s, 1);
    while (samples[j].t <= s.t - WINDOW_MS) add(samples[j++], -1);
    out.push({ ...acc });
  }
  return out;
}
// Over the trailing minute, as /v1/status reckons it: a history shorter than a minute is
// still divided by the minute, so the charts' last values are the header's figures.
const perSec = (w, f) => w[f] / Math.max(60, w.secs);
// A count over the trailing minute (pro rata when one sample covers more than a minute).
const perMinute = (w, f) => (w[f] * 60) / Math.max(60, w.secs);

function drawHistory() {
  const xs = ring.map((s) => s.t / 1000);
  const names = [...new Set(ring.flatMap((s) => Object.keys(s.queued)))].sort();
  plot("chart-queues", xs, names.map((n) => [n, ring.map((s) => s.queued[n] || 0)]));
  const w = trailing(ring);
  plot("chart-throughput", xs, [["jobs/s", w.map((x) => perSec(x, "succeeded"))]]);
  plot("chart-tokens", xs, [["tokens/s", w.map((x) => perSec(x, "tokens"))]]);
  plot("chart-errors", xs, [
    ["429s/min", w.map((x) => perMinute(x, "status_429"))],
    ["5xx/min", w.map((x) => perMinute(x, "status_5xx"))],
  ]);
}

/** Unix seconds as local HH:MM, or HH:MM:SS. */
const clock = (t, seconds) => new Date(t * 1000).toLocaleTimeString("en-GB", seconds ? {} : { hour: "2-digit", minute: "2-digit" });

/** A chart container: uPlot draws into it; its legend rows carry `data-series`. */
const chartBox = (id, label, height) => el("div", { id, class: "chart", role: "img", "aria-label": label, "data-height": height });

/** Draws `series` ([name, values]) over times `xs` (Unix seconds) into container `id`. */
function plot(id, xs, series) {
  const box = document.getElementById(id);
  if (!box) return;
  const names = series.map((s) => s[0]);
  const data = [xs, ...series.map((s) => s[1])];
  let c = charts.get(id);
  if (c && c.names.join("\n") === names.join("\n")) {
    c.u.setData(data);
    c.u.setLegend({ idx: c.u.cursor.idx == null ? null : c.u.cursor.idx });
    return;
  }
  if (c) c.u.destroy();
  charts.delete(id);
  box.replaceChildren();
  if (!window.uPlot) {
    // Without the library: the names and latest values, still tagged for tests and people.
    box.append(el("ul", { class: "legend" }, series.map(([n, v]) => el("li", { "data-series": n }, n + " " + fmt(v.length ? v[v.length - 1] : 0)))));
    return;
  }
  const height = +box.dataset.height || 180;
  const latest = (u, si) => {
    const v = u.data[si];
    return v.length ? v[v.length - 1] : null;
  };
  const u = new window.uPlot({
    width: Math.max(240, box.clientWidth),
    height,
    cursor: { drag: { x: false, y: false } },
    scales: {
      // One sample alone has no span: show the minute before it.
      x: { time: true, range: (u, min, max) => (min === max ? [min - 60, max] : [min, max]) },
      y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
    },
    axes: [
      { stroke: "#6b7480", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#dde1e6" }, space: 80, values: (u, ticks, _, __, step) => ticks.map((t) => clock(t, step < 60)) },
      { stroke: "#6b7480", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#dde1e6" }, size: 60, values: (u, ticks) => ticks.map(fmt) },
    ],
    series: [
      { label: "time", value: (u, v) => (v == null ? "latest" : clock(v, true)) },
      ...names.map((n, i) => ({
        label: n,
        stroke: COLORS[i % COLORS.length],
        width: 2,
        points: { show: false },
        // Off the chart, the legend shows the latest value.
        value: (u, v, si, idx) => fmt(idx == null ? latest(u, si) : v),
      })),
    ],
  }, data, box);
  u.root.querySelectorAll(".u-legend tr.u-series").forEach((tr, i) => {
    if (i > 0) tr.dataset.series = names[i - 1];
  });
  u.setLegend({ idx: null });
  charts.set(id, { u, names, height });
}

function destroyCharts() {
  for (const c of charts.values()) c.u.destroy();
  charts.clear();
}

let resizing = false;
window.addEventListener("resize", () => {
  if (resizing) return;
  resizing = true;
  requestAnimationFrame(() => {
    resizing = false;
    for (const [id, c] of charts) {
      const box = document.getElementById(id);
      if (box) c.u.setSize({ width: Math.max(240, box.clientWidth), height: c.height });
    }
  });
});

// ---------------------------------------------------------------- overview

function overview(main, r, g) {
  const figure = (id) => el("b", { id, "data-value": "0" }, "0");
  const root = el("div", { id: "status", class: "grid", "data-ready": "0" },
    card("wide", ["Queue depth by tenant and class ", el("small", {}, "last hour")], chartBox("chart-queues", "queued jobs over time", 220)),
    card("", "Throughput",
      el("p", { class: "figures" }, figure("jobs-per-sec"), " jobs/s · ", figure("tokens-per-sec"), " tokens/s ", el("small", {}, "(last minute)")),
      chartBox("chart-throughput", "jobs per second, trailing minute", 150),
      chartBox("chart-tokens", "tokens per second, trailing minute", 150)),
    card("", "Provider 429 and 5xx",
      el("p", { class: "figures" }, figure("provider-429s"), " 429s · ", figure("provider-5xxs"), " 5xx ", el("small", {}, "(last minute)")),
      chartBox("chart-errors", "provider errors over the trailing minute", 150)),
    card("wide", ["Buckets ", el("small", {}, "use against limit")], table("buckets", ["bucket", "dimension", "use", "#used", "#limit", "source"])),
    card("wide", "Queues now", table("queues", ["tenant", "class", "#queued", "#admitted", "#running", "#oldest", "#done/min", "#drained in"])),
    card("", "Oldest queued job per class", table("oldest", ["class", "#age"])),
    card("", "Batches in progress", table("batches", ["batch", "tenant", "state", "progress", ""])),
    card("wide", "Recent failures", table("failures", ["when", "tenant", "model", "reason", "message", "job"])));
  main.append(root);
  every(g, POLL_MS, async () => {
    try {
      const [s] = await Promise.all([api("/v1/status"), pollHistory()]);
      if (!live(g)) return;
      drawStatus(s);
      drawHistory();
      showError(null);
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  });
}

function drawStatus(s) {
  showScope(s.scope);
  $("#updated").textContent = "updated " + new Date(s.generated_at).toLocaleTimeString("en-GB");
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
    const amount = (v) => (money ? usd(v / 1e6) : fmt(v));
    return el("tr", { "data-bucket": b.bucket, "data-capacity": b.capacity, "data-used": b.used, "data-source": b.source },
      td(b.bucket), td(money ? "spend (USD)" : b.dimension), el("td", {}, bar(b.used, b.capacity, use > 0.9)),
      num(amount(b.used)), num(amount(b.capacity)),
      td(b.source, b.source === "configured" ? "" : "learned"));
  }), "no buckets");
  const jobsOf = (q, state) => "#/jobs?" + new URLSearchParams(scope === "all" ? { tenant: q.tenant, class: q.class, state } : { class: q.class, state });
  // `eta_secs`: the broker's forecast of when the queue's unfinished jobs are done.
  fill("queues", s.queues.map((q) => el("tr", { "data-queue": q.tenant + "/" + q.class, "data-queued": q.queued, "data-admitted": q.admitted, "data-running": q.running, "data-eta": q.eta_secs == null ? "" : q.eta_secs },
    td(q.tenant), td(q.class),
    num(el("a", { href: jobsOf(q, "queued") }, fmt(q.queued))), num(q.admitted), num(q.running),
    num(age(q.oldest_queued_secs)), num(q.finished_last_minute), num(q.eta_secs == null ? "—" : age(q.eta_secs)))), "nothing waiting");
  const oldest = {};
  for (const q of s.queues) if (q.queued > 0) oldest[q.class] = Math.max(oldest[q.class] || 0, q.oldest_queued_secs);
  fill("oldest", Object.entries(oldest).map(([c, a]) => el("tr", { "data-class": c, "data-age": a }, td(c), num(age(a)))), "nothing queued");
  fill("failures", s.recent_failures.map((f) => el("tr", { "data-job": f.id, "data-code": f.code || "" },
    el("td", {}, when(f.finished_at)), td(f.tenant), td(f.model), td(f.code || ""), td(f.message || "", "msg"), el("td", {}, jobLink(f.id)))), "no failures");
  fill("batches", s.batches.map((b) => el("tr", { "data-batch": b.id },
    el("td", {}, batchLink(b.id)), td(b.tenant), td(b.state),
    el("td", {}, bar(b.completed + b.failed, b.total, false)),
    td(b.completed + b.failed + " / " + b.total + (b.failed ? " (" + b.failed + " failed)" : "")))), "no batches in progress");
}

// ---------------------------------------------------------------- jobs

/** The admin's datalist of tenant names (for a tenant key: none). */
async function tenantNames(list) {
  if (scope !== "all") return [];
  const t = await api("/v1/admin/tenants");
  const names = t.data.map((x) => x.name);
  if (list) list.replaceChildren(...names.map((n) => el("option", { value: n })));
  return names;
}

function jobs(main, r, g) {
  const p = r.params;
  const admin = scope === "all";
  const field = (label, input) => el("label", {}, el("span", {}, label), input);
  const text = (name, placeholder, extra) => el("input", { name, value: p.get(name) || "", placeholder, autocomplete: "off", ...extra });
  const choice = (name, options) => el("select", { name }, el("option", { value: "" }, "any"), options.map((o) => el("option", { value: o, selected: p.get(name) === o }, o)));
  const moment = (name) => el("input", { name, type: "datetime-local", value: toLocalInput(p.get(name)) });
  const form = el("form", { id: "job-filters", class: "filters card" },
    admin && field("tenant", text("tenant", "any", { list: "tenant-names" })),
    field("state", choice("state", JOB_STATES)),
    field("class", choice("class", CLASSES)),
    field("lane", choice("lane", LANES)),
    field("model", text("model", "alias or provider/model")),
    field("endpoint", text("endpoint", "/v1/chat/completions")),
    field("batch", text("batch", "batch id")),
    field("reason", text("reason", "error or admission reason")),
    field("created after", moment("created_after")),
    field("created before", moment("created_before")),
    field("search", text("q", "job id, idempotency key or key=value", { type: "search", class: "wide" })),
    el("div", { class: "buttons" }, el("button", { type: "submit", class: "primary" }, "Filter"), el("a", { href: "#/jobs" }, "clear")));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form)) {
      const val = String(v).trim();
      if (val) q.set(k, k.startsWith("created_") ? fromLocalInput(val) : val);
    }
    go("#/jobs" + (q.toString() ? "?" + q : ""));
  });
  const next = el("button", { type: "button", id: "jobs-next", hidden: true }, "Next page →");
  const root = el("section", { id: "jobs-page", class: "page", "data-ready": "0" },
    el("h2", {}, "Jobs"), form, admin && el("datalist", { id: "tenant-names" }),
    card("wide", null, table("jobs", ["job", "tenant", "state", "class", "model", "lane", "#attempts", "created", "finished", "#cost", "reason"]),
      el("div", { class: "pager" }, p.get("after") && el("a", { href: "#/jobs?" + without(p, "after") }, "← first page"), next)));
  main.append(root);
  if (admin) tenantNames($("#tenant-names")).catch(() => {});
  (async () => {
    const q = new URLSearchParams();
    for (const k of [...JOB_FILTERS, "after"]) if (p.get(k)) q.set(k, p.get(k));
    q.set("limit", "50");
    try {
      const list = await api("/v1/jobs?" + q);
      if (!live(g)) return;
      fill("jobs", list.data.map(jobRow), "no jobs match");
      next.hidden = !list.has_more;
      next.onclick = () => {
        const n = new URLSearchParams(p);
        n.set("after", list.last_id);
        go("#/jobs?" + n);
      };
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  })();
}

const without = (params, name) => {
  const n = new URLSearchParams(params);
  n.delete(name);
  return n.toString();
};

function jobRow(j) {
  const cost = j.cost || {};
  return el("tr", { "data-job": j.id, "data-state": j.state },
    el("td", {}, jobLink(j.id)), td(j.tenant), el("td", {}, badge(j.state)), td(j.class), td(j.model),
    td(j.dispatch && j.dispatch.via), num(j.attempts), el("td", {}, when(j.created_at)), el("td", {}, when(j.finished_at)),
    num(cost.charged_usd == null ? "" : usd(cost.charged_usd)),
    td((j.error && j.error.code) || (j.admission && j.admission.reason) || ""));
}

function job(main, r, g) {
  const id = r.id;
  const root = el("section", { id: "job", class: "page", "data-job": id, "data-state": "", "data-ready": "0" }, el("p", { class: "note" }, "loading…"));
  main.append(root);
  const ticket = tickets();
  let state = null, drawn = "";
  const load = async (force) => {
    if (!force && state && !JOB_OPEN.includes(state)) return; // finished: nothing changes
    const ok = ticket();
    try {
      const [j, a] = await Promise.all([api("/v1/jobs/" + enc(id)), api("/v1/jobs/" + enc(id) + "/attempts")]);
      if (!live(g) || !ok()) return;
      state = j.state;
      root.dataset.state = j.state;
      const sig = JSON.stringify([j, a]);
      if (sig !== drawn) {
        drawn = sig;
        drawJob(root, j, a.data, () => load(true));
      }
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  };
  every(g, REFRESH_MS, () => load(false));
}

function drawJob(root, j, attempts, reload) {
  const id = j.id;
  const cost = j.cost || {}, dispatch = j.dispatch || {}, estimate = j.estimate || {}, usage = j.usage || {};
  const actions = el("div", { class: "actions" },
    JOB_OPEN.includes(j.state) && action("cancel", "Cancel job", "Cancel job " + id + "? A call in flight is discarded.", "/v1/jobs/" + enc(id) + "/cancel", { method: "POST" }, reload),
    (j.state === "failed" || j.state === "cancelled") && action("retry", "Retry job", "Queue job " + id + " again?", "/v1/jobs/" + enc(id) + "/retry", { method: "POST" }, reload));
  const target = j.provider ? j.provider + "/" + (j.provider_model || "") : "";
  const tokenRows = [...new Set([...Object.keys(estimate), ...Object.keys(usage)])]
    .filter((k) => typeof (usage[k] ?? estimate[k]) === "number")
    .map((k) => el("tr", {}, td(k.replace(/_tokens$/, "")), num(estimate[k]), num(usage[k])));
  const admission = j.admission || null;
  const waits = Array.isArray(j.admission_history) ? j.admission_history : [];
  const value = (k, v) => (v !== null && typeof v === "object" ? JSON.stringify(v) : /_at$/.test(k) ? when(v) : typeof v === "number" ? fmt(v) : v);
  root.replaceChildren(
    el("div", { class: "title" }, el("h2", {}, "Job ", el("code", {}, id), " ", badge(j.state)), actions),
    el("div", { class: "grid" },
      card("", "Job", kv([
        ["state", badge(j.state)],
        ["tenant", scope === "all" ? el("a", { href: "#/jobs?tenant=" + enc(j.tenant) }, j.tenant) : j.tenant],
        ["class", j.class],
        ["priority", j.priority],
        ["endpoint", j.endpoint],
        ["model", j.model + (target ? " → " + target : "")],
        ["failed targets", j.failed_targets && j.failed_targets.length ? j.failed_targets.join(", ") : null],
        ["lane", [dispatch.via, dispatch.reason ? " (" + dispatch.reason + ")" : ""]],
        ["provider batch", dispatch.provider_batch_id],
        ["batch", j.batch_id ? batchLink(j.batch_id) : null],
        ["attempts", j.attempts + " of " + j.max_attempts],
        ["deadline", when(j.deadline)],
        ["not before", when(j.not_before)],
        ["idempotency key", j.idempotency_key],
        ["API key", j.api_key],
        ["provider request", j.provider_request_id],
        ["trace", j.trace_id],
      ])),
      card("", "Timeline", kv([
        ["created", when(j.created_at)],
        ["admitted", when(j.admitted_at)],
        ["started", when(j.started_at)],
        ["finished", when(j.finished_at)],
        ["waited", span(j.created_at, j.admitted_at || j.finished_at)],
        ["ran", span(j.started_at, j.finished_at)],
      ])),
      card("", "Tokens and cost",
        el("div", { class: "scroll" }, el("table", { class: "tokens" }, el("thead", {}, el("tr", {}, el("th", {}, "tokens"), el("th", { class: "num" }, "estimate"), el("th", { class: "num" }, "used"))), el("tbody", {}, tokenRows))),
        kv([
          ["reserved", usd(cost.reserved_usd)],
          ["charged", usd(cost.charged_usd)],
          ["priced from", cost.price_source],
          ["lane", cost.lane],
        ])),
      j.error && card("", "Error", kv([["code", el("code", {}, j.error.code)], ["message", j.error.message]])),
      (admission || waits.length > 0) && card("", "Why it waits",
        admission && kv(Object.entries(admission).map(([k, v]) => [k.replace(/_/g, " "), value(k, v)])),
        waits.length > 0 && el("div", { class: "scroll" }, el("table", { class: "history" },
          el("thead", {}, el("tr", {}, el("th", {}, "at"), el("th", {}, "reason"), el("th", {}, "details"))),
          el("tbody", {}, waits.map((h) => {
            const { at, reason, ...rest } = h;
            return el("tr", {}, el("td", {}, when(at)), td(reason), el("td", {}, compact(rest)));
          }))))),
      j.metadata && card("", "Metadata", el("pre", {}, json(j.metadata))),
      card("wide", "Attempts", table("attempts", ["#", "provider / model", "key", "status", "outcome", "error", "#in", "#out", "#cached", "#estimate", "rate limit (what the provider said)", "started", "#took", "provider request"])),
      j.request !== undefined && card("wide", "Request", el("pre", { id: "job-request" }, json(j.request))),
      card("wide", "Result", el("pre", { id: "job-result" }, j.result === null || j.result === undefined ? "no result" : json(j.result)))));
  fill("attempts", attempts.map((a) => {
    const u = a.usage || {}, est = a.estimate || {};
    return el("tr", { "data-attempt": a.attempt, "data-status": a.status === null || a.status === undefined ? "" : a.status },
      num(a.attempt), td(a.provider + " / " + a.provider_model), td(a.key), num(a.status === null ? "none" : a.status),
      el("td", {}, badge(a.outcome)), td(a.error_code || ""),
      num(u.input_tokens), num(u.output_tokens), num(u.cached_tokens),
      num(fmt(est.input_tokens) + " + " + fmt(est.output_tokens)),
      el("td", { class: "msg" }, a.rate_limit ? compact(a.rate_limit, /^x-(ratelimit|tokenlimit)-/) : "—"),
      el("td", {}, when(a.started_at)), num(span(a.started_at, a.finished_at)), td(a.provider_request_id || "", "id"));
  }), "no provider calls yet");
}

// ---------------------------------------------------------------- batches

function batches(main, r, g) {
  const p = r.params;
  const next = el("button", { type: "button", id: "batches-next", hidden: true }, "Next page →");
  const root = el("section", { id: "batches-page", class: "page", "data-ready": "0" },
    el("h2", {}, "Batches"),
    card("wide", null, table("batches-list", ["batch", "tenant", "status", "endpoint", "class", "#priority", "progress", "", "created", "expires", "#max cost"]),
      el("div", { class: "pager" }, p.get("after") && el("a", { href: "#/batches" }, "← first page"), next)));
  main.append(root);
  (async () => {
    try {
      const list = await api("/v1/batches?limit=50" + (p.get("after") ? "&after=" + enc(p.get("after")) : ""));
      if (!live(g)) return;
      fill("batches-list", list.data.map((b) => {
        const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
        return el("tr", { "data-batch": b.id, "data-status": b.status, "data-paused": String(!!b.paused_at) },
          el("td", {}, batchLink(b.id)), td(b.tenant), el("td", {}, badge(b.status), b.paused_at && [" ", badge("paused")]),
          td(b.endpoint), td(b.class), num(b.priority),
          el("td", {}, bar(c.completed + c.failed, c.total, false)), td(c.completed + c.failed + " / " + c.total + (c.failed ? " (" + c.failed + " failed)" : "")),
          el("td", {}, when(b.created_at)), el("td", {}, when(b.expires_at)), num(b.max_cost_usd == null ? "" : usd(b.max_cost_usd)));
      }), "no batches");
      next.hidden = !list.has_more;
      next.onclick = () => go("#/batches?after=" + enc(list.last_id));
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  })();
}

/** A link that downloads file `fileId` with the key (a blob URL once fetched). */
function download(id, fileId, name, label) {
  const path = "/v1/files/" + enc(fileId) + "/content";
  const a = el("a", { id, href: path, download: name, class: "download" }, label);
  a.addEventListener("click", async (e) => {
    if (a.dataset.blob) return; // fetched: the browser saves it
    e.preventDefault();
    try {
      const r = await api(path, { raw: true });
      a.href = a.dataset.blob = URL.createObjectURL(await r.blob());
      a.click();
    } catch (err) {
      showError(err);
    }
  });
  return a;
}

/** Every `…_usd` figure of `o` (and of its objects one level down), labelled by its path. */
function usdFields(o, prefix = "") {
  const out = [];
  for (const [k, v] of Object.entries(o || {})) {
    if (typeof v === "number" && /_usd$/.test(k)) out.push([(prefix + k).replace(/_usd$/, "").replace(/_/g, " "), usd(v)]);
    else if (v && typeof v === "object" && !Array.isArray(v) && !prefix) out.push(...usdFields(v, k + " "));
  }
  return out;
}

function batch(main, r, g) {
  const id = r.id;
  const body = el("div", {}, el("p", { class: "note" }, "loading…"));
  const results = el("pre", { id: "batch-results" }, "loading…");
  const more = el("button", { type: "button", id: "batch-results-more", hidden: true }, "More lines");
  const root = el("section", { id: "batch", class: "page", "data-batch": id, "data-status": "", "data-ready": "0" },
    body, card("wide", ["Finished lines ", el("small", {}, "first 20, in the order they finished")], results, el("div", { class: "pager" }, more)));
  main.append(root);
  const ticket = tickets();
  let status = null, drawn = "", cursor = null;
  const load = async (force) => {
    if (!force && status && BATCH_DONE.includes(status)) return;
    const ok = ticket();
    try {
      const b = await api("/v1/batches/" + enc(id));
      if (!BATCH_DONE.includes(b.status)) {
        // The broker's forecast for the queue its lines wait in (`/v1/status` `eta_secs`).
        const s = await api("/v1/status").catch(() => null);
        const q = s && s.queues.find((q) => q.tenant === b.tenant && q.class === b.class);
        b.queue_eta_secs = q ? q.eta_secs : null;
      }
      if (!live(g) || !ok()) return;
      status = b.status;
      root.dataset.status = b.status;
      root.dataset.paused = String(!!b.paused_at);
      const sig = JSON.stringify(b);
      if (sig !== drawn) {
        drawn = sig;
        drawBatch(body, b, () => load(true));
      }
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  };
  const loadResults = async (append) => {
    try {
      const res = await api("/v1/batches/" + enc(id) + "/results?limit=20" + (append && cursor ? "&after=" + enc(cursor) : ""), { raw: true });
      const text = await res.text();
      if (!live(g)) return;
      cursor = res.headers.get("x-next-cursor") || cursor;
      results.textContent = append ? results.textContent + text : text || "no finished lines yet";
      more.hidden = text.trim().split("\n").length < 20;
    } catch (e) {
      if (!live(g)) return;
      results.textContent = "could not read the results: " + e.message + " (" + e.code + ")";
    }
  };
  more.addEventListener("click", () => loadResults(true));
  every(g, REFRESH_MS, () => load(false));
  loadResults(false);
}

function drawBatch(box, b, reload) {
  const id = b.id;
  const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = c.completed + c.failed;
  const open = !BATCH_DONE.includes(b.status);
  const pb = b.provider_batch || {};
  const path = "/v1/batches/" + enc(id);
  const lines = (extra, label) => el("a", { href: "#/jobs?" + new URLSearchParams({ batch: id, ...extra }) }, label);
  const times = ["in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at"]
    .filter((k) => b[k]).map((k) => [k.replace(/_at$/, "").replace("_", " "), when(b[k])]);
  box.replaceChildren(
    el("div", { class: "title" },
      el("h2", {}, "Batch ", el("code", {}, id), " ", badge(b.status), b.paused_at && [" ", badge("paused")]),
      el("div", { class: "actions" },
        open && b.status !== "cancelling" && !b.paused_at && action("pause", "Pause", "Pause batch " + id + "? Its queued lines wait; lines in flight go on.", path + "/pause", { method: "POST" }, reload),
        open && b.paused_at && action("resume", "Resume", "Resume batch " + id + "?", path + "/resume", { method: "POST" }, reload),
        open && b.status !== "cancelling" && action("cancel", "Cancel batch", "Cancel batch " + id + "? Its unfinished lines are cancelled.", path + "/cancel", { method: "POST" }, reload))),
    el("div", { class: "grid" },
      card("wide", "Progress",
        el("div", { class: "progress", "data-done": done, "data-total": c.total }, bar(done, c.total, false),
          el("span", {}, done + " / " + c.total + " done · " + c.completed + " completed · " + c.failed + " failed")),
        kv([
          ["ETA", b.eta ? when(b.eta) : b.estimated_completion_at ? when(b.estimated_completion_at) : null],
          ["queue drains in", b.queue_eta_secs == null ? null : age(b.queue_eta_secs) + " (the broker's forecast for " + b.tenant + "/" + b.class + ")"],
          ["lines", [lines({}, "all"), " · ", lines({ state: "failed" }, "failed"), " · ", lines({ state: "queued" }, "queued")]],
        ])),
      card("", "Batch", kv([
        ["status", badge(b.status)],
        ["paused", b.paused_at ? ["since ", when(b.paused_at)] : "no"],
        ["tenant", b.tenant],
        ["endpoint", b.endpoint],
        ["class", b.class],
        ["priority", b.priority],
        ["created", when(b.created_at)],
        ...times,
        ["completion window", b.completion_window],
        ["deadline", when(b.expires_at)],
        ["input file", b.input_file_id],
        ["max error rate", b.max_error_rate == null ? null : (b.max_error_rate * 100).toFixed(1) + "%"],
      ])),
      card("", "Cost and lanes", kv([
        ...usdFields(b),
        ["provider batch lines", pb.lines === undefined ? null : [fmt(pb.lines) + " of " + fmt(c.total) + " ", lines({ lane: "provider_batch" }, "show")]],
        ["usage", b.usage ? compact(b.usage) : null],
      ])),
      card("", "Outputs", kv([
        ["output", b.output_file_id ? download("batch-output", b.output_file_id, id + "-output.jsonl", "download output (" + b.output_file_id + ")") : "not written yet"],
        ["errors", b.error_file_id ? download("batch-errors", b.error_file_id, id + "-errors.jsonl", "download errors (" + b.error_file_id + ")") : "not written yet"],
      ])),
      b.metadata && card("", "Metadata", el("pre", {}, json(b.metadata))),
      b.errors && card("", "Errors", el("pre", {}, json(b.errors)))));
}

// ---------------------------------------------------------------- admin: tenants

function tenants(main, r, g) {
  const root = el("section", { id: "tenants-page", class: "page", "data-ready": "0" },
    el("h2", {}, "Tenants"),
    card("wide", null, table("tenants", ["tenant", "parent", "#weight", "limits", "budgets", "applications", "#jobs today", "#spent today", "paused", "source", ""])));
  main.append(root);
  const ticket = tickets();
  const load = async () => {
    const ok = ticket();
    const now = new Date();
    const midnight = new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate())).toISOString();
    try {
      const [t, p, usage] = await Promise.all([
        api("/v1/admin/tenants"),
        api("/v1/admin/pauses"),
        api("/v1/usage?group_by=tenant&from=" + enc(midnight)).catch(() => null),
      ]);
      if (!live(g) || !ok()) return;
      const paused = new Map(p.data.filter((x) => x.kind === "tenant").map((x) => [x.tenant, x]));
      const today = new Map(((usage && usage.data) || []).map((u) => [u.tenant, u]));
      fill("tenants", t.data.map((x) => {
        const pause = paused.get(x.name);
        const u = today.get(x.name);
        const apps = Object.keys(x.applications || {});
        return el("tr", { "data-tenant": x.name, "data-paused": String(!!pause) },
          el("td", {}, el("b", {}, x.name)), td(x.parent || ""), num(x.weight), el("td", {}, limitsText(x.limits)), td(budgetsText(x.budgets)),
          td(apps.length ? apps.join(", ") : ""), num(u ? u.requests : ""), num(u ? usd(u.usd) : ""),
          el("td", {}, pause ? [badge("paused"), " since ", when(pause.created_at)] : "no"), td(x.source),
          el("td", { class: "act" },
            el("a", { href: "#/jobs?tenant=" + enc(x.name) }, "jobs"), " ",
            el("a", { href: "#/keys?tenant=" + enc(x.name) }, "keys"), " ",
            pause
              ? action("resume", "Resume", "Resume tenant " + x.name + "? Its queued jobs are admitted again.", "/v1/admin/pauses/" + enc("tenant:" + x.name), { method: "DELETE" }, load)
              : action("pause", "Pause", "Pause tenant " + x.name + "? Its queued jobs wait until resumed; jobs admitted go on.", "/v1/admin/pauses", { method: "POST", body: { tenant: x.name } }, load)));
      }), "no tenants");
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  };
  load();
}

// ---------------------------------------------------------------- admin: keys

function keys(main, r, g) {
  const root = el("section", { id: "keys-page", class: "page", "data-ready": "0" }, el("h2", {}, "API keys"), el("p", { class: "note" }, "loading…"));
  main.append(root);
  (async () => {
    let names;
    try {
      names = await tenantNames(null);
    } catch (e) {
      if (live(g)) showError(e);
      return;
    }
    if (!live(g)) return;
    const chosen = names.includes(r.params.get("tenant")) ? r.params.get("tenant") : names[0];
    const select = el("select", { name: "tenant" }, names.map((n) => el("option", { value: n, selected: n === chosen }, n)));
    const name = el("input", { name: "name", placeholder: "default", autocomplete: "off" });
    const secret = el("code", { id: "new-key-secret" });
    const shown = el("p", { class: "secret", hidden: true }, "New key, shown this once — copy it now: ", secret);
    const form = el("form", { id: "new-key", class: "filters card" },
      el("label", {}, el("span", {}, "tenant"), select),
      el("label", {}, el("span", {}, "name"), name),
      el("div", { class: "buttons" }, el("button", { type: "submit", class: "primary" }, "Create key")));
    root.replaceChildren(el("h2", {}, "API keys"), form, shown,
      card("wide", null, table("keys", ["name", "prefix", "application", "created", "last used", "expires", "revoked", "scopes", "limits", "budgets", ""])));
    const ticket = tickets();
    const loadKeys = async () => {
      const ok = ticket();
      const tenant = select.value;
      if (!tenant) {
        fill("keys", [], "no tenants");
        root.dataset.ready = "1";
        return;
      }
      try {
        const list = await api("/v1/admin/tenants/" + enc(tenant) + "/keys");
        if (!live(g) || !ok()) return;
        fill("keys", list.data.map((k) => el("tr", { "data-key": k.id, "data-revoked": String(!!k.revoked_at) },
          el("td", {}, el("b", {}, k.name)), td(el("code", {}, k.prefix + "…")), td(k.application || ""),
          el("td", {}, when(k.created_at)), el("td", {}, when(k.last_used_at)), el("td", {}, when(k.expires_at)),
          el("td", {}, k.revoked_at ? [badge("revoked"), " ", when(k.revoked_at)] : ""),
          el("td", {}, compact(k.scopes)), el("td", {}, limitsText(k.limits)), td(budgetsText(k.budgets)),
          el("td", { class: "act" }, !k.revoked_at && action("revoke", "Revoke", "Revoke key " + k.name + " (" + k.prefix + "…) of " + tenant + "? Every process refuses it within a second.", "/v1/admin/tenants/" + enc(tenant) + "/keys/" + enc(k.id), { method: "DELETE" }, loadKeys)))), "no keys");
        root.dataset.ready = "1";
      } catch (e) {
        if (live(g)) showError(e);
      }
    };
    // Choosing a tenant shows its keys and keeps the form as it is.
    select.addEventListener("change", () => {
      history.replaceState(null, "", "#/keys?tenant=" + enc(select.value));
      routed = location.href;
      shown.hidden = true;
      loadKeys();
    });
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      showError(null);
      const body = name.value.trim() ? { name: name.value.trim() } : {};
      try {
        const k = await api("/v1/admin/tenants/" + enc(select.value) + "/keys", { method: "POST", body });
        secret.textContent = k.key;
        shown.hidden = false;
        name.value = "";
      } catch (err) {
        showError(err);
      }
      await loadKeys();
    });
    loadKeys();
  })();
}

// ---------------------------------------------------------------- admin: pauses and providers

function pauses(main, r, g) {
  const kind = el("select", { name: "kind" }, el("option", { value: "route" }, "route"), el("option", { value: "model" }, "provider model"));
  const input = (name, list, placeholder) => el("input", { name, list, placeholder, autocomplete: "off" });
  const routeField = el("label", {}, el("span", {}, "route"), input("route", "route-names", "alias"));
  const providerField = el("label", { hidden: true }, el("span", {}, "provider"), input("provider", "provider-names", "provider"));
  const modelField = el("label", { hidden: true }, el("span", {}, "model"), input("model", "model-names", "model"));
  const lists = { route: el("datalist", { id: "route-names" }), provider: el("datalist", { id: "provider-names" }), model: el("datalist", { id: "model-names" }) };
  const form = el("form", { id: "new-pause", class: "filters card" },
    el("label", {}, el("span", {}, "pause a"), kind), routeField, providerField, modelField,
    el("div", { class: "buttons" }, el("button", { type: "submit", class: "primary" }, "Pause")));
  kind.addEventListener("change", () => {
    routeField.hidden = kind.value !== "route";
    providerField.hidden = modelField.hidden = kind.value !== "model";
  });
  const root = el("section", { id: "pauses-page", class: "page", "data-ready": "0" },
    el("h2", {}, "Pauses and providers"),
    card("wide", "Pauses in force", table("pauses", ["scope", "kind", "what", "by", "reason", "since", "until", ""])),
    form, Object.values(lists),
    card("wide", "Routes", table("routes", ["route", "targets", "limits", "source", ""])),
    card("wide", "Provider keys", table("provider-keys", ["provider", "key", "source", "#weight", "models", "limits", "state", "updated", ""])));
  main.append(root);
  const ticket = tickets();
  let drawn = "";
  const load = async (force) => {
    const ok = ticket();
    try {
      const [p, routes, pkeys, models] = await Promise.all([
        api("/v1/admin/pauses"),
        api("/v1/admin/routes"),
        api("/v1/admin/provider-keys"),
        api("/v1/models").catch(() => ({ data: [] })), // tenant keys only, today
      ]);
      if (!live(g) || !ok()) return;
      const sig = JSON.stringify([p, routes, pkeys, models]);
      if (sig === drawn && !force) return;
      drawn = sig;
      draw(p.data, routes.data, pkeys.data, models.data);
      root.dataset.ready = "1";
    } catch (e) {
      if (live(g)) showError(e);
    }
  };
  const reload = () => load(true);
  const draw = (ps, routes, pkeys, models) => {
    const routePaused = new Set(ps.filter((x) => x.kind === "route" && x.by === "operator").map((x) => x.route));
    fill("pauses", ps.map((x) => el("tr", { "data-scope": x.scope, "data-by": x.by },
      td(el("code", {}, x.scope)), td(x.kind),
      td(x.tenant || x.route || (x.provider ? x.provider + "/" + x.model : "")),
      el("td", {}, badge(x.by)), td(x.reason), el("td", {}, when(x.created_at)), el("td", {}, x.until ? when(x.until) : "resumed by hand"),
      el("td", { class: "act" }, x.by === "operator" && action("resume", "Resume", "Resume " + x.scope + "?", "/v1/admin/pauses/" + enc(x.scope), { method: "DELETE" }, reload)))),
    "nothing paused");
    fill("routes", routes.map((x) => el("tr", { "data-route": x.alias },
      el("td", {}, el("b", {}, x.alias)), td(x.targets.join(" → ")), el("td", {}, x.limits ? compact(x.limits) : "—"), td(x.source),
      el("td", { class: "act" }, routePaused.has(x.alias)
        ? badge("paused")
        : action("pause", "Pause", "Pause route " + x.alias + "? Its queued jobs wait until resumed.", "/v1/admin/pauses", { method: "POST", body: { route: x.alias } }, reload)))),
    "no routes");
    fill("provider-keys", pkeys.map((k) => el("tr", { "data-provider-key": k.provider + "/" + k.name, "data-enabled": String(!k.disabled) },
      td(k.provider), el("td", {}, el("b", {}, k.name)), td(k.source), num(k.weight), td(k.models && k.models.length ? k.models.join(", ") : "all"),
      el("td", {}, k.limits ? compact(k.limits) : "—"), el("td", {}, badge(k.disabled ? "disabled" : "enabled")), el("td", {}, when(k.updated_at)),
      el("td", { class: "act" }, k.disabled
        ? action("enable", "Enable", "Enable provider key " + k.provider + "/" + k.name + "?", "/v1/admin/provider-keys/" + enc(k.provider) + "/" + enc(k.name), { method: "PATCH", body: { disabled: false } }, reload)
        : action("disable", "Disable", "Disable provider key " + k.provider + "/" + k.name + "? No call uses it until enabled.", "/v1/admin/provider-keys/" + enc(k.provider) + "/" + enc(k.name), { method: "PATCH", body: { disabled: true } }, reload)))),
    "no provider keys");
    // What the form may name: routes, and the provider models their targets and the keys name.
    const targets = [...routes.flatMap((x) => x.targets), ...models.map((m) => m.id).filter((m) => m.includes("/"))];
    const providers = new Set([...pkeys.map((k) => k.provider), ...targets.map((t) => t.split("/")[0])]);
    const modelNames = new Set([...pkeys.flatMap((k) => k.models || []), ...targets.map((t) => t.slice(t.indexOf("/") + 1))]);
    const options = (list, values) => list.replaceChildren(...[...values].sort().map((v) => el("option", { value: v })));
    options(lists.route, routes.map((x) => x.alias));
    options(lists.provider, providers);
    options(lists.model, modelNames);
  };
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const f = new FormData(form);
    const body = kind.value === "route"
      ? { route: String(f.get("route")).trim() }
      : { provider: String(f.get("provider")).trim(), model: String(f.get("model")).trim() };
    const what = body.route ? "route " + body.route : "model " + body.provider + "/" + body.model;
    if (!(await ask("Pause " + what + "? Nothing queued for it is admitted until resumed."))) return;
    showError(null);
    try {
      await api("/v1/admin/pauses", { method: "POST", body });
      form.reset();
      kind.dispatchEvent(new Event("change"));
    } catch (err) {
      showError(err);
    }
    await reload();
  });
  every(g, ADMIN_REFRESH_MS, () => load(false));
}

// ---------------------------------------------------------------- start

for (const b of document.querySelectorAll("#confirm button")) {
  b.addEventListener("click", () => $("#confirm").close(b.value));
}
$("#login").addEventListener("submit", (e) => {
  e.preventDefault();
  setKey($("#key").value.trim());
  $("#key").value = "";
  $("#login").hidden = true;
  route();
});
$("#logout").addEventListener("click", () => {
  setKey(null);
  showScope(null);
  $("#updated").textContent = "";
  go("#/");
});
// A link changes the hash (hashchange); Back to an entry `go` pushed may only pop its state.
const navigated = () => {
  if (takeKeyFromFragment() || location.href !== routed) route();
};
window.addEventListener("hashchange", navigated);
window.addEventListener("popstate", navigated);
takeKeyFromFragment();
route();
