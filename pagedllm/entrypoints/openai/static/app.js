// The pagedllm engine page: a chat playground over /v1/chat/completions (streamed) and a live
// view fed by /ui/events (engine snapshots) and /metrics (latency histograms). No libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const COLORS = { ".": "#e3e6ec", c: "#9ec5fe", u: "#2f7d4a", s: "#e0a100" };
const history = [];          // chat messages sent so far
const steps = new Map();     // step index -> record (newest STEP_KEEP kept)
const STEP_KEEP = 120;
const rates = [];            // [time, output tokens/s]
let lastCounters = null;
let model = null;
let events = null;

function apiKey() {
  const m = document.cookie.match(/(?:^|; )pagedllm_api_key=([^;]*)/);
  return m ? decodeURIComponent(m[1]) : "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

// ---- chat ------------------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function numberOr(id, fallback) {
  const v = $(id).value;
  return v === "" ? fallback : Number(v);
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || !model) return;
  $("prompt").value = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    temperature: numberOr("temperature", 0.7), top_p: numberOr("top_p", 1),
    top_k: numberOr("top_k", -1), max_tokens: numberOr("max_tokens", 256),
    messages: ($("system").value.trim() ? [{ role: "system", content: $("system").value.trim() }] : []).concat(history),
  };
  const seed = numberOr("seed", null);
  if (seed !== null) body.seed = seed;
  $("sendbtn").disabled = true;
  const t0 = performance.now();
  let tFirst = null, text_ = "", usage = null, finish = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: Object.assign({ "Content-Type": "application/json" }, authHeaders()),
      body: JSON.stringify(body),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const piece = (choice.delta && choice.delta.content) || "";
          if (piece) {
            if (tFirst === null) tFirst = performance.now();
            text_ += piece;
            out.textContent = text_;
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    history.push({ role: "assistant", content: text_ });
    const meta = document.createElement("span");
    meta.className = "meta";
    const t1 = performance.now();
    const n = usage ? usage.completion_tokens : 0;
    const speed = tFirst !== null && n > 1 ? ((n - 1) / ((t1 - tFirst) / 1000)).toFixed(1) : "–";
    meta.textContent = `${usage ? usage.prompt_tokens : "?"} prompt + ${n} completion tokens · ` +
      `first token ${tFirst !== null ? Math.round(tFirst - t0) : "–"} ms · ${speed} tok/s · ${finish || ""}`;
    out.appendChild(meta);
  } catch (e) {
    out.className = "msg error";
    out.textContent = "error: " + e.message;
    history.pop();
  } finally {
    $("sendbtn").disabled = false;
  }
}

// ---- live view ---------------------------------------------------------------------------------
function drawBlocks(map) {
  const c = $("blockmap"), g = c.getContext("2d");
  const n = map.length;
  // as many cells as fit; each cell shows the "busiest" state of the blocks it stands for
  const cells = Math.min(n, 2240);
  const per = n / cells;
  const cols = Math.ceil(Math.sqrt(cells * c.width / c.height));
  const size = Math.max(1, Math.floor(c.width / cols));
  const rank = { ".": 0, c: 1, u: 2, s: 3 };
  g.clearRect(0, 0, c.width, c.height);
  for (let i = 0; i < cells; i++) {
    let best = ".";
    for (let j = Math.floor(i * per); j < Math.max(Math.floor((i + 1) * per), Math.floor(i * per) + 1); j++) {
      if (rank[map[j]] > rank[best]) best = map[j];
    }
    g.fillStyle = COLORS[best];
    g.fillRect((i % cols) * size, Math.floor(i / cols) * size, Math.max(1, size - 1), Math.max(1, size - 1));
  }
}

function drawSteps(budget) {
  // one bar per step: prefill tokens below, decodes above; the scale follows the busiest step
  // shown (the budget, when a step comes near it, is the dashed line)
  const c = $("steps"), g = c.getContext("2d");
  const recs = Array.from(steps.values()).sort((a, b) => a.index - b.index).slice(-STEP_KEEP);
  g.clearRect(0, 0, c.width, c.height);
  const top = Math.max(8, ...recs.map((r) => r.tokens)) * 1.15;
  const w = c.width / STEP_KEEP, h = c.height - 12;
  recs.forEach((r, i) => {
    const pre = (r.prefill_tokens / top) * h, dec = (r.decodes / top) * h;
    g.fillStyle = "#6f42c1";
    g.fillRect(i * w, c.height - pre, Math.max(1, w - 1), pre);
    g.fillStyle = "#2f7d4a";
    g.fillRect(i * w, c.height - pre - dec, Math.max(1, w - 1), dec);
  });
  if (budget <= top) {
    const y = c.height - (budget / top) * h;
    g.setLineDash([4, 3]);
    g.strokeStyle = "#b3261e";
    g.beginPath(); g.moveTo(0, y); g.lineTo(c.width, y); g.stroke();
    g.setLineDash([]);
  }
  g.fillStyle = "#6b7385";
  g.fillText(`scale ${Math.round(top)} tokens`, 4, 10);
}

function drawLine(canvas, points) {
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (points.length < 2) return;
  const t0 = points[0][0], t1 = points[points.length - 1][0];
  const ymax = Math.max(1, ...points.map((p) => p[1]));
  g.strokeStyle = "#2f7d4a";
  g.beginPath();
  points.forEach(([t, y], i) => {
    const x = ((t - t0) / Math.max(t1 - t0, 1e-6)) * canvas.width;
    const yy = canvas.height - (y / ymax) * (canvas.height - 12);
    i ? g.lineTo(x, yy) : g.moveTo(x, yy);
  });
  g.stroke();
  g.fillStyle = "#6b7385";
  g.fillText(`max ${ymax.toFixed(0)}`, 4, 10);
}

function onSnapshot(s) {
  $("status").textContent = "live";
  $("model").textContent = s.model;
  $("device").textContent = `${s.device} · ${s.num_blocks} blocks × ${s.block_size} tokens`;
  $("q-running").textContent = s.queues.running;
  $("q-waiting").textContent = s.queues.waiting;
  $("q-swapped").textContent = s.queues.swapped;
  $("kv-usage").textContent = (100 * s.kv_cache_usage).toFixed(1) + "%";
  $("kv-frag").textContent = (100 * s.kv_fragmentation).toFixed(1) + "%";
  $("budget").textContent = s.max_num_batched_tokens;
  drawBlocks(s.block_map);
  for (const r of s.steps) steps.set(r.index, r);
  while (steps.size > STEP_KEEP) steps.delete(steps.keys().next().value);
  drawSteps(s.max_num_batched_tokens);
  if (lastCounters) {
    const dt = s.time - lastCounters.time;
    if (dt > 0) {
      const rate = (s.counters.generation_tokens - lastCounters.generation_tokens) / dt;
      rates.push([s.time, rate]);
      while (rates.length && rates[0][0] < s.time - 120) rates.shift();
      $("gen-rate").textContent = rate.toFixed(1);
      drawLine($("throughput"), rates);
    }
  }
  lastCounters = Object.assign({ time: s.time }, s.counters);
  const tbody = $("reqs").querySelector("tbody");
  tbody.innerHTML = "";
  for (const r of s.running) {
    const tr = document.createElement("tr");
    for (const v of [r.id, r.prompt_tokens, r.output_tokens, r.blocks, r.cached_tokens]) {
      const td = document.createElement("td");
      td.textContent = v;
      tr.appendChild(td);
    }
    tbody.appendChild(tr);
  }
}

// Prometheus text -> cumulative bucket counts of one histogram
function histogram(text, name) {
  const out = [];
  const re = new RegExp("^" + name.replace(/[:]/g, "\\:") + '_bucket\\{[^}]*le="([^"]+)"[^}]*\\} ([0-9.e+-]+)', "m");
  for (const line of text.split("\n")) {
    const m = line.match(re);
    if (m) out.push([m[1] === "+Inf" ? Infinity : Number(m[1]), Number(m[2])]);
  }
  return out;
}

function drawHist(canvas, buckets) {
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const counts = buckets.map((b, i) => b[1] - (i ? buckets[i - 1][1] : 0));
  const total = buckets.length ? buckets[buckets.length - 1][1] : 0;
  const ymax = Math.max(1, ...counts);
  const w = canvas.width / Math.max(counts.length, 1);
  g.fillStyle = "#6f42c1";
  counts.forEach((c, i) => {
    const h = (c / ymax) * (canvas.height - 14);
    g.fillRect(i * w, canvas.height - h, Math.max(1, w - 1), h);
  });
  // the P50 and P99 bucket bounds
  const q = (p) => { const b = buckets.find((x) => x[1] >= p * total); return b ? b[0] : NaN; };
  g.fillStyle = "#1d2330";
  g.fillText(total ? `n=${total} p50≤${q(0.5)}s p99≤${q(0.99)}s` : "no data", 2, 10);
}

async function pollMetrics() {
  try {
    const resp = await fetch("/metrics");
    if (resp.ok) {
      const text = await resp.text();
      drawHist($("h-ttft"), histogram(text, "pagedllm:time_to_first_token_seconds"));
      drawHist($("h-tpot"), histogram(text, "pagedllm:time_per_output_token_seconds"));
      drawHist($("h-itl"), histogram(text, "pagedllm:inter_token_latency_seconds"));
    }
  } catch (e) { /* the next poll tries again */ }
}

async function connect() {
  const probe = await fetch("/ui/state", { headers: authHeaders() });
  if (probe.status === 401) {
    $("status").textContent = "needs the API key";
    $("keybox").hidden = false;
    return;
  }
  $("keybox").hidden = true;
  onSnapshot(await probe.json());
  const models = await fetch("/v1/models", { headers: authHeaders() }).then((r) => r.json());
  model = models.data[0].id;
  if (events) events.close();
  events = new EventSource("/ui/events");
  events.onmessage = (ev) => onSnapshot(JSON.parse(ev.data));
  events.onerror = () => { $("status").textContent = "reconnecting…"; };
}

$("send").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) send(ev);
});
$("clear").addEventListener("click", () => { history.length = 0; $("messages").innerHTML = ""; });
$("keysave").addEventListener("click", () => {
  document.cookie = "pagedllm_api_key=" + encodeURIComponent($("apikey").value) + "; path=/; SameSite=Strict";
  connect();
});
connect();
setInterval(pollMetrics, 2000);
pollMetrics();
