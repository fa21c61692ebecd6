// pagedllm KV-cache dashboard: one panel per server (one on `pagedllm serve`, one per replica on
// `pagedllm router`), each fed by its /v1/kv_events stream (engine/kv_events.py documents the events).
// The block map is one pixel per block in an offscreen canvas, scaled up: a step repaints only the
// blocks it changed, so ~100k blocks stay cheap; no DOM node per block.
"use strict";
(() => {
  const STATES = ["free", "cached", "used", "shared"];  // kv_cache/events.py block_state, by index
  const COLORS = { free: "#2b2f36", cached: "#3f6fb5", used: "#3fae5a", shared: "#e0a030",
                   swapping: "#d04fd0", loading: "#30c8d8", copying: "#ffffff" };
  const FLASH = { swap_out: "swapping", swap_in: "swapping", load: "loading", copy: "copying" };
  const FLASH_MS = 700;  // how long a block in motion keeps its colour after the step
  const MAP_HEIGHT = 560;  // css pixels the map may take before cells shrink
  const HISTORY = 120;  // metric points per chart
  const KEY_STORE = "pagedllm-api-key";
  const RGBA = Object.fromEntries(Object.entries(COLORS).map(([k, hex]) => [k, packColor(hex)]));

  function packColor(hex) {  // ImageData's little-endian 32-bit RGBA
    const v = parseInt(hex.slice(1), 16);
    return (0xff << 24 | (v & 0xff) << 16 | (v >> 8 & 0xff) << 8 | v >> 16) >>> 0;
  }

  function blockState(ref, hash) {
    if (ref === 0) return hash === undefined ? "free" : "cached";
    return ref === 1 ? "used" : "shared";
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
    }
    node.append(...children);
    return node;
  }

  function apiKey() { return sessionStorage.getItem(KEY_STORE); }

  // ------------------------------------------------------------------ one server's panel
  class Panel {
    constructor(root, spec) {
      this.spec = spec;
      this.n = 0;
      this.step = -1;
      this.dropped = 0;
      this.connected = false;
      this.tables = new Map();  // request id -> block ids
      this.owners = new Map();  // block id -> Set of request ids
      this.requests = [];
      this.queueSizes = {};
      this.selected = null;
      this.config = null;
      this.metrics = [];  // [{time, values: Map}]
      this.series = CHARTS.map(() => []);
      this.dirty = new Set();
      this.flashing = new Map();  // block id -> [state name, until ms]
      this.listDirty = true;
      this.lastList = 0;
      // what the map has shown since the page opened: blocks in motion by kind, tiers loaded from,
      // the longest swapped queue (for people reading a short run, and for the browser test)
      this.seen = { swapping: 0, loading: 0, copying: 0, tiers: [], swapped: 0 };
      this.build(root);
      requestAnimationFrame(() => this.frame());
    }

    build(root) {
      const name = this.spec.name ? ` — ${this.spec.name}` : "";
      this.statusEl = el("span", { class: "status", text: "connecting" });
      this.canvas = el("canvas", { class: "blockmap", "data-testid": "blockmap" });
      this.countsEl = el("div", { class: "counts", "data-testid": "counts" });
      this.tooltip = el("div", { class: "tooltip", "data-testid": "tooltip", hidden: "" });
      this.cardEl = el("table", { class: "card", "data-testid": "config" });
      this.queuesEl = el("div", { "data-testid": "queues" });
      this.chartsEl = el("div", { class: "charts" });
      this.charts = CHARTS.map((c) => {
        const canvas = el("canvas", { width: 230, height: 64 });
        const value = el("span", { text: "–" });
        this.chartsEl.append(el("div", { class: "chart", "data-testid": `chart-${c.id}` },
                                el("div", { class: "title" }, el("span", { text: c.title }), value), canvas));
        return { canvas, value };
      });
      const side = el("div", { class: "side" }, el("h3", { text: "requests" }), this.queuesEl,
                      el("h3", { text: "configuration" }), this.cardEl);
      const mapbox = el("div", { class: "mapbox" }, this.canvas, this.countsEl);
      this.root = el("section", { class: "panel", "data-testid": "panel" },
                     el("h2", { text: `KV blocks${name}` }, this.statusEl),
                     el("div", { class: "row" }, mapbox, side), this.chartsEl, this.tooltip);
      root.append(this.root);
      this.mapbox = mapbox;
      this.canvas.addEventListener("mousemove", (e) => this.hover(e));
      this.canvas.addEventListener("mouseleave", () => { this.hovered = null; this.renderTooltip(); });
      window.addEventListener("resize", () => { if (this.n) this.layout(); });
    }

    // ---------------------------------------------------------------- state from the stream
    loadSnapshot(s) {
      this.n = s.num_blocks;
      this.blockSize = s.block_size;
      this.ref = Int32Array.from(s.ref_cnt);
      this.hash = new Array(this.n);
      for (const [id, prefix] of Object.entries(s.hashes)) this.hash[+id] = prefix;
      this.tables = new Map();
      this.owners = new Map();
      for (const [rid, ids] of Object.entries(s.tables)) this.setTable(rid, ids);
      this.flashing.clear();
      this.step = s.step;
      if (s.dropped !== undefined) this.dropped = s.dropped;
      if (s.config) { this.config = s.config; this.renderCard(); }
      this.setQueues(s);
      this.layout();
    }

    applySteps(events) {
      const now = performance.now();
      for (const ev of events) {
        for (const [id, ref, prefix] of ev.blocks) {
          this.ref[id] = ref;
          this.hash[id] = prefix === null ? undefined : prefix;
          this.dirty.add(id);
        }
        for (const [rid, ids] of Object.entries(ev.tables)) this.setTable(rid, ids);
        for (const [kind, items] of Object.entries(ev.moves || {})) {
          for (const item of items) {
            const ids = kind === "copy" ? item : [kind === "load" ? item[0] : item];
            if (kind === "load" && !this.seen.tiers.includes(item[1])) this.seen.tiers.push(item[1]);
            this.seen[FLASH[kind]] += ids.length;
            for (const id of ids) { this.flashing.set(id, [FLASH[kind], now + FLASH_MS]); this.dirty.add(id); }
          }
        }
        this.step = ev.step;
        if (ev.requests) this.setQueues(ev);  // listed when they changed size, else every 0.1 s
      }
    }

    setTable(rid, ids) {
      for (const id of this.tables.get(rid) || []) {
        const set = this.owners.get(id);
        if (set) { set.delete(rid); if (!set.size) this.owners.delete(id); }
      }
      if (ids === null) { this.tables.delete(rid); return; }
      this.tables.set(rid, ids);
      for (const id of ids) {
        let set = this.owners.get(id);
        if (!set) this.owners.set(id, set = new Set());
        set.add(rid);
      }
    }

    setQueues(ev) {
      this.requests = ev.requests;
      this.queueSizes = ev.queue_sizes;
      this.seen.swapped = Math.max(this.seen.swapped, ev.queue_sizes.swapped || 0);
      this.listDirty = true;
    }

    // ---------------------------------------------------------------- the block map
    layout() {
      const width = Math.max(300, this.mapbox.clientWidth || 600);
      const cell = Math.max(1, Math.min(24, Math.floor(Math.sqrt(width * MAP_HEIGHT / this.n))));
      this.cell = cell;
      this.cols = Math.max(1, Math.floor(width / cell));
      this.rows = Math.ceil(this.n / this.cols);
      this.canvas.width = this.cols * cell;
      this.canvas.height = this.rows * cell;
      this.canvas.dataset.numBlocks = String(this.n);
      this.canvas.dataset.cell = String(cell);
      this.canvas.dataset.cols = String(this.cols);
      this.grid = document.createElement("canvas");
      this.grid.width = this.cols;
      this.grid.height = this.rows;
      this.gridCtx = this.grid.getContext("2d");
      this.image = this.gridCtx.createImageData(this.cols, this.rows);
      this.pixels = new Uint32Array(this.image.data.buffer);
      for (let id = 0; id < this.n; id++) this.pixels[id] = RGBA[this.stateOf(id)];
      this.dirty.clear();
      this.mapChanged = true;
    }

    stateOf(id) {
      const flash = this.flashing.get(id);
      return flash ? flash[0] : blockState(this.ref[id], this.hash[id]);
    }

    frame() {
      try { this.render(performance.now()); } finally { requestAnimationFrame(() => this.frame()); }
    }

    render(now) {
      if (!this.n) return;
      for (const [id, [, until]] of this.flashing) {
        if (until <= now) { this.flashing.delete(id); this.dirty.add(id); }
      }
      if (this.dirty.size) {
        for (const id of this.dirty) this.pixels[id] = RGBA[this.stateOf(id)];
        this.dirty.clear();
        this.mapChanged = true;
      }
      if (this.mapChanged) { this.paintMap(); this.renderTooltip(); }
      if (this.listDirty && now - this.lastList > 200) {
        this.renderQueues();
        this.renderCounts();
        this.lastList = now;
        this.listDirty = false;
      }
    }

    paintMap() {
      this.gridCtx.putImageData(this.image, 0, 0);
      const ctx = this.canvas.getContext("2d");
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(this.grid, 0, 0, this.cols * this.cell, this.rows * this.cell);
      if (this.cell >= 6) this.paintGridLines(ctx);
      const table = this.selected && this.tables.get(this.selected);
      if (table) {
        ctx.strokeStyle = "#ff4d4d";
        ctx.lineWidth = Math.max(1, Math.floor(this.cell / 6));
        for (const id of table) {
          const [x, y] = this.cellOrigin(id);
          ctx.strokeRect(x + 0.5, y + 0.5, this.cell - 1, this.cell - 1);
        }
      }
      this.mapChanged = false;
    }

    paintGridLines(ctx) {
      ctx.strokeStyle = "#0d0e10";
      ctx.lineWidth = 1;
      ctx.beginPath();
      for (let c = 0; c <= this.cols; c++) { ctx.moveTo(c * this.cell + 0.5, 0); ctx.lineTo(c * this.cell + 0.5, this.canvas.height); }
      for (let r = 0; r <= this.rows; r++) { ctx.moveTo(0, r * this.cell + 0.5); ctx.lineTo(this.canvas.width, r * this.cell + 0.5); }
      ctx.stroke();
    }

    cellOrigin(id) { return [(id % this.cols) * this.cell, Math.floor(id / this.cols) * this.cell]; }

    blockAt(x, y) {
      const col = Math.floor(x / this.cell), row = Math.floor(y / this.cell);
      const id = row * this.cols + col;
      return col < this.cols && id >= 0 && id < this.n ? id : null;
    }

    blockInfo(id) {
      return { id, state: this.stateOf(id), ref_cnt: this.ref[id], hash: this.hash[id] || null,
               owners: [...(this.owners.get(id) || [])].sort() };
    }

    hover(e) {
      const rect = this.canvas.getBoundingClientRect();
      this.hovered = this.blockAt(e.clientX - rect.left, e.clientY - rect.top);
      this.tooltip.style.left = `${e.clientX + 14}px`;
      this.tooltip.style.top = `${e.clientY + 14}px`;
      this.renderTooltip();
    }

    renderTooltip() {  // on every move, and whenever the map changes under a still mouse
      if (this.hovered === null || this.hovered === undefined) { this.tooltip.hidden = true; return; }
      const b = this.blockInfo(this.hovered);
      this.tooltip.textContent = `block ${b.id} · ${b.state}\nref count ${b.ref_cnt}` +
        `\nhash ${b.hash || "—"}\nowners ${b.owners.length ? b.owners.join(", ") : "—"}`;
      this.tooltip.hidden = false;
    }

    counts() {
      const out = Object.fromEntries([...STATES, "swapping", "loading", "copying"].map((s) => [s, 0]));
      for (let id = 0; id < this.n; id++) out[this.stateOf(id)]++;
      return out;
    }

    renderCounts() {
      const c = this.counts();
      this.countsEl.textContent = `${this.n} blocks · step ${this.step} · ` +
        Object.entries(c).filter(([, v]) => v).map(([k, v]) => `${k} ${v}`).join(" · ") +
        (this.dropped ? ` · ${this.dropped} events dropped (slow viewer)` : "");
    }

    // ---------------------------------------------------------------- requests and configuration
    renderQueues() {
      const rows = [];
      for (const queue of ["running", "waiting", "swapped", "loading"]) {
        const reqs = this.requests.filter((r) => r.queue === queue);
        const size = this.queueSizes[queue] || 0;
        rows.push(el("tr", {}, el("th", { colspan: 6, text: `${queue} (${size})` })));
        for (const r of reqs) {
          const tr = el("tr", { class: "req" + (r.id === this.selected ? " selected" : ""), "data-request-id": r.id,
                                "data-queue": queue },
                        el("td", { text: r.id }), el("td", { text: `${r.computed}/${r.tokens} tok` }),
                        el("td", { text: r.cpu_blocks ? `${r.cpu_blocks} cpu blk` : `${r.blocks} blk` }),
                        el("td", { text: `prio ${r.priority}` }), el("td", { text: `${r.preemptions} preempt` }));
          tr.addEventListener("click", () => this.select(r.id));
          rows.push(tr);
        }
      }
      const head = el("tr", {}, ...["request", "tokens", "blocks", "priority", "preemptions"].map((t) => el("th", { text: t })));
      this.queuesEl.replaceChildren(el("table", {}, head, ...rows));
    }

    select(rid) {
      this.selected = this.selected === rid ? null : rid;
      this.mapChanged = true;
      this.listDirty = true;
      this.lastList = 0;
    }

    renderCard() {
      const c = this.config, p = c.plan || {};
      const mib = (b) => `${(b / 2 ** 20).toFixed(b < 2 ** 20 ? 3 : 1)} MiB`;
      const tiers = [c.tiers.cpu_bytes ? `cpu ${mib(c.tiers.cpu_bytes)}` : "",
                     c.tiers.disk_dir ? `disk ${mib(c.tiers.disk_bytes)}` : ""].filter(Boolean).join(", ") || "none";
      const planned = p.error ? `plan: ${p.error}` : null;
      const rows = [
        ["model", c.model], ["device", c.device], ["block size", `${c.block_size} tokens`],
        ["pool", `${c.num_gpu_blocks} blocks · ${mib(c.kv_cache_bytes)}`], ["swap pool", `${c.num_cpu_blocks} blocks`],
        ["bytes / block", planned || `${c.bytes_per_block} measured · ${p.bytes_per_block} plan`],
        ["blocks for this budget", planned || `${c.num_gpu_blocks} measured · ${p.num_blocks_for_budget} plan`],
        ["weights (plan)", planned || mib(p.weights_bytes)],
        ["max_model_len", c.max_model_len], ["max_num_seqs", c.max_num_seqs],
        ["dtype / kv dtype", `${c.dtype} / ${c.kv_cache_dtype}`], ["quantization", c.quantization || "none"],
        ["parallelism", `tp ${c.tensor_parallel_size} · pp ${c.pipeline_parallel_size}`],
        ["prefix caching", c.enable_prefix_caching ? "on" : "off"], ["preemption", c.preemption_mode],
        ["tiers", tiers], ["speculative", c.speculative ? "on" : "off"],
      ];
      this.cardEl.replaceChildren(...rows.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: String(v) }))));
    }

    // ---------------------------------------------------------------- time series from /metrics' samples
    addMetrics(m) {
      const values = new Map(m.samples.map(([name, labels, v]) => [key(name, labels), v]));
      const point = { time: m.time, values };
      const prev = this.metrics[this.metrics.length - 1];
      this.metrics.push(point);
      if (this.metrics.length > 2) this.metrics.shift();
      CHARTS.forEach((c, i) => {
        const v = c.value(new Reader(point, prev, this.blockSize || 1));
        const s = this.series[i];
        s.push(v);
        if (s.length > HISTORY) s.shift();
        drawChart(this.charts[i], s, c);
      });
    }

    setStatus(text, error = false) {
      this.statusEl.textContent = text;
      this.statusEl.classList.toggle("error", error);
    }

    // ---------------------------------------------------------------- the stream
    async connect() {
      const headers = apiKey() ? { Authorization: `Bearer ${apiKey()}` } : {};
      let resp;
      try {
        resp = await fetch(new URL(`${this.spec.base}v1/kv_events`, location.href), { headers });
      } catch (err) {
        return this.retry(`unreachable (${err})`);
      }
      if (resp.status === 401) { askForKey(); return this.setStatus("needs the API key", true); }
      if (!resp.ok) return this.retry(`HTTP ${resp.status}`);
      this.connected = true;
      this.setStatus("live");
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            this.onMessage(buffer.slice(0, cut));
            buffer = buffer.slice(cut + 2);
          }
        }
      } catch (err) {
        console.warn("kv_events stream broke", err);
      }
      this.connected = false;
      this.retry("disconnected");
    }

    retry(why) {
      this.setStatus(`${why}; retrying`, true);
      setTimeout(() => this.connect(), 2000);
    }

    onMessage(text) {
      let name = "message", data = "";
      for (const line of text.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) return;
      const payload = JSON.parse(data);
      if (name === "snapshot") this.loadSnapshot(payload);
      else if (name === "steps") this.applySteps(payload);
      else if (name === "metrics") this.addMetrics(payload);
    }
  }

  // ------------------------------------------------------------------ metrics
  function key(name, labels) {
    const parts = Object.keys(labels).sort().map((k) => `${k}=${labels[k]}`);
    return parts.length ? `${name}{${parts.join(",")}}` : name;
  }

  class Reader {  // one metrics point and the previous one: gauges, rates, windowed histograms
    constructor(point, prev, blockSize) { this.p = point; this.q = prev; this.blockSize = blockSize; }
    get(name, labels = {}) { return this.p.values.get(key(name, labels)); }
    counter(name, labels = {}) { return this.get(`${name}_total`, labels) ?? this.get(name, labels); }
    delta(name, labels = {}) {
      if (!this.q) return undefined;
      const now = this.counter(name, labels);
      const before = new Reader(this.q, null).counter(name, labels);
      return now === undefined || before === undefined ? undefined : now - before;
    }
    ratio(num, den) {
      const a = this.delta(num), b = this.delta(den);
      return a === undefined || !b ? null : a / b;
    }
    quantile(name, q) {  // from the buckets' growth since the previous point, linear inside a bucket
      if (!this.q) return null;
      const bounds = [];
      for (const [k, v] of this.p.values) {
        const m = k.match(new RegExp(`^${name}_bucket\\{le=([^}]+)\\}$`));
        if (m) bounds.push([m[1] === "+Inf" ? Infinity : +m[1], v - (this.q.values.get(k) || 0)]);
      }
      bounds.sort((a, b) => a[0] - b[0]);
      const total = bounds.length ? bounds[bounds.length - 1][1] : 0;
      if (!total) return null;
      let lo = 0, below = 0;
      for (const [le, cum] of bounds) {
        if (cum >= q * total) {
          if (le === Infinity) return lo;
          return lo + (le - lo) * (cum > below ? (q * total - below) / (cum - below) : 1);
        }
        lo = le; below = cum;
      }
      return lo;
    }
  }

  const pct = (v) => (v === null || v === undefined ? null : 100 * v);
  const ms = (v) => (v === null ? null : 1000 * v);
  const CHARTS = [
    { id: "kv_usage", title: "KV usage %", unit: "%", value: (r) => pct(r.get("kv_cache_usage_perc")) },
    { id: "prefix_hit_rate", title: "prefix hit rate %", unit: "%",
      value: (r) => pct(r.ratio("prefix_cache_hits", "prefix_cache_queries")) },
    { id: "tier_hits", title: "hits: device / cpu / disk (blocks)", lines: 3,
      value: (r) => [(r.delta("prefix_cache_hits") ?? 0) / r.blockSize, r.delta("kv_offload_hits", { tier: "cpu" }) ?? 0,
                     r.delta("kv_offload_hits", { tier: "disk" }) ?? 0] },
    { id: "preemptions", title: "preemptions", value: (r) => r.delta("num_preemptions") ?? null },
    { id: "tokens_per_step", title: "tokens / step",
      value: (r) => r.ratio("iteration_tokens_total_sum", "iteration_tokens_total_count") },
    { id: "ttft", title: "TTFT p50 / p99 ms", lines: 2,
      value: (r) => [ms(r.quantile("time_to_first_token_seconds", 0.5)), ms(r.quantile("time_to_first_token_seconds", 0.99))] },
    { id: "tpot", title: "TPOT p50 / p99 ms", lines: 2,
      value: (r) => [ms(r.quantile("request_time_per_output_token_seconds", 0.5)),
                     ms(r.quantile("request_time_per_output_token_seconds", 0.99))] },
    { id: "spec_acceptance", title: "speculative acceptance %", unit: "%",
      value: (r) => pct(r.ratio("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens")) },
  ];
  const LINE_COLORS = ["#3fae5a", "#30c8d8", "#d04fd0"];

  function drawChart({ canvas, value }, series, chart) {
    const lines = chart.lines || 1;
    const at = (v, i) => (lines === 1 ? v : v && v[i]);
    const all = series.flatMap((v) => (lines === 1 ? [v] : v)).filter((v) => v !== null && v !== undefined);
    const max = Math.max(chart.unit === "%" ? 100 : 1e-9, ...all);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let i = 0; i < lines; i++) {
      ctx.strokeStyle = LINE_COLORS[i];
      ctx.beginPath();
      let pen = false;
      series.forEach((v, k) => {
        const y = at(v, i);
        if (y === null || y === undefined) { pen = false; return; }
        const px = (k / (HISTORY - 1)) * canvas.width, py = canvas.height - 2 - (y / max) * (canvas.height - 4);
        if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
        pen = true;
      });
      ctx.stroke();
    }
    const last = series[series.length - 1];
    const fmt = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
    value.textContent = lines === 1 ? fmt(last) : (last || []).map(fmt).join(" / ");
  }

  // ------------------------------------------------------------------ the page
  function askForKey() {
    const form = document.getElementById("keyform");
    form.hidden = false;
  }

  function keyFromFragment() {  // /dashboard#key=... (a fragment never reaches the server)
    const m = location.hash.match(/key=([^&]+)/);
    if (m) {
      sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  function legend() {
    const ul = document.getElementById("legend");
    for (const [name, color] of Object.entries(COLORS)) {
      const i = el("i");
      i.style.background = color;
      ul.append(el("li", {}, i, name));
    }
  }

  function start() {
    keyFromFragment();
    legend();
    const config = window.PAGEDLLM_DASHBOARD;
    const main = document.getElementById("panels");
    const panels = config.panels.map((spec) => new Panel(main, spec));
    document.getElementById("keyform").addEventListener("submit", (e) => {
      e.preventDefault();
      sessionStorage.setItem(KEY_STORE, document.getElementById("apikey").value);
      e.target.hidden = true;
      panels.forEach((p) => { if (!p.connected) p.connect(); });
    });
    window.pagedllmDashboard = { panels, Panel, blockState };
    panels.forEach((p) => p.connect());
  }

  start();
})();
