"use strict";
// kvserve's page: the chat playground and the live engine view (docs/web-ui.md).
// Every call to the server carries the API key as "Authorization: Bearer" when the server needs one.
// The key is kept in this tab's sessionStorage only; it may also come once in the URL as #key=...
// (a fragment never reaches the server), which the page then removes from the address bar.

const $ = (id) => document.getElementById(id);
const WINDOW_STEPS = 120; // iterations the timeline shows, one column each
const MAX_ROWS = 48; // timeline rows at most
const MAX_REQUESTS = 300; // requests the table keeps
const MAX_LATENCIES = 1000; // finished requests the histograms cover
const HIST_BOUNDS_MS = [5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
// The live view's cost is the browser's, on the server's own cores when both run on one machine: it asks
// for one event every EVENTS_INTERVAL_MS and redraws at most once per event, only what the event changed;
// a hidden tab closes the feed and draws nothing (benchmarks/RESULTS.md, "Web page's live view").
const EVENTS_INTERVAL_MS = 500;

const state = {
  key: null,
  model: null,
  info: null, // the events stream's hello: pool size, limits
  following: false,
  lastIndex: 0,
  steps: [], // the last WINDOW_STEPS steps, oldest first
  requests: new Map(), // short id -> what the view saw of it, in first-seen order
  mine: new Set(), // short ids of the requests this page sent
  ttft: [],
  tpot: [],
  stats: {},
  dropped: 0,
  lastEventAt: 0,
  history: [], // chat turns sent so far
  answering: null, // AbortController of the answer being streamed
  feed: null, // AbortController of the open events stream
  drawPending: false,
  dirty: { steps: false, latencies: false }, // what changed since the last draw
  colors: null, // the stylesheet's colours, read once
};

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function authHeaders(extra = {}) {
  return state.key ? { ...extra, Authorization: `Bearer ${state.key}` } : extra;
}

// The live view's id of a request: 8 characters after its kind ("chatcmpl-1a2b3c4d..." -> "1a2b3c4d"),
// as the server's engine_events.short_id makes it.
function shortId(requestId) {
  const dash = requestId.indexOf("-");
  if (dash < 0) return requestId.slice(0, 12);
  const rest = requestId.slice(dash + 1);
  const next = rest.indexOf("-");
  return next < 0 ? rest.slice(0, 8) : rest.slice(0, Math.min(next, 8)) + rest.slice(next);
}

// Server-sent events from a fetch() response: {event, data} per event (comment lines skipped).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) yield { event, data: data.join("\n") };
    }
  }
}

// ---- the key and the connection ----

function loadKey() {
  const match = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (match) {
    sessionStorage.setItem("kvserve-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  state.key = sessionStorage.getItem("kvserve-key");
}

function showKeyForm(error) {
  $("key-form").hidden = false;
  $("key-error").textContent = error;
  $("model").textContent = "locked: no data without the key";
  $("key-input").focus();
}

async function connect() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: authHeaders(), cache: "no-store" });
  } catch (error) {
    $("model").textContent = "server unreachable, retrying…";
    setTimeout(connect, 2000);
    return;
  }
  if (response.status === 401) {
    showKeyForm(state.key ? "the server refused that key" : "");
    return;
  }
  if (!response.ok) {
    $("model").textContent = `the server answered ${response.status}`;
    return;
  }
  const card = (await response.json()).data[0];
  state.model = card.id;
  $("model").textContent = `${card.id} · context ${card.max_model_len} tokens`;
  $("key-form").hidden = true;
  followEngine();
}

// ---- the live view: the events stream ----

function setFeed(on, note) {
  const pill = $("feed-status");
  pill.textContent = on ? "live view: on" : `live view: ${note}`;
  pill.classList.toggle("on", on);
}

// Resolves when the tab is visible (at once if it is).
function whenVisible() {
  return new Promise((resolve) => {
    const check = () => {
      if (document.hidden) return;
      document.removeEventListener("visibilitychange", check);
      resolve();
    };
    document.addEventListener("visibilitychange", check);
    check();
  });
}

// Follows the events stream while the tab is visible; hiding the tab closes the stream (init's
// visibilitychange handler aborts it) and showing it again opens a new one.
async function followEngine() {
  if (state.following) return;
  state.following = true;
  for (;;) {
    if (document.hidden) {
      setFeed(false, "paused while the tab is hidden");
      await whenVisible();
    }
    state.feed = new AbortController();
    try {
      const response = await fetch(`/v1/engine/events?interval_ms=${EVENTS_INTERVAL_MS}`, {
        headers: authHeaders(),
        cache: "no-store",
        signal: state.feed.signal,
      });
      if (response.status === 401) {
        state.following = false;
        showKeyForm("the server refused the key");
        return;
      }
      if (response.status === 404) {
        const body = await response.json().catch(() => null);
        setFeed(false, "off");
        $("live-note").textContent = body?.error?.message ?? "not available on this server";
        state.following = false;
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setFeed(true);
      for await (const event of sseEvents(response)) {
        if (event.event === "hello") onHello(JSON.parse(event.data));
        else if (event.event === "steps") onSteps(JSON.parse(event.data));
      }
    } catch (error) {
      // the stream broke (server restarting, network) or the tab was hidden: try again below
    }
    state.feed = null;
    if (document.hidden) continue;
    setFeed(false, "reconnecting");
    await sleep(2000);
  }
}

function onHello(info) {
  // A new stream starts from the ring's newest steps: what was seen before is dropped, not counted twice.
  state.info = info;
  state.lastIndex = 0;
  state.steps = [];
  state.requests.clear();
  state.ttft = [];
  state.tpot = [];
  state.dropped = 0;
  scheduleDraw({ steps: true, latencies: true });
}

function requestAggregate(id, index) {
  let agg = state.requests.get(id);
  if (!agg) {
    agg = { id, first: index, last: index, steps: 0, prefill: 0, decode: 0, accepted: 0, ttft: null, tpot: null, finished: false };
    state.requests.set(id, agg);
    if (state.requests.size > MAX_REQUESTS) state.requests.delete(state.requests.keys().next().value);
  }
  return agg;
}

function onSteps(payload) {
  state.lastEventAt = Date.now();
  state.stats = payload.stats;
  state.dropped += payload.dropped;
  let finished = false;
  for (const step of payload.steps) {
    if (step.i <= state.lastIndex) continue;
    state.lastIndex = step.i;
    state.steps.push(step);
    const seen = new Set();
    for (const [id, , prefill, decode, accepted] of step.s) {
      const agg = requestAggregate(id, step.i);
      if (!seen.has(id)) agg.steps += 1;
      seen.add(id);
      agg.last = step.i;
      agg.prefill += prefill;
      agg.decode += decode;
      agg.accepted += accepted;
    }
    for (const [id, ttft, tpot] of step.f) {
      finished = true;
      const agg = requestAggregate(id, step.i);
      Object.assign(agg, { finished: true, ttft, tpot });
      if (ttft !== null) state.ttft.push(ttft);
      if (tpot !== null) state.tpot.push(tpot);
    }
  }
  if (state.steps.length > WINDOW_STEPS) state.steps.splice(0, state.steps.length - WINDOW_STEPS);
  if (state.ttft.length > MAX_LATENCIES) state.ttft.splice(0, state.ttft.length - MAX_LATENCIES);
  if (state.tpot.length > MAX_LATENCIES) state.tpot.splice(0, state.tpot.length - MAX_LATENCIES);
  scheduleDraw({ steps: true, latencies: finished });
}

// Marks what changed and draws it in the next animation frame: the events that arrive before it are
// drawn together, and a part nothing changed in is not drawn again.
function scheduleDraw(changed) {
  state.dirty.steps ||= changed.steps;
  state.dirty.latencies ||= changed.latencies;
  if (state.drawPending) return;
  state.drawPending = true;
  requestAnimationFrame(() => {
    state.drawPending = false;
    const { steps, latencies } = state.dirty;
    state.dirty = { steps: false, latencies: false };
    // The canvases first: they read their width before the cards and the table change the layout.
    if (steps) drawTimeline();
    if (latencies) {
      drawHistogram($("ttft-hist"), $("ttft-caption"), "TTFT", state.ttft);
      drawHistogram($("tpot-hist"), $("tpot-caption"), "TPOT", state.tpot);
    }
    if (steps) {
      drawCards();
      drawTable();
    }
    drawNote();
  });
}

// ---- the live view: drawing ----

const pct = (part, whole) => (whole > 0 ? `${((100 * part) / whole).toFixed(1)} %` : "–");

// The stylesheet's colours by name (--prefill -> colors().prefill), read once.
function colors() {
  if (!state.colors) {
    const style = getComputedStyle(document.documentElement);
    const names = ["prefill", "decode", "draft", "you", "dim"];
    state.colors = Object.fromEntries(names.map((name) => [name, style.getPropertyValue(`--${name}`).trim()]));
  }
  return state.colors;
}

// DOM writes only where the value changes: an unchanged write still costs the browser a layout.
function setText(element, text) {
  if (element.textContent !== text) element.textContent = text;
}

function setStyle(element, property, value) {
  if (element.style[property] !== value) element.style[property] = value;
}

function drawCards() {
  const steps = state.steps;
  const last = steps[steps.length - 1];
  if (!last) return;
  const first = steps[0];
  const mean = (f) => (steps.reduce((sum, s) => sum + f(s), 0) / steps.length).toFixed(1);
  setText($("g-batch"), `${last.s.length} (avg ${mean((s) => s.s.length)})`);
  setText($("g-tokens"), `${last.n} (avg ${mean((s) => s.n)})`);
  const spanS = (last.t + last.d - first.t) / 1000;
  setText($("g-steps"), spanS > 0 ? (steps.length / spanS).toFixed(1) : "–");
  setText($("g-tps"), spanS > 0 ? (steps.reduce((sum, s) => sum + s.n, 0) / spanS).toFixed(0) : "–");
  setText($("g-waiting"), String(last.w));
  const [queries, hits] = last.pc;
  const [q0, h0] = first.pc;
  setText($("g-prefix"), `${pct(hits - h0, queries - q0)} (all ${pct(hits, queries)})`);
  if (state.info && !state.info.speculative) setText($("g-spec"), "off");
  else setText($("g-spec"), `${pct(last.sp[1] - first.sp[1], last.sp[0] - first.sp[0])} (all ${pct(last.sp[1], last.sp[0])})`);
  const [used, cached, free] = last.kv;
  const total = state.info?.kv_blocks_total ?? used + free;
  setText($("g-kv"), `used ${used} · cached ${cached} · free ${free} of ${total}`);
  setStyle($("kv-used"), "width", `${(100 * used) / total}%`);
  setStyle($("kv-cached"), "width", `${(100 * cached) / total}%`);
}

// The note beside the title: steps the bounded stream left out, and "idle" when no step came for 2 s.
function drawNote() {
  if (!state.steps.length) return;
  const idle = Date.now() - state.lastEventAt > 2000 ? " idle" : "";
  setText($("live-note"), (state.dropped ? `(${state.dropped} steps skipped to keep the stream bounded)` : "") + idle);
}

function fitCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600;
  setStyle(canvas, "height", `${cssHeight}px`);
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(cssHeight * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, cssHeight);
  ctx.font = "11px system-ui, sans-serif";
  return [ctx, width];
}

function rowKey(id, sample) {
  return sample ? `${id}/${sample}` : id;
}

function drawTimeline() {
  const canvas = $("timeline");
  const steps = state.steps;
  const rows = new Map();
  for (const step of steps) for (const [id, sample] of step.s) if (!rows.has(rowKey(id, sample))) rows.set(rowKey(id, sample), id);
  // The rows that started last, and the page's own requests whenever they are in the window.
  let keys = [...rows.keys()];
  const mine = keys.filter((key) => state.mine.has(rows.get(key)));
  const others = keys.filter((key) => !state.mine.has(rows.get(key)));
  const shown = new Set([...mine.slice(-MAX_ROWS), ...others.slice(-Math.max(MAX_ROWS - mine.length, 0))]);
  const hidden = keys.length - shown.size;
  keys = keys.filter((key) => shown.has(key));
  const rowIndex = new Map(keys.map((key, i) => [key, i]));
  const rowH = keys.length > 20 ? 9 : 14;
  const top = 16;
  const chartH = 64;
  const height = top + Math.max(keys.length, 4) * rowH + 10 + chartH + 16;
  const [ctx, width] = fitCanvas(canvas, height);
  const labelW = 84;
  // Columns: the window, or fewer (wider) while fewer steps have run; the newest step is always rightmost.
  const columns = Math.min(WINDOW_STEPS, Math.max(steps.length, 40));
  const colW = (width - labelW - 4) / columns;
  const x0 = labelW + (columns - steps.length) * colW;
  const gap = colW > 4 ? 1 : 0;
  const { prefill: cPrefill, decode: cDecode, draft: cDraft, you: cYou, dim: cDim } = colors();

  ctx.fillStyle = cDim;
  ctx.fillText(steps.length ? `iterations ${steps[0].i}–${steps[steps.length - 1].i}` : "no iterations yet: send a message", labelW, 11);
  if (hidden) ctx.fillText(`+${hidden} older rows not shown`, width - 150, 11);
  for (const key of keys) {
    const y = top + rowIndex.get(key) * rowH;
    ctx.fillStyle = state.mine.has(rows.get(key)) ? cYou : cDim;
    ctx.fillText(state.mine.has(rows.get(key)) ? `${key} (you)` : key, 2, y + rowH - 2);
  }
  steps.forEach((step, j) => {
    const x = x0 + j * colW;
    for (const [id, sample, prefill, decode, accepted] of step.s) {
      const row = rowIndex.get(rowKey(id, sample));
      if (row === undefined) continue;
      const y = top + row * rowH;
      if (prefill) {
        ctx.fillStyle = cPrefill;
        ctx.fillRect(x, y, colW - gap, rowH - 1);
        if (colW >= 16 && rowH >= 12) {
          ctx.fillStyle = "#fff";
          ctx.fillText(String(prefill), x + 1, y + rowH - 3);
        }
      } else {
        ctx.fillStyle = cDecode;
        ctx.fillRect(x, y, colW - gap, rowH - 1);
        if (accepted) {
          ctx.fillStyle = cDraft;
          const w = ((colW - gap) * accepted) / decode;
          ctx.fillRect(x + colW - gap - w, y, w, rowH - 1);
        }
      }
    }
    for (const [id] of step.f) {
      const row = rowIndex.get(id);
      if (row === undefined) continue;
      ctx.fillStyle = "#000";
      ctx.fillRect(x + colW - gap - 1, top + row * rowH, 1.5, rowH - 1);
    }
  });

  // Tokens per step (stacked prefill / decode) on a square-root scale, so that one-token decode steps
  // stay visible beside a long prefill; the batch size (line) on a linear one; the same columns.
  const base = top + Math.max(keys.length, 4) * rowH + 10 + chartH;
  const maxTokens = Math.max(1, ...steps.map((s) => s.n));
  const maxBatch = Math.max(1, ...steps.map((s) => s.s.length));
  steps.forEach((step, j) => {
    const x = x0 + j * colW;
    const prefill = step.s.reduce((sum, s) => sum + s[2], 0);
    const hAll = chartH * Math.sqrt(step.n / maxTokens);
    const hPrefill = step.n ? (hAll * prefill) / step.n : 0;
    const hDecode = hAll - hPrefill;
    ctx.fillStyle = cPrefill;
    ctx.fillRect(x, base - hPrefill, colW - gap, hPrefill);
    ctx.fillStyle = cDecode;
    ctx.fillRect(x, base - hPrefill - hDecode, colW - gap, hDecode);
  });
  ctx.strokeStyle = cYou;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  steps.forEach((step, j) => {
    const x = x0 + (j + 0.5) * colW;
    const y = base - (chartH * step.s.length) / maxBatch;
    if (j) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = cDim;
  ctx.fillText(`tokens/step ≤ ${maxTokens} (√)`, 2, base - chartH + 10);
  ctx.fillStyle = cYou;
  ctx.fillText(`batch ≤ ${maxBatch}`, 2, base - chartH + 24);
  ctx.fillStyle = cDim;
  ctx.fillText("iteration", 2, base + 12);
  const stride = [1, 2, 5, 10, 20, 50, 100].find((n) => n * colW >= 36) ?? 100;
  steps.forEach((step, j) => {
    if (step.i % stride === 0) ctx.fillText(String(step.i), x0 + j * colW, base + 12);
  });
}

function quantile(sorted, q) {
  return sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] : null;
}

function drawHistogram(canvas, caption, name, values) {
  const [ctx, width] = fitCanvas(canvas, 150);
  const counts = new Array(HIST_BOUNDS_MS.length + 1).fill(0);
  for (const v of values) {
    const bucket = HIST_BOUNDS_MS.findIndex((bound) => v < bound);
    counts[bucket < 0 ? HIST_BOUNDS_MS.length : bucket] += 1;
  }
  const labels = HIST_BOUNDS_MS.map((b, i) => `<${b >= 1000 ? `${b / 1000}s` : b}`).concat([`≥${HIST_BOUNDS_MS.at(-1) / 1000}s`]);
  const maxCount = Math.max(1, ...counts);
  const barW = (width - 10) / counts.length;
  const plotH = 110;
  counts.forEach((count, i) => {
    const h = (plotH * count) / maxCount;
    ctx.fillStyle = name === "TTFT" ? colors().prefill : colors().decode;
    ctx.fillRect(5 + i * barW, 10 + plotH - h, barW - 2, h);
    ctx.fillStyle = colors().dim;
    if (count) ctx.fillText(String(count), 5 + i * barW, 8 + plotH - h);
    ctx.fillText(labels[i], 5 + i * barW, 10 + plotH + 14);
  });
  const sorted = [...values].sort((a, b) => a - b);
  const p50 = quantile(sorted, 0.5);
  const p90 = quantile(sorted, 0.9);
  setText(
    caption,
    sorted.length
      ? `${name} of ${sorted.length} finished requests (ms): p50 ${p50.toFixed(1)}, p90 ${p90.toFixed(1)}`
      : `${name}: no finished requests yet`,
  );
}

const TABLE_ROWS = 24; // the newest requests the table shows
const TABLE_FIELDS = ["id", "steps", "prefill", "decode", "accepted", "ttft", "tpot", "state"];

// The table keeps its rows and cells and rewrites only the texts that changed.
function drawTable() {
  const body = $("requests").tBodies[0];
  const latest = state.lastIndex;
  const rows = [...state.requests.values()].slice(-TABLE_ROWS).reverse();
  const fmt = (v) => (v === null ? "–" : v.toFixed(1));
  while (body.rows.length > rows.length) body.lastElementChild.remove();
  while (body.rows.length < rows.length) {
    const tr = document.createElement("tr");
    for (const name of TABLE_FIELDS) {
      const td = document.createElement("td");
      td.dataset.field = name;
      tr.append(td);
    }
    body.append(tr);
  }
  rows.forEach((agg, r) => {
    const tr = body.rows[r];
    if (tr.dataset.request !== agg.id) tr.dataset.request = agg.id;
    const you = state.mine.has(agg.id);
    if (tr.classList.contains("you") !== you) tr.classList.toggle("you", you);
    const status = agg.finished ? "finished" : latest - agg.last > 50 ? "not seen lately" : "running";
    const cells = [agg.id, agg.steps, agg.prefill, agg.decode, agg.accepted, fmt(agg.ttft), fmt(agg.tpot), status];
    cells.forEach((value, i) => setText(tr.cells[i], String(value)));
  });
}

// ---- the playground ----

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const content = document.createElement("span");
  content.className = "content";
  content.textContent = text;
  div.append(content);
  $("chat-log").append(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

function samplingFields() {
  const number = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
  const fields = {
    temperature: number("temperature"),
    top_p: number("top_p"),
    max_tokens: number("max_tokens"),
    seed: number("seed"),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) fields.stop = stop;
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined));
}

function showUsage(answer, usage, ttftMs, tpotMs, note) {
  const line = document.createElement("span");
  line.className = "usage";
  const parts = [];
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`prompt ${usage.prompt_tokens}`, `cached ${cached}`, `completion ${usage.completion_tokens}`);
    Object.assign(line.dataset, { promptTokens: usage.prompt_tokens, cachedTokens: cached, completionTokens: usage.completion_tokens });
  }
  if (ttftMs !== null) parts.push(`TTFT ${ttftMs.toFixed(0)} ms`);
  if (tpotMs !== null) parts.push(`TPOT ${tpotMs.toFixed(1)} ms`);
  if (answer.dataset.request) parts.push(`request ${answer.dataset.request}`);
  if (note) parts.push(note);
  line.textContent = parts.join(" · ");
  answer.append(line);
}

async function send(text) {
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const content = answer.querySelector(".content");
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value.trim() });
  messages.push(...state.history, { role: "user", content: text });
  const body = { model: state.model ?? undefined, messages, stream: true, stream_options: { include_usage: true }, ...samplingFields() };
  const controller = new AbortController();
  state.answering = controller;
  $("send").disabled = true;
  $("stop-answer").disabled = false;
  const start = performance.now();
  let first = null;
  let last = null;
  let usage = null;
  let note = "";
  let reply = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response.status === 401) showKeyForm("the server refused the key");
    if (!response.ok) {
      const error = await response.json().catch(() => null);
      throw new Error(error?.error?.message ?? `the server answered ${response.status}`);
    }
    for await (const event of sseEvents(response)) {
      if (event.data === "[DONE]") break;
      const chunk = JSON.parse(event.data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.id && !answer.dataset.request) {
        answer.dataset.request = shortId(chunk.id);
        state.mine.add(answer.dataset.request);
      }
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        const now = performance.now();
        first ??= now;
        last = now;
        reply += choice.delta.content;
        content.textContent = reply;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
      if (choice?.finish_reason) {
        note = `finish: ${choice.finish_reason}`;
        last = performance.now(); // a stop token brings no text but is one of the outputs
      }
      if (chunk.usage) usage = chunk.usage;
    }
    answer.dataset.done = "true";
  } catch (error) {
    if (error.name === "AbortError") note = "stopped";
    else {
      answer.classList.add("error");
      content.textContent = reply + (reply ? "\n" : "") + error.message;
      note = "failed";
    }
  } finally {
    state.answering = null;
    $("send").disabled = false;
    $("stop-answer").disabled = true;
  }
  if (reply) state.history.push({ role: "user", content: text }, { role: "assistant", content: reply });
  const ttft = first === null ? null : first - start;
  const outputs = usage?.completion_tokens ?? 0;
  const tpot = first !== null && outputs > 1 ? (last - first) / (outputs - 1) : null;
  showUsage(answer, usage, ttft, tpot, note);
}

function init() {
  loadKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("key-input").value;
    sessionStorage.setItem("kvserve-key", state.key);
    connect();
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.answering) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop-answer").addEventListener("click", () => state.answering?.abort());
  $("clear-chat").addEventListener("click", () => {
    state.history = [];
    $("chat-log").replaceChildren();
  });
  document.addEventListener("visibilitychange", () => document.hidden && state.feed?.abort());
  setInterval(drawNote, 1000);
  connect();
}

init();
