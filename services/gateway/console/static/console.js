// modelpool's console: pages over the admin API (services/gateway/admin.py), no framework, no CDN.
// Routes: #/ the pool, #/alias/NAME an alias, #/event/ID one event of the log, #/sessions the sessions,
// #/request/ID why a past request went where it went.
"use strict";

const REFRESH_MS = 2000;            // every page's data, and the live charts, at least this often
const CHART_SPAN_MS = 10 * 60e3;    // the charts show the last ten minutes
const TIMELINE_ROWS = 500;         // the newest events of the range, at most
const RANGES = { "15m": 15 * 60e3, "1h": 3600e3, "6h": 6 * 3600e3, "24h": 24 * 3600e3 };
const TIER_COLORS = { "llama.cpp": "#d9822b", "vllm": "#2f5fd0" };
const INSTANCE_ACTIONS = {
  // Which actions each backend takes in which states (the API checks again and says why not).
  drain: { backends: ["llama.cpp", "vllm"], states: ["RUNNING", "STARTING", "SLEEP_1", "SLEEP_2"] },
  sleep: { backends: ["vllm"], states: ["RUNNING", "SLEEP_1", "SLEEP_2"] },
  wake: { backends: ["vllm"], states: ["SLEEP_1", "SLEEP_2"] },
  delete: { backends: ["llama.cpp", "vllm"], states: ["RUNNING", "STARTING", "SLEEP_1", "SLEEP_2", "DRAINING", "ERROR"] },
};

const $ = (selector) => document.querySelector(selector);
const view = $("#view");
let timer = null;        // the current page's refresh
let page = null;         // the current page's state (charts keep their points here)

// ---------------------------------------------------------------- talking to the admin API

function token() { return sessionStorage.getItem("modelpool-admin-token"); }

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options,
    headers: { authorization: `Bearer ${token() || ""}`, "content-type": "application/json" },
  });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) {
    signIn("That token was refused.");
    throw new Error("the admin token was refused");
  }
  if (!response.ok) throw new Error(body.error ? body.error.message : `HTTP ${response.status}`);
  return body;
}

function signIn(message) {
  stop();
  const error = $("#sign-in-error");
  error.hidden = !message;
  error.textContent = message || "";
  if (!$("#sign-in").open) $("#sign-in").showModal();
}

$("#sign-in-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("modelpool-admin-token", $("#token").value.trim());
  $("#sign-in").close();
  route();
});
$("#sign-out").addEventListener("click", () => { sessionStorage.removeItem("modelpool-admin-token"); signIn(); });

const operatorInput = $("#operator");
operatorInput.value = localStorage.getItem("modelpool-operator") || "";
operatorInput.addEventListener("change", () => localStorage.setItem("modelpool-operator", operatorInput.value.trim()));

function banner(text, ok = false) {
  const b = $("#banner");
  b.hidden = !text;
  b.textContent = text || "";
  b.className = ok ? "ok" : "";
}

// An operator action: who (the name above), why (asked here), then the API records and carries it out.
function act(title, what, path, fields = {}) {
  const dialog = $("#confirm");
  banner("");
  $("#confirm-title").textContent = title;
  $("#confirm-what").textContent = what;
  $("#confirm-reason").value = "";
  $("#confirm-error").hidden = true;
  dialog.onsubmit = async (event) => {
    event.preventDefault();
    const operator = operatorInput.value.trim();
    if (!operator) {
      $("#confirm-error").textContent = "Put your name in the operator box first: it is recorded with the action.";
      $("#confirm-error").hidden = false;
      return;
    }
    try {
      const done = await api(path, {
        method: "POST", body: JSON.stringify({ operator, reason: $("#confirm-reason").value.trim(), ...fields }),
      });
      dialog.close();
      if (page && page.drafts) page.drafts = {};
      banner(`${title}: recorded (event ${done.event_id}).`, true);
      refresh();
    } catch (error) {
      $("#confirm-error").textContent = error.message;
      $("#confirm-error").hidden = false;
    }
  };
  $("#confirm-cancel").onclick = () => dialog.close();
  dialog.showModal();
}

// ---------------------------------------------------------------- small helpers

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function table(headers, rows, rowAttributes = () => ({})) {
  if (!rows.length) return el("p", { class: "muted" }, "(none)");
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((row, i) => el("tr", rowAttributes(i), row.map((cell) =>
      cell instanceof Node ? el("td", {}, cell) : el("td", typeof cell === "number" ? { class: "num" } : {}, cell ?? "-"))))));
}

const badge = (text, kind = text) => el("span", { class: `badge ${kind}` }, text);

function ago(iso) {
  if (!iso) return "-";
  const seconds = (Date.now() - Date.parse(iso)) / 1000;
  return `${span(seconds)} ago`;
}

function dueIn(iso) {
  if (!iso) return "";
  const seconds = (Date.parse(iso) - Date.now()) / 1000;
  return seconds <= 0 ? " (now)" : ` (in ${span(seconds)})`;
}

function span(seconds) {
  const s = Math.abs(seconds);
  if (s >= 86400) return `${(seconds / 86400).toFixed(0)}d`;
  if (s >= 3600) return `${(seconds / 3600).toFixed(0)}h`;
  if (s >= 60) return `${(seconds / 60).toFixed(0)}m`;
  return `${seconds.toFixed(0)}s`;
}

const clock = (iso) => new Date(iso).toLocaleTimeString([], { hour12: false });
const percent = (x) => `${Math.round((x || 0) * 100)} %`;

function holdBadges(control) {
  const hold = (control && control.operator) || {};
  const out = [];
  if (hold.paused) out.push(badge("paused", "paused"));
  for (const [backend, n] of Object.entries(hold.min_replicas || {})) out.push(badge(`${backend} ≥ ${n}`, "pinned"));
  return out;
}

// ---------------------------------------------------------------- the pool

async function poolPage() {
  const status = await api("/admin/status");
  const live = status.live || {};
  const heartbeats = live.heartbeats || {}, outlooks = live.outlooks || {};
  const used = {};
  for (const i of status.instances) used[i.worker_id] = (used[i.worker_id] || 0) + 1;
  const aliases = status.aliases.map((a) => {
    const outlook = outlooks[a.alias];
    const next = outlook ? (outlook.next.length ? outlook.next : [{ what: "nothing planned while the load stays as it is" }])
      : [{ what: "no controller is deciding (no outlook in the last 2 minutes)" }];
    return [
      el("a", { href: `#/alias/${encodeURIComponent(a.alias)}` }, a.alias),
      el("span", {}, badge(a.state), " ", holdBadges(status.control[a.alias])),
      ago(a.switched_at || a.updated_at),
      el("div", { class: "why" }, a.switch_reason || "-", outlook && outlook.metrics
        ? el("div", { class: "inputs" }, `now deciding on: ${describeWindow(outlook.metrics)}`) : null),
      el("div", {}, next.map((step) => el("div", {}, step.what + dueIn(step.at)))),
      percent(a.mix_weight),
      Object.entries(a.targets || {}).map(([b, n]) => `${b}=${n}`).join(", ") || "-",
    ];
  });
  const workers = status.workers.map((w) => [
    w.worker_id, w.host, badge(w.status), heartbeats[w.worker_id] ? ago(heartbeats[w.worker_id].at) : "never",
    w.gpu_memory_gb, `${used[w.worker_id] || 0} / ${w.slots}`, w.engines.join(", "),
  ]);
  render(
    el("h1", {}, "The pool"),
    el("p", { class: "sub" }, `namespace ${status.namespace} · read models at log position ${status.position}`
      + (live.error ? ` · live facts unavailable: ${live.error}` : "")),
    el("h2", {}, "Aliases"),
    table(["alias", "state", "since", "why", "what the controller does next", "to vLLM", "targets"], aliases),
    el("h2", {}, "Workers"),
    table(["worker", "host", "status", "heard", "GPU GB", "instances / slots", "engines"], workers),
  );
}

// The metric window a decision is made on, in a line.
function describeWindow(m) {
  const seconds = Math.max(1e-9, (Date.parse(m.window_end) - Date.parse(m.window_start)) / 1000);
  const ms = (s) => (s === null || s === undefined ? "-" : `${Math.round(s * 1000)} ms`);
  return `${(m.arrivals / seconds).toFixed(1)} arrivals/s, inflight ${m.inflight_fast.toFixed(1)} llama.cpp / `
    + `${m.inflight_slow.toFixed(1)} vLLM, queue ${m.queue_len.toFixed(1)}, TTFT p95 ${ms(m.ttft_p95_s)}, `
    + `E2E p95 ${ms(m.e2e_p95_s)} (${m.gateways} gateway${m.gateways === 1 ? "" : "s"}, ${seconds.toFixed(0)} s window)`;
}

// ---------------------------------------------------------------- one alias

const CHARTS = [
  { key: "arrivals", title: "arrivals / s", lines: [["arrivals_per_s", "arrivals", "#2f5fd0"]] },
  { key: "queue", title: "waiting at the gateways", lines: [["queue", "queue (avg)", "#8e44ad"], ["held", "held for a start", "#c0392b"]] },
  { key: "latency", title: "p95 latency (ms)", lines: [["ttft_p95_ms", "TTFT", "#2e8540"], ["e2e_p95_ms", "E2E", "#b7791f"]] },
  { key: "tokens", title: "tokens / s (decode)", lines: [["tokens_per_s", "tokens/s", "#1d1f23"]] },
  { key: "instances", title: "running instances per tier", lines: [["llama.cpp", "llama.cpp", TIER_COLORS["llama.cpp"]], ["vllm", "vllm", TIER_COLORS.vllm]] },
  { key: "mix", title: "share of traffic to vLLM", lines: [["mix_weight", "mix weight", "#5b2d91"]], max: 1 },
];

async function aliasPage(alias) {
  if (!page || page.alias !== alias) {
    page = { alias, points: [], tiers: [], after: null, range: (page && page.range) || "1h", drafts: {} };
  }
  const [status, series, history] = await Promise.all([
    api("/admin/status"),
    api(`/admin/aliases/${encodeURIComponent(alias)}/series` + (page.after ? `?after=${encodeURIComponent(page.after)}` : "")),
    api(`/admin/history/${encodeURIComponent(alias)}?limit=${TIMELINE_ROWS}&since=${encodeURIComponent(new Date(Date.now() - RANGES[page.range]).toISOString())}`),
  ]);
  // The charts: the gateways' windows as they come, and what the log says now, sampled at each refresh.
  page.points.push(...series.points);
  if (series.points.length) page.after = series.points[series.points.length - 1].at;
  const running = (tier) => ((series.now.instances[tier] || {}).RUNNING || 0);
  page.tiers.push({ at: new Date().toISOString(), "llama.cpp": running("llama.cpp"), vllm: running("vllm"), mix_weight: series.now.mix_weight });
  const horizon = Date.now() - CHART_SPAN_MS;
  page.points = page.points.filter((p) => Date.parse(p.at) >= horizon);
  page.tiers = page.tiers.filter((p) => Date.parse(p.at) >= horizon);

  const typing = document.activeElement && document.activeElement.tagName === "INPUT" && view.contains(document.activeElement);
  if (typing) { drawCharts(); return; }  // the operator is typing in the page: only the charts move
  const routing = status.aliases.find((a) => a.alias === alias);
  if (!routing) { render(el("h1", {}, alias), el("p", { class: "error" }, "No such alias.")); return; }
  const control = status.control[alias] || {};
  const hold = control.operator || {};
  const outlook = ((status.live || {}).outlooks || {})[alias];
  const statuses = {};
  for (const hb of Object.values((status.live || {}).heartbeats || {})) for (const s of hb.instances) statuses[s.instance_id] = s;

  const instances = status.instances.filter((i) => i.alias === alias).map((i) => {
    const s = statuses[i.instance_id] || {};
    const capacity = s.capacity ?? i.capacity;
    const actions = Object.entries(INSTANCE_ACTIONS)
      .filter(([, rule]) => rule.backends.includes(i.backend_type) && rule.states.includes(i.state))
      .flatMap(([name]) => name === "sleep"
        ? [1, 2].map((level) => el("button", { type: "button", "data-action": `sleep-${level}`, "data-instance": i.instance_id,
            onclick: () => act(`Sleep ${i.instance_id} at level ${level}`, `The vLLM engine keeps ${level === 1 ? "its weights in host memory" : "nothing on the GPU"}; its KV cache is dropped.`,
              `/admin/instances/${encodeURIComponent(i.instance_id)}/sleep`, { level }) }, `sleep ${level}`))
        : [el("button", { type: "button", class: name === "delete" ? "danger" : null, "data-action": name, "data-instance": i.instance_id,
            onclick: () => act(`${name[0].toUpperCase()}${name.slice(1)} ${i.instance_id}`, describeAction(name, i),
              `/admin/instances/${encodeURIComponent(i.instance_id)}/${name}`) }, name)]);
    return [
      el("span", { class: "mono" }, i.instance_id), i.backend_type,
      i.engine === "simulator" ? "simulator (simulated)" : i.engine, i.worker_id, badge(i.state),
      i.sleep_level || "-", `${s.inflight_requests ?? "-"} / ${capacity ?? "?"}`,
      s.kv_usage === undefined || s.kv_usage === null ? "-" : percent(s.kv_usage),
      s.healthy === undefined ? "-" : (s.healthy ? "yes" : "no"), ago(i.updated_at),
      el("span", {}, actions),
    ];
  });

  const backends = Object.keys((routing.config || {}).backends || {});
  const controls = el("div", { class: "controls" },
    el("div", { class: "group" },
      hold.paused
        ? [el("span", {}, badge("paused", "paused"), ` by ${hold.paused}`),
           el("button", { type: "button", id: "resume", onclick: () => act(`Resume the controller for ${alias}`,
             "The controller decides for this alias again from its next tick.", `/admin/aliases/${encodeURIComponent(alias)}/resume`) }, "resume")]
        : el("button", { type: "button", id: "pause", onclick: () => act(`Pause the controller for ${alias}`,
            "Nothing is switched, scaled or commanded for this alias until it is resumed; requests are still served by what runs.",
            `/admin/aliases/${encodeURIComponent(alias)}/pause`) }, "pause the controller")),
    backends.map((backend) => {
      const pinned = (hold.min_replicas || {})[backend];
      const configured = routing.config.backends[backend];
      // What the operator typed survives the page's refreshes.
      const input = el("input", { type: "number", min: 0, max: configured.max_replicas, "data-pin": backend,
        value: page.drafts[backend] ?? pinned ?? configured.min_replicas, oninput: (event) => { page.drafts[backend] = event.target.value; } });
      return el("div", { class: "group" }, `${backend} min replicas`, input,
        el("button", { type: "button", "data-pin-button": backend, onclick: () => act(`Pin ${alias}'s ${backend} minimum replicas to ${input.value}`,
          `Replaces the configured min_replicas (${configured.min_replicas}) until unpinned.`,
          `/admin/aliases/${encodeURIComponent(alias)}/pin`, { backend, min_replicas: Number(input.value) }) }, "pin"),
        pinned === undefined ? null : el("button", { type: "button", class: "quiet", onclick: () => act(`Unpin ${alias}'s ${backend} minimum replicas`,
          `Back to the configured min_replicas (${configured.min_replicas}).`, `/admin/aliases/${encodeURIComponent(alias)}/unpin`, { backend }) }, "unpin"));
    }));

  const charts = el("div", { class: "grid" }, CHARTS.map((c) => el("div", { class: "chart" },
    el("h3", {}, c.title),
    el("canvas", { id: `chart-${c.key}`, width: 600, height: 140 }),
    el("div", { class: "legend" }, c.lines.map(([, name, color]) => el("span", {}, el("i", { style: `background:${color}` }), name))))));

  const timeline = history.events.slice().reverse().map((e) => [
    clock(e.at), e.type,
    e.type === "PolicyDecided" || e.type === "RoutingStateChanged" || e.type === "MixWeightChanged"
      || e.type === "ScalingTargetsChanged" || e.type === "OperatorCommanded" || e.type === "PlacementFailed"
      ? el("a", { href: `#/event/${e.id}` }, e.summary) : e.summary,
  ]);
  const rowKind = (i) => {
    const type = history.events[history.events.length - 1 - i].type;
    return type === "OperatorCommanded" ? { class: "operator" } : type === "PolicyDecided" ? { class: "decision" } : {};
  };

  const lastSwitch = history.events.filter((e) => e.type === "RoutingStateChanged").pop();
  render(
    el("h1", {}, alias, " ", badge(routing.state), " ", holdBadges(control)),
    el("p", { class: "sub" }, `since ${ago(routing.switched_at || routing.updated_at)} · ${percent(routing.mix_weight)} of traffic to vLLM · `
      + `why: ${routing.switch_reason || "-"}`, lastSwitch ? [" · ", el("a", { href: `#/event/${lastSwitch.id}` }, "the switch and its inputs")] : null),
    outlook && outlook.metrics ? el("p", { class: "sub" }, `now deciding on: ${describeWindow(outlook.metrics)}`) : null,
    el("p", { class: "sub" }, outlook
      ? `next: ${(outlook.next.length ? outlook.next : [{ what: "nothing planned while the load stays as it is" }]).map((s) => s.what + dueIn(s.at)).join("; ")} · decided by ${outlook.leader} (${outlook.policy}) ${ago(outlook.at)}`
      : "next: no controller is deciding (no outlook in the last 2 minutes)"),
    el("h2", {}, "Operator"), controls,
    el("h2", {}, "Instances"),
    el("div", { id: "instances" }, table(["instance", "backend", "engine", "worker", "state", "sleep", "load / capacity", "KV", "healthy", "since", "actions"], instances)),
    el("h2", {}, "Live"), charts,
    el("h2", {}, "Timeline"),
    el("p", { class: "range" }, "range: ", Object.keys(RANGES).map((r) => el("a", {
      href: "#", class: r === page.range ? "active" : null, "data-range": r,
      onclick: (event) => { event.preventDefault(); page.range = r; refresh(); } }, r)),
      el("span", { class: "muted" }, history.total > history.events.length
        ? ` the last ${history.events.length} of ${history.total} events` : ` ${history.total} events`)),
    el("div", { id: "timeline" }, table(["time", "event", "what happened, and why"], timeline, rowKind)),
  );
  drawCharts();
}

function drawCharts() {
  for (const c of CHARTS) {
    const canvas = $(`#chart-${c.key}`);
    if (canvas) drawChart(canvas, ["instances", "mix"].includes(c.key) ? page.tiers : page.points, c);
  }
}

function describeAction(name, instance) {
  return {
    drain: "It takes no new request and is deleted once its requests are done (sessions bound to it move, KV first where the router hands over).",
    wake: "The vLLM engine loads back what its sleep level dropped and serves again.",
    delete: "Its engine is stopped now; requests on it fail over to another instance. The controller replaces it if the alias's targets want it.",
  }[name] + ` (${instance.backend_type} on ${instance.worker_id})`;
}

// A line chart on a canvas: time on x over the last ten minutes, every line of `chart` on one y scale.
function drawChart(canvas, points, chart) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600, height = canvas.clientHeight || 140;
  canvas.width = width * ratio; canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  const left = 44, right = 8, top = 8, bottom = 18;
  const now = Date.now(), from = now - CHART_SPAN_MS;
  const values = points.flatMap((p) => chart.lines.map(([key]) => p[key]).filter((v) => typeof v === "number"));
  const max = chart.max || Math.max(1e-9, ...values) * 1.15 || 1;
  const x = (t) => left + (t - from) / CHART_SPAN_MS * (width - left - right);
  const y = (v) => top + (1 - v / max) * (height - top - bottom);
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#6b7079"; g.strokeStyle = "#e3e4e0"; g.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    g.beginPath(); g.moveTo(left, y(max * f)); g.lineTo(width - right, y(max * f)); g.stroke();
    g.fillText(formatTick(max * f), 2, y(max * f) + 4);
  }
  for (const minutes of [10, 5, 0]) g.fillText(minutes ? `-${minutes}m` : "now", x(now - minutes * 60e3) - (minutes ? 8 : 20), height - 4);
  for (const [key, , color] of chart.lines) {
    g.strokeStyle = color; g.lineWidth = 1.6; g.beginPath();
    let drawing = false;
    for (const p of points) {
      const v = p[key];
      if (typeof v !== "number") { drawing = false; continue; }
      const px = x(Date.parse(p.at)), py = y(v);
      if (drawing) g.lineTo(px, py); else g.moveTo(px, py);
      drawing = true;
    }
    g.stroke();
  }
  canvas.dataset.points = String(points.length);
  canvas.dataset.drawnAt = String(now);
}

function formatTick(v) {
  if (v >= 1000) return `${(v / 1000).toFixed(1)}k`;
  return v >= 10 ? v.toFixed(0) : v.toFixed(v ? 2 : 0);
}

// ---------------------------------------------------------------- one event: a decision with its inputs

async function eventPage(id) {
  const e = await api(`/admin/events/${encodeURIComponent(id)}`);
  const alias = e.payload.alias;
  const parts = [
    el("h1", {}, e.type),
    el("p", { class: "sub" }, `${new Date(e.at).toLocaleString()} · log position ${e.position} · stream ${e.stream_id}`
      + (alias ? " · " : ""), alias ? el("a", { href: `#/alias/${encodeURIComponent(alias)}` }, alias) : null),
    el("dl", { class: "facts" }, el("dt", {}, "what happened"), el("dd", {}, e.summary),
      e.causation_id ? [el("dt", {}, "caused by"), el("dd", {}, el("a", { href: `#/event/${e.causation_id}` }, e.causation_id))] : null),
  ];
  if (e.type === "PolicyDecided") {
    const d = e.payload.decision, s = e.payload.snapshot;
    parts.push(
      el("h2", {}, "Decided"),
      el("dl", { class: "facts" },
        el("dt", {}, "targets"), el("dd", {}, d.targets_reason),
        el("dt", {}, "routing"), el("dd", {}, d.routing ? `${d.routing.from_state} → ${d.routing.to_state}: ${d.routing.reason}` : "unchanged"),
        el("dt", {}, "mix"), el("dd", {}, d.mix ? `${percent(d.mix.from_weight)} → ${percent(d.mix.to_weight)}: ${d.mix.reason}` : "unchanged"),
        el("dt", {}, "operator"), el("dd", {}, s.operator && s.operator.paused ? `paused by ${s.operator.paused}`
          : Object.keys((s.operator || {}).min_replicas || {}).length ? `pins ${JSON.stringify(s.operator.min_replicas)}` : "nothing asked")),
      el("h2", {}, "Commands"),
      table(["action", "instance", "worker", "why"], d.actions.map((a) => [a.action + (a.level ? ` ${a.level}` : ""), a.instance_id, a.worker_id, a.reason])),
      el("h2", {}, "Inputs: the metric window"),
      s.metrics ? el("dl", { class: "facts wide" }, Object.entries(s.metrics)
        .filter(([k, v]) => k !== "extra" && v !== null).flatMap(([k, v]) => [el("dt", {}, k.replaceAll("_", " ")), el("dd", {}, formatValue(v))]))
        : el("p", { class: "muted" }, "no window yet"),
      el("h2", {}, "Inputs: the instances"),
      table(["instance", "backend", "state", "inflight / capacity", "healthy", "worker"],
        s.instances.map((i) => [i.instance_id, i.backend, i.state, `${i.inflight} / ${i.capacity ?? "?"}`, i.healthy ? "yes" : "no", i.worker_id])),
    );
  } else if (Object.keys(e.inputs || {}).length) {
    parts.push(el("h2", {}, "Inputs"), el("pre", {}, JSON.stringify(e.inputs, null, 2)));
  }
  parts.push(el("h2", {}, "As recorded"), el("pre", {}, JSON.stringify(e.payload, null, 2)));
  render(...parts);
}

function formatValue(v) {
  if (typeof v === "number") return Number.isInteger(v) ? v : Number(v.toFixed(3));
  if (typeof v === "string" && /^\d{4}-\d\d-\d\dT/.test(v)) return clock(v);
  return v ?? "-";
}

// ---------------------------------------------------------------- sessions

async function sessionsPage() {
  const s = await api("/admin/sessions");
  render(
    el("h1", {}, "Sessions"),
    el("p", { class: "sub" }, "Conversations bound to an instance (routers that keep a session's KV where it is), and their moves."),
    el("h2", {}, `Bound (${s.sessions.length})`),
    table(["session", "alias", "instance", "bound", "moves", "last moved"], s.sessions.map((r) => [
      el("span", { class: "mono" }, r.session_id), el("a", { href: `#/alias/${encodeURIComponent(r.alias)}` }, r.alias),
      el("span", { class: "mono" }, r.instance_id), ago(r.bound_at), r.migrations, ago(r.last_migrated_at)])),
    el("h2", {}, "Moves in the last hour"),
    table(["time", "session", "from", "to", "why"], s.migrations.map((m) => [
      clock(m.at), el("span", { class: "mono" }, m.session_id), m.from_instance_id, m.to_instance_id, m.reason])),
  );
}

// ---------------------------------------------------------------- one request: why it went where it went

async function requestPage(id) {
  const found = await api(`/admin/requests/${encodeURIComponent(id)}`).catch((error) => ({ error: error.message }));
  if (found.error) {
    render(el("h1", {}, "Request ", el("span", { class: "mono" }, id)), el("p", { class: "error" }, found.error));
    return;
  }
  const r = found.record;
  render(
    el("h1", {}, "Request ", el("span", { class: "mono" }, id)),
    el("p", { class: "sub" }, "From this gateway's access log, as modelpool explain reads it."),
    el("pre", { id: "explained" }, found.explained),
    el("h2", {}, "As logged"),
    el("dl", { class: "facts wide" }, Object.entries(r).filter(([, v]) => v !== null && v !== "")
      .flatMap(([k, v]) => [el("dt", {}, k.replaceAll("_", " ")), el("dd", {}, k === "alias"
        ? el("a", { href: `#/alias/${encodeURIComponent(v)}` }, v) : formatValue(v))])),
  );
}

$("#explain-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const id = $("#explain-id").value.trim();
  $("#explain-id").value = "";
  if (id) location.hash = `#/request/${encodeURIComponent(id)}`;
});

// ---------------------------------------------------------------- routing between pages

function render(...nodes) {
  view.replaceChildren(...nodes.flat().filter(Boolean));
  view.dataset.rendered = String(Date.now());
}

function stop() { if (timer) clearTimeout(timer); timer = null; }

async function refresh() {
  stop();
  const hash = decodeURIComponent(location.hash.slice(1)) || "/";
  const [, where, what] = hash.split("/");
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.nav === (where || "pool"));
  try {
    if (where === "alias") await aliasPage(what);
    else if (where === "event") { page = null; await eventPage(what); return; }   // a record: it does not change
    else if (where === "request") { page = null; await requestPage(what); return; }
    else if (where === "sessions") { page = null; await sessionsPage(); }
    else { page = null; await poolPage(); }
    if ($("#banner").className !== "ok") banner("");
  } catch (error) {
    if (!token() || error.message === "the admin token was refused") return;
    banner(`Could not read the admin API: ${error.message}. Trying again.`);
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function route() {
  if (!token()) { signIn(); return; }
  window.scrollTo(0, 0);
  page = null;
  banner("");
  refresh();
}

window.addEventListener("hashchange", route);
route();
