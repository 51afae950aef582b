// The page's script: unpacks the store's data (gzipped JSON in base64, read by JSON.parse, never
// as code) and draws the five parts. Every string from the store goes in as text: textContent in
// the DOM, and escaped for plotly, whose labels read a little HTML (<b>, <br>, <a>) and entities.
// Each step's fields are in the table of steps (D.steps) once; the other parts name steps by row.
"use strict";
(async function () {
  const started = performance.now();
  async function unpack(node) { // base64 -> gzip -> JSON text, with the browser's own inflater
    const text = atob(node.textContent.trim()), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i += 1) bytes[i] = text.charCodeAt(i);
    const inflated = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(inflated).text());
  }
  if (typeof DecompressionStream === "undefined") {
    document.querySelector("main").prepend(Object.assign(document.createElement("p"), { className: "failed",
      textContent: "this browser cannot unpack the page's data (it needs DecompressionStream: Chromium 80, Firefox 113, Safari 16.4 or later)" }));
    return;
  }
  const D = await unpack(document.getElementById("tailor-data"));
  const took = { started, unpacked: performance.now() - started }; // where the time went (benchmarks/report_page.py)
  const R = D.steps.rows, C = {}; // the table's rows, and each column's index by name
  D.steps.columns.forEach((c, i) => { if (!(c in C)) C[c] = i; });
  const at = (row, column) => (C[column] === undefined ? undefined : R[row][C[column]]);
  const MANY = 1500; // above this many points in view a curve is a line, and only the steps that say something are markers
  const CONFIG = { displaylogo: false, responsive: true };
  const KIND_SYMBOL = { whole: "circle", composite: "diamond", thinned: "square-open", archived: "x",
    average: "hexagram", merge: "triangle-up" };
  const KIND_COLOR = { whole: "#2457a6", composite: "#7b4fb5", thinned: "#c07a00", archived: "#8a8a8a",
    average: "#1b8a5a", merge: "#c0392b" };
  const TIER_COLOR = { whole: "#2457a6", weights: "#c07a00", master: "#e0a030", archive: "#8a8a8a" };

  function esc(value) { // text for a plotly label: its HTML-like markup and entities shown as typed
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  function human(n) {
    if (n === null || n === undefined) return "";
    const units = ["B", "KB", "MB", "GB", "TB", "PB"];
    let v = Number(n), i = 0;
    while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    return (i === 0 ? String(v) : v.toFixed(v >= 100 ? 0 : v >= 10 ? 1 : 2)) + " " + units[i];
  }
  function when(ts) { return new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19); }
  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function empty(id, text) { const div = document.getElementById(id); div.replaceChildren(el("p", text, "empty")); div.style.minHeight = "0"; }
  function stepLabel(run, step, id, tag) { return esc(run) + " step " + step + (tag ? " (" + esc(tag) + ")" : "") + "<br>id=" + esc(id); }

  // -- header ---------------------------------------------------------------------------------
  function header() {
    const now = D.bytes.now;
    document.getElementById("where").textContent = D.store.location + (D.store.id ? "  (store " + D.store.id + ")" : "") +
      ", read " + when(D.store.made_at);
    const totals = [["steps", D.store.steps], ["runs", D.lineage.runs.length], ["the saves stand for", human(now.saved_bytes)],
      ["the steps hold", human(now.raw_bytes)], ["the store holds", human(now.stored_bytes)],
      ["smaller than the saves", now.ratio.toFixed(2) + "x"], ["the next gc frees", human(now.gc_frees)]];
    const dl = document.getElementById("totals");
    for (const [name, value] of totals) { const d = el("div"); d.append(el("dt", name), el("dd", value)); dl.append(d); }
  }

  // -- 1. metrics -----------------------------------------------------------------------------
  function label(i) { // a step's hover text, from its table row
    const tag = at(i, "tag"), best = at(i, "best") || [];
    return stepLabel(at(i, "run"), at(i, "step"), at(i, "id"), tag) + "<br>" + at(i, "kind") + (at(i, "pinned") ? ", pinned" : "") +
      (best.length ? "<br>kept as best by " + esc(best.join(", ")) : "");
  }
  const says = (i) => Boolean(at(i, "tag") || at(i, "pinned") || (at(i, "best") || []).length ||
    at(i, "kind") === "average" || at(i, "kind") === "merge"); // a step worth a marker when a curve is too long for one each
  function marker(rows) { // each point's marker: what it is, a ring for a tag or a pin
    const ringed = rows.map((i) => Boolean(at(i, "tag") || at(i, "pinned")));
    return { symbol: rows.map((i) => KIND_SYMBOL[at(i, "kind")] || "circle"), size: ringed.map((r) => (r ? 11 : 7)),
      color: rows.map((i) => KIND_COLOR[at(i, "kind")] || "#333"), line: { width: ringed.map((r) => (r ? 2 : 0)), color: "#111" } };
  }
  function inView(rows, range) { // how many of the rows' steps the x range shows (all, with no range)
    if (!range) return rows.length;
    let n = 0;
    for (const i of rows) { const s = at(i, "step"); if (s >= range[0] && s <= range[1]) n += 1; }
    return n;
  }
  function near(rows, range) { // the rows in view and a view's width either side (what a pan shows before it is redrawn)
    if (!range) return rows;
    const w = range[1] - range[0];
    return rows.filter((i) => { const s = at(i, "step"); return s >= range[0] - w && s <= range[1] + w; });
  }
  const KIND_CODE = Object.keys(KIND_SYMBOL);
  function band(t, y) { // a run's stored steps as one row of cells coloured by what each is: one image at any count
    const scale = [];
    KIND_CODE.forEach((k, n) => { scale.push([n / KIND_CODE.length, KIND_COLOR[k]], [(n + 1) / KIND_CODE.length, KIND_COLOR[k]]); });
    return { type: "heatmap", x: t.rows.map((i) => at(i, "step")), y: [y], z: [t.rows.map((i) => Math.max(0, KIND_CODE.indexOf(at(i, "kind"))) + 0.5)],
      zmin: 0, zmax: KIND_CODE.length, colorscale: scale, showscale: false, yaxis: "y2", name: y + ": stored steps",
      text: [t.rows.map(label)], hovertemplate: "%{text}<extra></extra>" };
  }
  function metrics(name, range) {
    const M = D.metrics, traces = [];
    let dense = false;
    for (const s of M.series.filter((x) => x.metric === name)) {
      const many = inView(s.rows, range) > MANY, shown = many ? s.rows.filter(says) : near(s.rows, range);
      dense = dense || many;
      if (many) {
        const x = s.rows.map((i) => at(i, "step")), y = s.rows.map((i) => at(i, "metric:" + name));
        traces.push({ type: "scatter", mode: "lines", name: esc(s.run), x, y, line: { width: 1.5 }, hoverinfo: "x+y" });
        traces.push({ type: "scatter", mode: "markers", name: esc(s.run) + ": tagged, pinned, best", x: shown.map((i) => at(i, "step")),
          y: shown.map((i) => at(i, "metric:" + name)), text: shown.map(label), hovertemplate: "%{text}<br>" + esc(name) + "=%{y}<extra></extra>",
          marker: marker(shown) });
      } else {
        traces.push({ type: "scatter", mode: "lines+markers", name: esc(s.run), x: shown.map((i) => at(i, "step")),
          y: shown.map((i) => at(i, "metric:" + name)), text: shown.map(label),
          hovertemplate: "%{text}<br>" + esc(name) + "=%{y}<extra></extra>", marker: marker(shown), connectgaps: false });
      }
      const best = s.rows.filter((i) => (at(i, "best") || []).length);
      if (best.length) {
        traces.push({ type: "scatter", mode: "markers", name: esc(s.run) + ": kept as best", x: best.map((i) => at(i, "step")),
          y: best.map((i) => at(i, "metric:" + name)), hoverinfo: "skip",
          marker: { symbol: "star-open", size: 18, color: "#e0a000", line: { width: 2 } } });
      }
    }
    M.track.forEach((t) => {
      if (inView(t.rows, range) > MANY) {
        dense = true;
        traces.push(band(t, esc(t.run)));
        const shown = t.rows.filter(says);
        if (shown.length) traces.push({ type: "scatter", mode: "markers", x: shown.map((i) => at(i, "step")), y: shown.map(() => esc(t.run)),
          yaxis: "y2", text: shown.map(label), hovertemplate: "%{text}<extra></extra>", marker: marker(shown), showlegend: false });
      } else {
        const shown = near(t.rows, range);
        traces.push({ type: "scatter", mode: "markers", name: esc(t.run) + ": stored steps", x: shown.map((i) => at(i, "step")),
          y: shown.map(() => esc(t.run)), yaxis: "y2", text: shown.map(label), hovertemplate: "%{text}<extra></extra>",
          marker: marker(shown), showlegend: false });
      }
    });
    const layout = { margin: { t: 20, l: 70, r: 20, b: 40 }, height: 460, uirevision: name, xaxis: { title: { text: "step" } },
      yaxis: { title: { text: name ? esc(name) : "" }, domain: [0.3, 1] },
      yaxis2: { domain: [0, 0.2], type: "category", title: { text: "stored" } }, legend: { orientation: "h", y: 1.08 } };
    if (range) layout.xaxis.range = range;
    if (!M.series.length) layout.annotations = [{ text: "no metrics recorded: record them at commit (metrics=) or with tailor metric",
      xref: "paper", yref: "paper", x: 0.5, y: 0.65, showarrow: false }];
    document.getElementById("metrics-dense").hidden = !dense;
    return Plotly.react("chart-metrics", traces, layout, CONFIG);
  }
  function metricsPart() {
    const choice = document.getElementById("metric-choice");
    const names = D.metrics.names;
    let range = null; // the steps in view: zoomed in to at most MANY, each step is a marker again
    for (const n of names) { const o = el("option", n); o.value = n; choice.append(o); }
    choice.disabled = names.length < 2;
    choice.addEventListener("change", () => { range = null; metrics(choice.value, null); });
    const first = names.includes("eval_loss") ? "eval_loss" : names[0];
    if (first !== undefined) choice.value = first;
    return Promise.resolve(metrics(first, null)).then((chart) => {
      chart.on("plotly_relayout", (e) => {
        const next = e["xaxis.autorange"] ? null : e["xaxis.range[0]"] !== undefined ? [e["xaxis.range[0]"], e["xaxis.range[1]"]]
          : e["xaxis.range"] || undefined;
        if (next === undefined || (next === null && range === null)) return;
        range = next;
        metrics(choice.value || first, range); // the markers for what is in view now
      });
      return chart;
    });
  }

  // -- 2. bytes -------------------------------------------------------------------------------
  function bytesPart() {
    const B = D.bytes;
    if (!B.rows.length) { empty("chart-bytes", "the store holds no steps yet"); return null; }
    const x = B.rows.map((i) => new Date(at(i, "created_at") * 1000));
    const text = B.rows.map((i) => esc(at(i, "run")) + ":" + at(i, "step") + " id=" + esc(at(i, "id")));
    const line = (name, y, style) => ({ type: "scatter", mode: "lines", name, x, y, text, line: style,
      hovertemplate: "%{text}<br>" + name + ": %{y:.3~s}B<extra></extra>" });
    const traces = [];
    for (const [tier, y] of Object.entries(B.alone_by_tier)) {
      traces.push({ ...line("held alone by " + tier + " steps", y, { width: 0.5, color: TIER_COLOR[tier] }),
        stackgroup: "alone", fillcolor: TIER_COLOR[tier] + "88" });
    }
    traces.push(line("the saves stand for", B.saved, { width: 2.5, color: "#111" }));
    traces.push(line("the steps check out to", B.held, { width: 2, color: "#2457a6", dash: "dash" }));
    traces.push(line("newly stored by the commits", B.new, { width: 2, color: "#1b8a5a" }));
    const now = B.now, end = x[x.length - 1];
    const shapes = [{ type: "line", xref: "paper", x0: 0, x1: 1, y0: now.stored_bytes, y1: now.stored_bytes, line: { dash: "dot", color: "#a40000" } }];
    if (now.gc_frees > 0) {
      shapes.push({ type: "rect", xref: "paper", x0: 0.97, x1: 1, y0: Math.max(0, now.stored_bytes - now.gc_frees), y1: now.stored_bytes,
        fillcolor: "#a4000055", line: { width: 0 } });
    }
    const annotations = [{ x: end, y: now.stored_bytes, text: "the store holds " + human(now.stored_bytes) +
      (now.gc_frees ? "; gc frees " + human(now.gc_frees) : ""), showarrow: false, xanchor: "right", yanchor: "bottom" }];
    const table = document.getElementById("bytes-now");
    const rows = [["saves stand for", now.saved_bytes], ["steps check out to", now.raw_bytes], ["the store holds", now.stored_bytes],
      ...Object.entries(now.alone_by_tier).map(([t, v]) => ["  held alone by " + t + " steps", v]),
      ["  shared by several steps", now.shared_bytes], ["  index", now.index_bytes], ["the next gc frees", now.gc_frees]];
    for (const [name, v] of rows) { const tr = el("tr"); tr.append(el("th", name), el("td", human(v))); table.append(tr); }
    return Plotly.newPlot("chart-bytes", traces, { margin: { t: 20, l: 70, r: 20, b: 40 }, height: 420, shapes, annotations,
      yaxis: { title: { text: "bytes" }, rangemode: "tozero" }, legend: { orientation: "h", y: 1.1 } }, CONFIG);
  }

  // -- 3. lineage -----------------------------------------------------------------------------
  function lineagePart() {
    const L = D.lineage;
    if (!L.runs.length) { empty("chart-lineage", "the store has no runs yet"); return null; }
    const merged = new Set(L.nodes.filter((n) => n.kind === "average" || n.kind === "merge").map((n) => n.id));
    const lane = (run, id) => esc(run) + (merged.has(id) ? " merges" : ""); // a merge on its run's own lane below it
    const lanes = [];
    for (const r of L.runs) {
      lanes.push(lane(r.name));
      if (L.nodes.some((n) => n.run === r.name && merged.has(n.id))) lanes.push(esc(r.name) + " merges");
    }
    const traces = [];
    for (const r of L.runs) {
      const xs = r.steps.slice();
      if (r.base) xs.unshift(r.base.step);
      if (!xs.length) continue;
      traces.push({ type: "scatter", mode: "lines", x: [Math.min(...xs), Math.max(...xs)], y: [lane(r.name), lane(r.name)],
        name: esc(r.name), line: { width: 6, color: "#c9d3e6" }, hovertemplate: esc(r.name) + ": " + r.steps.length + " steps<extra></extra>",
        showlegend: false });
    }
    const EDGE = { fork: ["#2457a6", "dash"], average: ["#1b8a5a", "solid"], merge: ["#c0392b", "solid"] };
    for (const kind of Object.keys(EDGE)) {
      const xs = [], ys = [];
      for (const e of L.edges.filter((edge) => edge.kind === kind)) { xs.push(e.from.step, e.to.step, null); ys.push(lane(e.from.run, e.from.id), lane(e.to.run, e.to.id), null); }
      if (xs.length) traces.push({ type: "scatter", mode: "lines", x: xs, y: ys, name: kind, hoverinfo: "skip",
        line: { color: EDGE[kind][0], dash: EDGE[kind][1], width: 1.5 } });
    }
    const N = L.nodes;
    traces.push({ type: "scatter", mode: "markers+text", x: N.map((n) => n.step), y: N.map((n) => lane(n.run, n.id)), name: "steps",
      text: N.map((n) => (n.tag ? esc(n.tag) : "")), textposition: "top center", showlegend: false,
      customdata: N.map((n) => stepLabel(n.run, n.step, n.id, n.tag) + "<br>" + n.kind + (n.pinned ? ", pinned" : "")),
      hovertemplate: "%{customdata}<extra></extra>",
      marker: { size: 11, symbol: N.map((n) => KIND_SYMBOL[n.kind] || "circle"), color: N.map((n) => KIND_COLOR[n.kind] || "#333"),
        line: { width: N.map((n) => (n.pinned ? 2 : 0)), color: "#111" } } });
    return Plotly.newPlot("chart-lineage", traces, { margin: { t: 40, l: 110, r: 30, b: 40 }, height: Math.max(240, 110 + 60 * lanes.length),
      xaxis: { title: { text: "step" } }, yaxis: { type: "category", categoryorder: "array", categoryarray: lanes.slice().reverse() },
      legend: { orientation: "h", y: 1.15 } }, CONFIG);
  }

  // -- 4. layers ------------------------------------------------------------------------------
  function layers(h) { // x: each column's step, so 10,000 columns need no category labels
    const x = h.rows.map((i) => at(i, "step"));
    const tags = h.rows.map((i) => (at(i, "tag") ? " (" + esc(at(i, "tag")) + ")" : ""));
    const z = h.values.map((line) => line.map((v) => (v === null || v <= 0 ? null : Math.log10(v))));
    const shown = h.values.map((line) => line.map((v, j) => (v === null ? "n/a" : v.toExponential(3)) + tags[j]));
    const gone = h.inherited.map((line) => line.map((flag) => (flag ? 1 : null)));
    const traces = [
      { type: "heatmap", x, y: h.layers.map(esc), z, customdata: shown, colorscale: "Viridis", hoverongaps: false,
        colorbar: { title: { text: "log10 change" } }, hovertemplate: "%{y}, step %{x}: %{customdata}<extra></extra>" },
      { type: "heatmap", x, y: h.layers.map(esc), z: gone, colorscale: [[0, "#bbbbbb"], [1, "#bbbbbb"]], showscale: false,
        opacity: 0.85, hoverinfo: "skip", name: "inherited" },
    ];
    return Plotly.react("chart-layers", traces, { margin: { t: 20, l: 90, r: 20, b: 90 }, height: Math.max(300, 120 + 22 * h.layers.length),
      xaxis: { title: { text: "step (change since the previous committed step)" } }, yaxis: { type: "category", autorange: "reversed" } }, CONFIG);
  }
  function layersPart() {
    const H = D.layers, choice = document.getElementById("layers-run");
    if (!H.length) { empty("chart-layers", "no run has two committed steps to compare yet"); choice.disabled = true; return null; }
    H.forEach((h, i) => { const o = el("option", h.run); o.value = String(i); choice.append(o); });
    choice.disabled = H.length < 2;
    choice.addEventListener("change", () => layers(H[Number(choice.value)]));
    return layers(H[0]);
  }

  // -- 5. steps -------------------------------------------------------------------------------
  const PAGE = 100;
  const BYTES = new Set(["raw_bytes", "held_bytes", "new_bytes", "held_alone"]);
  const HEAD = { raw_bytes: "saved", held_bytes: "held", new_bytes: "new", held_alone: "held alone", created_at: "committed",
    next_gc: "next gc", best: "kept as best" };
  function stepsPart() {
    const T = D.steps, table = document.getElementById("steps-table");
    const head = el("tr");
    const state = { column: T.columns.indexOf("created_at"), desc: false, filter: "", page: 0 };
    T.columns.forEach((c, i) => {
      const th = el("th", HEAD[c] || c.replace(/^metric:/, ""));
      th.dataset.column = c;
      th.addEventListener("click", () => { state.desc = state.column === i ? !state.desc : false; state.column = i; state.page = 0; draw(); });
      head.append(th);
    });
    table.tHead.append(head);
    const shown = (c, v) => {
      if (v === null || v === undefined) return "";
      if (BYTES.has(c)) return human(v);
      if (c === "created_at") return when(v);
      if (c === "pinned") return v ? "pinned" : "";
      if (c === "best") return v.join(", ");
      if (c === "digest") return String(v).slice(0, 12);
      return String(v);
    };
    let searchable = null; // each row's text, made at the first filter typed (10,000 rows: not before it is needed)
    const text = () => searchable || (searchable = T.rows.map((r) => r.map((v, i) => shown(T.columns[i], v)).join(" ").toLowerCase()));
    const compare = (a, b) => (a === b ? 0 : a === null || a === undefined ? 1 : b === null || b === undefined ? -1 : a < b ? -1 : 1);
    function draw() {
      const col = state.column;
      let order = T.rows.map((_, i) => i);
      if (state.filter) { const all = text(); order = order.filter((i) => all[i].includes(state.filter)); }
      order.sort((a, b) => { const c = compare(T.rows[a][col], T.rows[b][col]); return state.desc ? -c : c; });
      const pages = Math.max(1, Math.ceil(order.length / PAGE));
      state.page = Math.min(state.page, pages - 1);
      const body = document.createElement("tbody");
      for (const i of order.slice(state.page * PAGE, (state.page + 1) * PAGE)) {
        const tr = el("tr");
        T.rows[i].forEach((v, j) => {
          const c = T.columns[j];
          const td = el("td", shown(c, v), typeof v === "number" ? "num" : "");
          if (c === "digest" || c === "source") td.title = String(v);
          tr.append(td);
        });
        body.append(tr);
      }
      table.tBodies[0].replaceWith(body);
      for (const th of table.tHead.rows[0].cells) th.className = "";
      table.tHead.rows[0].cells[col].className = state.desc ? "sorted-desc" : "sorted-asc";
      document.getElementById("steps-count").textContent = order.length + " of " + T.rows.length + " steps";
      const nav = document.getElementById("steps-pages");
      nav.replaceChildren();
      if (pages > 1) {
        const go = (label, page) => { const b = el("button", label); b.disabled = page < 0 || page >= pages || page === state.page;
          b.addEventListener("click", () => { state.page = page; draw(); }); nav.append(b); };
        go("first", 0); go("previous", state.page - 1);
        nav.append(el("span", "page " + (state.page + 1) + " of " + pages + " "));
        go("next", state.page + 1); go("last", pages - 1);
      }
    }
    document.getElementById("steps-filter").addEventListener("input", (e) => { state.filter = e.target.value.toLowerCase(); state.page = 0; draw(); });
    draw();
  }

  function part(name, draw) { // one part's failure is said in it, and leaves the others drawn
    const from = performance.now(); // plotly draws in the call: its time is the part's (what settles after is little)
    try { const drawn = draw(); took[name] = performance.now() - from; return Promise.resolve(drawn).catch((e) => failed(name, e)); }
    catch (e) { failed(name, e); return null; }
  }
  function failed(name, e) {
    const section = document.getElementById("part-" + name);
    section.append(el("p", "this part could not be drawn: " + e, "failed"));
    console.error("tailorstore report: " + name + ": " + e);
  }
  header();
  Promise.all([part("metrics", metricsPart), part("bytes", bytesPart), part("lineage", lineagePart), part("layers", layersPart),
    part("steps", stepsPart)]).then(() => {
    window.tailorRenderMs = performance.now() - started; // the script's own time; performance.now() is since navigation
    window.tailorTook = took;
    window.tailorRenderedAt = performance.now();
    document.body.dataset.rendered = "yes";
  });
})();
