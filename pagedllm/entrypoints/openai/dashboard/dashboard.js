// pagedllm dashboard: polls /dashboard/state and draws it. Plain JS, no framework, no
// build step. The server samples the engine (the KV grid at most a few times a second,
// shared by every open page); this page only asks every POLL_MS while visible.
"use strict";
(function () {
  const STATE_URL = "/dashboard/state";
  const POLL_MS = 500;
  const HIDDEN_POLL_MS = 5000;  // a background tab asks rarely
  const KEY_STORAGE = "pagedllm-dashboard-key";
  // Block states of core/kv_snapshot.py: 4 + k is "in use by request k alone".
  const FREE = 0, CACHED = 1, NULL = 2, SHARED = 3, FIRST_REQ = 4;

  const $ = (id) => document.getElementById(id);
  const cssVar = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

  let apiKey = takeKey();
  let lastT = null;        // newest history point received (server monotonic time)
  let points = [];         // history points, oldest first
  let latest = null;       // the last state
  let grid = null;         // the drawn snapshot: {states: Uint16Array, reqIds, held, cell, cols, ...}
  let numUpdates = 0;

  // ------------------------------------------------------------------ API key

  function takeKey() {
    // "#key=KEY": a fragment never reaches the server or its logs.
    const m = location.hash.match(/key=([^&]+)/);
    if (m) {
      sessionStorage.setItem(KEY_STORAGE, decodeURIComponent(m[1]));
      window.history.replaceState(null, "", location.pathname);
    }
    return sessionStorage.getItem(KEY_STORAGE);
  }

  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    apiKey = $("key-input").value;
    sessionStorage.setItem(KEY_STORAGE, apiKey);
    $("key-form").hidden = true;
  });

  function setStatus(state, text) {
    const el = $("status");
    el.dataset.state = state;
    el.textContent = text;
  }

  // ------------------------------------------------------------------ polling

  async function poll() {
    try {
      const url = STATE_URL + (lastT === null ? "" : "?since=" + lastT);
      const headers = apiKey ? { Authorization: "Bearer " + apiKey } : {};
      const r = await fetch(url, { headers, cache: "no-store" });
      if (r.status === 401) {
        $("key-form").hidden = false;
        setStatus("error", "API key needed");
      } else if (!r.ok) {
        setStatus("error", "HTTP " + r.status);
      } else {
        update(await r.json());
      }
    } catch (e) {
      setStatus("error", "server unreachable");
    }
    setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  function update(s) {
    latest = s;
    for (const p of s.history) points.push(p);
    if (s.history.length) lastT = s.history[s.history.length - 1].t;
    const keep = s.now - 600;
    while (points.length && points[0].t < keep) points.shift();
    $("model").textContent = s.model;
    setStatus(s.engine_alive ? "live" : "error", s.engine_alive ? "live" : "engine down");
    drawCounters(s);
    if (s.kv) drawGrid(s.kv);
    if (s.history.length) drawCharts();  // new points come once a second
    drawTimeline(s);
    numUpdates += 1;
    document.body.dataset.updates = numUpdates;
  }

  // ------------------------------------------------------------------ counters

  function setCounter(id, value, text) {
    const el = $(id);
    el.dataset.value = value === null || value === undefined ? "" : value;
    el.textContent = text === undefined ? (value === null ? "–" : value) : text;
  }

  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");

  function drawCounters(s) {
    const st = s.stats, kv = s.kv;
    setCounter("c-running", st.num_running ?? null);
    setCounter("c-waiting", st.num_waiting ?? null);
    setCounter("c-swapped", st.num_swapped ?? null);
    if (kv) {
      setCounter("c-kv-in-use", kv.num_in_use);
      setCounter("c-kv-cached", kv.num_cached);
      setCounter("c-kv-free", kv.num_free);
      $("c-kv-usage").textContent = pct(kv.num_in_use / Math.max(1, kv.num_blocks - 1)) +
        " of " + (kv.num_blocks - 1) + " blocks";
    }
    setCounter("c-hit-rate", st.prefix_cache_hit_rate ?? null, pct(st.prefix_cache_hit_rate));
    const recentHits = points.filter((p) => p.t > s.now - 60 && p.hit_rate !== null);
    $("c-hit-rate-recent").textContent = recentHits.length
      ? pct(mean(recentHits.map((p) => p.hit_rate))) + " last 60 s" : "cumulative";
    const recent = points.filter((p) => p.t > s.now - 10);
    const tps = recent.length ? mean(recent.map((p) => p.generation_tps)) : null;
    setCounter("c-throughput", tps === null ? null : +tps.toFixed(1));
    const ttfts = s.requests.filter((r) => r.first_token !== null && r.first_token > s.now - 60)
      .map((r) => r.first_token - r.arrival);
    const ttft = ttfts.length ? mean(ttfts) : null;
    setCounter("c-ttft", ttft === null ? null : +ttft.toFixed(3),
               ttft === null ? "–" : fmtSeconds(ttft));
    setCounter("c-finished", st.num_finished);
    setCounter("c-tokens", st.num_generation_tokens, st.num_generation_tokens + " tokens generated");
  }

  const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const fmtSeconds = (x) => (x < 1 ? (1000 * x).toFixed(0) + " ms" : x.toFixed(2) + " s");

  // Resizing a canvas reallocates and repaints it: only when its size changes.
  function fitCanvas(canvas, w, h) {
    if (canvas.width !== w) canvas.width = w;
    if (canvas.height !== h) {
      canvas.height = h;
      canvas.style.height = h + "px";
    }
  }

  // ------------------------------------------------------------------ KV grid

  // A request keeps its colour from snapshot to snapshot: the hue comes from its id.
  function hueOf(id) {
    let h = 2166136261;
    for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619);
    return ((h >>> 0) * 0.618033988749895 % 1) * 360;
  }
  function hslToRgb(h, s, l) {
    const k = (n) => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
    const f = (n) => l - a * Math.max(-1, Math.min(k(n) - 3, 9 - k(n), 1));
    return [Math.round(255 * f(0)), Math.round(255 * f(8)), Math.round(255 * f(4))];
  }
  const reqColor = (id) => hslToRgb(hueOf(id), 0.7, 0.5);
  function hexToRgb(hex) {
    const v = parseInt(hex.replace("#", ""), 16);
    return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
  }

  function decodeStates(b64) {
    const bin = atob(b64);
    const out = new Uint16Array(bin.length >> 1);
    for (let i = 0; i < out.length; i++) out[i] = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    return out;
  }

  function drawGrid(kv) {
    const canvas = $("kv-grid");
    if (String(kv.seq) === canvas.dataset.seq) return;  // the same snapshot as before
    const width = Math.max(100, canvas.clientWidth);
    if (grid && kv.states === grid.b64 && width === grid.width &&
        kv.req_ids.join() === grid.reqIds.join()) {
      canvas.dataset.seq = kv.seq;  // a new snapshot of an unchanged pool: nothing to draw
      return;
    }
    const states = decodeStates(kv.states);
    const n = states.length;
    // The largest cell (2..16 px) that fits every block in about 420 px of height.
    let cell = 16;
    while (cell > 2 && Math.ceil(n / Math.floor(width / cell)) * cell > 420) cell--;
    const cols = Math.max(1, Math.floor(width / cell)), rows = Math.ceil(n / cols);
    fitCanvas(canvas, width, rows * cell);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(width, rows * cell);
    const fixed = [cssVar("--free"), cssVar("--cached"), cssVar("--null"), cssVar("--shared")]
      .map(hexToRgb);
    const palette = kv.req_ids.map(reqColor);
    const gap = cell >= 5 ? 1 : 0;
    let inUse = 0, cached = 0, free = 0, shared = 0;
    for (let b = 0; b < n; b++) {
      const v = states[b];
      if (v >= SHARED) inUse++; else if (v === CACHED) cached++; else if (v === FREE) free++;
      if (v === SHARED) shared++;
      const rgb = v >= FIRST_REQ ? palette[v - FIRST_REQ] : fixed[v];
      const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
      for (let y = y0; y < y0 + cell - gap; y++) {
        let o = 4 * (y * width + x0);
        for (let x = 0; x < cell - gap; x++, o += 4) {
          img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
        }
      }
    }
    ctx.putImageData(img, 0, 0);
    Object.assign(canvas.dataset, { seq: kv.seq, blocks: n, inUse, cached, free, shared });
    grid = { states, reqIds: kv.req_ids, held: kv.num_held_blocks, cell, cols, width, b64: kv.states };
    $("kv-note").textContent = n + " blocks of " + kv.block_size + " tokens, " +
      kv.req_ids.length + " requests holding blocks; snapshot #" + kv.seq + " (built in " +
      (1000 * kv.build_s).toFixed(2) + " ms)";
  }

  $("kv-grid").addEventListener("mousemove", (e) => {
    if (!grid) return;
    const r = e.target.getBoundingClientRect();
    const b = Math.floor((e.clientY - r.top) / grid.cell) * grid.cols +
      Math.floor((e.clientX - r.left) / grid.cell);
    if (b < 0 || b >= grid.states.length) return;
    const v = grid.states[b];
    const what = v >= FIRST_REQ
      ? "in use by " + grid.reqIds[v - FIRST_REQ] + " (" + grid.held[v - FIRST_REQ] + " blocks)"
      : ["free", "cached (evictable)", "null block", "shared by several requests"][v];
    $("kv-hover").textContent = "block " + b + ": " + what;
  });

  // ------------------------------------------------------------------ charts

  function drawChart(id, series, opts) {
    const canvas = $(id), ctx = canvas.getContext("2d");
    const w = Math.max(100, canvas.clientWidth), h = canvas.height;
    fitCanvas(canvas, w, h);
    const windowS = +$("window").value, now = latest.now;
    const pad = { l: 42, r: 6, t: 6, b: 16 };
    const pts = points.filter((p) => p.t >= now - windowS);
    let max = opts.max || 0;
    if (!opts.max) for (const s of series) for (const p of pts) if (p[s.key] !== null) max = Math.max(max, s.scale ? s.scale * p[s.key] : p[s.key]);
    max = max > 0 ? max * 1.1 : 1;
    const X = (t) => pad.l + (w - pad.l - pad.r) * (1 - (now - t) / windowS);
    const Y = (v) => h - pad.b - (h - pad.t - pad.b) * v / max;
    ctx.clearRect(0, 0, w, h);
    ctx.strokeStyle = cssVar("--line"); ctx.fillStyle = cssVar("--muted");
    ctx.font = "10px system-ui"; ctx.lineWidth = 1;
    for (const f of [0, 0.5, 1]) {
      const v = max / 1.1 * f, y = Y(v);
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
      ctx.fillText(v >= 100 ? v.toFixed(0) : v.toPrecision(2), 2, y + 3);
    }
    ctx.fillText("-" + windowS + " s", pad.l, h - 3);
    ctx.fillText("now", w - pad.r - 18, h - 3);
    for (const s of series) {
      ctx.strokeStyle = ctx.fillStyle = cssVar(s.color); ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      for (const p of pts) {
        if (p[s.key] === null) { pen = false; continue; }
        const x = X(p.t), y = Y(s.scale ? s.scale * p[s.key] : p[s.key]);
        if (s.dots) { ctx.fillRect(x - 1.5, y - 1.5, 3, 3); continue; }
        pen ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
        pen = true;
      }
      ctx.stroke();
    }
  }

  function drawCharts() {
    drawChart("chart-throughput", [{ key: "generation_tps", color: "--gen" },
                                   { key: "prompt_tps", color: "--prompt" }], {});
    drawChart("chart-ttft", [{ key: "ttft_s", color: "--decode", dots: true }], {});
    drawChart("chart-queue", [{ key: "running", color: "--running" },
                              { key: "waiting", color: "--waiting" }], {});
    drawChart("chart-kv", [{ key: "kv_usage", color: "--kv", scale: 100 },
                           { key: "hit_rate", color: "--hit", scale: 100, dots: true }],
              { max: 100 });
  }
  $("window").addEventListener("change", () => latest && drawCharts());

  // ------------------------------------------------------------------ timeline

  function drawTimeline(s) {
    const canvas = $("timeline"), ctx = canvas.getContext("2d");
    const rowH = 12, maxRows = 48, labelW = 150, axisH = 14;
    const rows = s.requests.slice(0, maxRows);
    const w = Math.max(200, canvas.clientWidth), h = Math.max(40, rows.length * rowH + axisH);
    fitCanvas(canvas, w, h);
    const now = s.now;
    // The span of the rows shown (at least 10 s, at most what the server keeps).
    const oldest = rows.reduce((t, r) => Math.min(t, r.arrival), now);
    const span = Math.min(s.intervals.timeline_s, Math.max(10, 1.05 * (now - oldest)));
    $("timeline-span").textContent = Math.round(span);
    const X = (t) => labelW + (w - labelW - 4) * Math.max(0, 1 - (now - t) / span);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "10px system-ui";
    const phases = { queued: 0, prefill: 0, decode: 0, finished: 0 };
    rows.forEach((r, i) => {
      phases[r.phase] += 1;
      const y = i * rowH;
      const c = reqColor(r.id);
      ctx.fillStyle = "rgb(" + c.join(",") + ")";
      ctx.fillRect(0, y + 2, 8, rowH - 4);
      ctx.fillStyle = cssVar("--muted");
      const label = r.id.length > 22 ? r.id.slice(0, 10) + "…" + r.id.slice(-10) : r.id;
      ctx.fillText(label, 12, y + rowH - 3);
      const end = r.finished ?? now;
      const bar = (from, to, color) => {
        if (from === null || to === null || to < now - span) return;
        ctx.fillStyle = cssVar(color);
        const x0 = X(from), x1 = Math.max(X(to), x0 + 1);
        ctx.fillRect(x0, y + 2, x1 - x0, rowH - 4);
      };
      bar(r.arrival, r.scheduled ?? end, "--queued");
      bar(r.scheduled, r.first_token ?? end, "--prefill");
      bar(r.first_token, end, "--decode");
      if (r.finished !== null) {
        ctx.fillStyle = r.reason === "stop" || r.reason === "length" ? cssVar("--done") : cssVar("--waiting");
        ctx.fillRect(X(r.finished) - 1, y + 1, 3, rowH - 2);
      }
    });
    ctx.fillStyle = cssVar("--muted");
    ctx.fillText("-" + Math.round(span) + " s", labelW, h - 3);
    ctx.fillText("now", w - 22, h - 3);
    canvas.dataset.rows = rows.length;
    canvas.dataset.phases = JSON.stringify(phases);
  }

  poll();
})();
