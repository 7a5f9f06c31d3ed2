// gpuplane dashboard: draws the board's state (inlined at first, then from server-sent events).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  const QOS = { online: "q-on", offline: "q-off", "best-effort": "q-be" };
  const POOL_COLOURS = ["#3b6fd8", "#e08a1e", "#2f9e6e", "#8a5cc7", "#d9342b", "#17a2b8", "#6c757d", "#b8860b"];
  const HEALTH_COLOURS = { suspect: "#e8c02a", quarantined: "#d9342b", repairing: "#a61e4d", probation: "#f08c00", lemon: "#111" };
  const filters = { pool: "", team: "" };
  let state = null;
  const arrivals = [];
  let events = 0;

  function clock(t) {
    const day = Math.floor(t / 86400), rest = t - day * 86400;
    const h = Math.floor(rest / 3600), m = Math.floor((rest % 3600) / 60);
    return "day " + (day + 1) + " " + String(h).padStart(2, "0") + ":" + String(m).padStart(2, "0");
  }

  function waited(s) {
    return s < 120 ? Math.round(s) + " s" : s < 7200 ? Math.round(s / 60) + " min" : (s / 3600).toFixed(1) + " h";
  }

  function cardClass(card, holders) {
    const [milli, held] = card;
    if (milli <= 0) return "o0";
    const o = "o" + (milli >= 1000 ? 4 : Math.min(3, Math.ceil(milli / 250)));  // partly used never looks full
    if (!held.length) return "q-fo " + o;
    const kinds = new Set(held.map((h) => holders[h][1]));
    return (kinds.size > 1 ? "q-mix" : QOS[[...kinds][0]] || "q-mix") + " " + o;
  }

  function drawMap(s) {
    const byPool = new Map();
    s.nodes.forEach((n, i) => { if (!byPool.has(n[1])) byPool.set(n[1], []); byPool.get(n[1]).push(i); });
    const team = filters.team, big = s.nodes.length <= 64;  // a small cluster gets big cards and node names
    $("map").className = big ? "map big" : "map";
    const parts = [];
    for (const [pool, idx] of [...byPool.entries()].sort()) {
      if (filters.pool && filters.pool !== pool) continue;
      const cards = idx.reduce((a, i) => a + s.nodes[i][6].length, 0);
      parts.push('<div class="pool" data-pool="', esc(pool), '"><h4>', esc(pool), " · ", idx.length,
                 idx.length === 1 ? " node · " : " nodes · ", cards, cards === 1 ? " card" : " cards",
                 '</h4><div class="nodes">');
      for (const i of idx) {
        const [name, , model, health, schedulable, lent, cs] = s.nodes[i];
        let cls = "n";
        if (cs.length <= 2) cls += cs.length === 1 ? " g1" : " g2";
        if (health !== "healthy") cls += " h-" + health;
        if (lent) cls += " lent";
        if (!schedulable) cls += " cordoned";
        parts.push('<div class="', cls, '" data-n="', i, '" data-health="', esc(health), '">');
        if (big) parts.push('<span class="nm">', esc(name), "</span>");
        for (const card of cs) {
          let c = "c " + cardClass(card, s.holders);
          if (team && !card[1].some((h) => s.holders[h][3] === team)) c += " dim";
          if (card[2]) {
            parts.push('<i class="', c, ' mig">');
            for (const h of card[1]) {
              const hd = s.holders[h];
              parts.push('<s class="', QOS[hd[1]] || "q-mix", '" style="left:', (100 * hd[5] / card[2]).toFixed(1),
                         "%;width:", (100 * hd[6] / card[2]).toFixed(1), '%"></s>');
            }
            parts.push("</i>");
          } else parts.push('<i class="', c, '"></i>');
        }
        parts.push("</div>");
      }
      parts.push("</div></div>");
    }
    $("map").innerHTML = parts.join("") || "<p>No nodes.</p>";
  }

  function holderText(s, h) {
    const [pod, qos, cls, team, milli, , slices, profile] = s.holders[h];
    return pod + " (" + qos + (cls ? ", " + cls : "") + ", team " + team + ", " +
      (profile ? "MIG " + profile : (milli / 1000).toFixed(2) + " card") + ")";
  }

  function showDetail(i) {
    const s = state, n = s.nodes[i];
    if (!n) return;
    const rows = n[6].map((card, c) => "<tr><td>card " + c + "</td><td>" + (card[0] / 10).toFixed(0) + " %</td><td>" +
      (card[1].map((h) => esc(holderText(s, h))).join("<br>") || (card[0] > 0 ? "held outside gpuplane" : "free")) +
      "</td></tr>").join("");
    const d = $("detail");
    d.hidden = false;
    d.dataset.node = n[0];
    d.innerHTML = "<b>" + esc(n[0]) + "</b> · pool " + esc(n[1]) + " · " + esc(n[2] || "no GPU") + " · health " +
      esc(n[3]) + (n[4] ? "" : " · cordoned") + (n[5] ? " · lent" : "") + "<table>" + rows + "</table>";
    document.querySelectorAll(".n.sel").forEach((e) => e.classList.remove("sel"));
    const el = document.querySelector('.n[data-n="' + i + '"]');
    if (el) el.classList.add("sel");
  }

  function rows(id, list) {
    $(id).querySelector("tbody").innerHTML = list.map((r) => "<tr>" + r.map((c) => "<td>" + c + "</td>").join("") + "</tr>").join("");
  }

  function drawQueues(s) {
    const team = filters.team;
    rows("classes", Object.entries(s.classes).sort().map(([c, v]) => [esc(c), v[0], v[1]]));
    rows("reasons", Object.entries(s.reasons).map(([r, v]) => [esc(r), v]));
    rows("class-reasons", Object.entries(s.class_reasons).flatMap(([c, why]) =>
      Object.entries(why).map(([r, v]) => [esc(c), esc(r), v])));
    rows("quotas", s.quotas.filter((q) => !team || q[0] === team).map((q) => {
      const cap = q[3] === null ? q[2] : q[3];
      const width = cap > 0 ? Math.min(100, 100 * q[1] / cap) : 0;
      return [esc(q[0]), q[1].toFixed(2), q[2].toFixed(1), q[3] === null ? "–" : q[3].toFixed(1),
              '<span class="bar' + (q[3] !== null && q[1] > q[3] ? " over" : "") + '" style="width:' + (0.8 * width).toFixed(0) + 'px"></span>'];
    }));
    rows("repair", s.nodes.filter((n) => n[3] !== "healthy").map((n) => [esc(n[0]), esc(n[1]), esc(n[3])]));
    const pend = s.pending.filter((p) => !team || p[2] === team);
    rows("pending", pend.map((p) => [esc(p[0]), esc(p[1]), esc(p[2]), waited(p[3]), esc(p[4])]));
    $("pending-note").textContent = s.pending_total > s.pending.length ? "(oldest " + s.pending.length + " of " + s.pending_total + ")" : "";
  }

  function chart(id, times, series, opts) {
    const svg = $(id), W = 420, H = 150, L = 30, R = 118, T = 8, B = 18;  // the legend right of the plot
    if (!times.length) { svg.innerHTML = '<text x="150" y="80">no samples yet</text>'; return; }
    const t0 = times[0], t1 = Math.max(times[times.length - 1], t0 + 1);
    let ymax = opts && opts.ymax ? opts.ymax : 1;
    for (const se of series) for (const v of se.values) if (v !== null && v > ymax) ymax = v;
    const x = (t) => L + (W - L - R) * (t - t0) / (t1 - t0), y = (v) => H - B - (H - T - B) * v / ymax;
    const out = ['<line class="axis" x1="' + L + '" y1="' + (H - B) + '" x2="' + (W - R) + '" y2="' + (H - B) + '"/>',
      '<line class="axis" x1="' + L + '" y1="' + T + '" x2="' + L + '" y2="' + (H - B) + '"/>',
      '<text x="2" y="' + (T + 8) + '">' + +ymax.toFixed(1) + "</text>", '<text x="18" y="' + (H - B) + '">0</text>',
      '<text x="' + L + '" y="' + (H - 4) + '">' + clock(t0) + "</text>",
      '<text x="' + (W - R) + '" y="' + (H - 4) + '" text-anchor="end">' + clock(t1) + "</text>"];
    const lx = W - R + 8;
    let ly = T + 8;
    for (const se of series) {
      const pts = [];
      se.values.forEach((v, k) => { if (v !== null) pts.push(x(times[k]).toFixed(1) + "," + y(v).toFixed(1)); });
      out.push('<polyline stroke="' + se.colour + '"' + (se.dash ? ' stroke-dasharray="4 3"' : "") + ' points="' + pts.join(" ") + '"/>');
      const last = se.values[se.values.length - 1];
      if (last !== null && last !== undefined) {
        out.push('<circle r="2.5" fill="' + se.colour + '" cx="' + x(times[times.length - 1]).toFixed(1) + '" cy="' + y(last).toFixed(1) + '"/>');
      }
      out.push('<text x="' + lx + '" y="' + ly + '" style="fill:' + se.colour + '">' + esc(se.name) +
               (last === null || last === undefined ? "" : " " + +last.toFixed(1)) + "</text>");
      ly += 11;
    }
    svg.innerHTML = out.join("");
  }

  function drawCharts(s) {
    const h = s.history, times = h.map((p) => p.t);
    const pools = [...new Set(h.flatMap((p) => Object.keys(p.nodes)))].sort().filter((p) => !filters.pool || p === filters.pool);
    chart("ch-tide", times, [...pools.map((p, k) => ({ name: p, colour: POOL_COLOURS[k % POOL_COLOURS.length], values: h.map((q) => q.nodes[p] || 0) })),
      { name: "lent", colour: "#111", dash: true, values: h.map((q) => q.lent) }]);
    chart("ch-evict", times, [{ name: "preemptions", colour: "#d9342b", values: h.map((q) => q.preemptions) },
      { name: "evictions", colour: "#5b616b", values: h.map((q) => q.evictions) }]);
    const states = [...new Set(h.flatMap((p) => Object.keys(p.health)))].filter((k) => k !== "healthy").sort();
    chart("ch-health", times, states.length ? states.map((k) => ({ name: k, colour: HEALTH_COLOURS[k] || "#6c757d", values: h.map((q) => q.health[k] || 0) }))
      : [{ name: "all healthy", colour: "#2f9e6e", values: h.map(() => 0) }]);
    chart("ch-util", times, [{ name: "allocated", colour: "#3b6fd8", values: h.map((q) => q.alloc) },
      { name: "utilised", colour: "#e08a1e", values: h.map((q) => q.util) }], { ymax: 100 });
  }

  function fillSelect(id, values, current) {
    const sel = $(id), want = ["", ...values].join("\u0000");
    if (sel.dataset.values === want) return;
    sel.dataset.values = want;
    sel.innerHTML = '<option value="">all</option>' + values.map((v) => '<option' + (v === current ? " selected" : "") + ">" + esc(v) + "</option>").join("");
  }

  function draw(s) {
    state = s;
    const t = s.totals;
    $("s-nodes").textContent = t.nodes; $("s-cards").textContent = t.cards; $("s-full").textContent = t.full;
    $("s-partial").textContent = t.partial; $("s-free").textContent = t.free; $("s-pending").textContent = s.pending_total;
    $("s-oos").textContent = t.out_of_service;
    $("s-evictions").textContent = Object.values(s.evictions).reduce((a, b) => a + b, 0);
    $("status").textContent = s.status; $("status").className = "status " + s.status;
    $("clock").textContent = clock(s.now);
    fillSelect("f-pool", [...new Set(s.nodes.map((n) => n[1]))].sort(), filters.pool);
    fillSelect("f-team", [...new Set([...s.holders.map((h) => h[3]), ...s.quotas.map((q) => q[0]), ...s.pending.map((p) => p[2])])].sort(), filters.team);
    drawMap(s); drawQueues(s); drawCharts(s);
    const d = $("detail");
    if (!d.hidden && d.dataset.node) {
      const i = s.nodes.findIndex((n) => n[0] === d.dataset.node);
      if (i >= 0) showDetail(i);
    }
  }

  $("map").addEventListener("mouseover", (e) => {
    const card = e.target.closest(".c"), node = e.target.closest(".n");
    if (!node || !state) return;
    const n = state.nodes[+node.dataset.n];
    if (!n) return;
    if (card && !card.title) {
      const k = [...node.querySelectorAll(".c")].indexOf(card), c = n[6][k];
      if (c) card.title = n[0] + " card " + k + ": " + (c[1].map((h) => holderText(state, h)).join("; ") || (c[0] > 0 ? "held outside gpuplane" : "free"));
    } else if (!card && !node.title) node.title = n[0] + " (" + n[1] + ", " + n[2] + ", " + n[3] + ")";
  });
  $("map").addEventListener("click", (e) => {
    const node = e.target.closest(".n");
    if (node) showDetail(+node.dataset.n);
  });
  $("f-pool").addEventListener("change", (e) => { filters.pool = e.target.value; if (state) draw(state); });
  $("f-team").addEventListener("change", (e) => { filters.team = e.target.value; if (state) draw(state); });

  draw(JSON.parse($("initial-state").textContent));
  requestAnimationFrame(() => requestAnimationFrame(() => {
    document.body.dataset.firstPaintMs = performance.now().toFixed(1);
  }));
  // ?updates=N closes the stream after N updates (0: a still page), for a browser under a virtual clock
  const params = new URLSearchParams(location.search);
  const limit = params.has("updates") ? +params.get("updates") : Infinity;
  if (limit <= 0) { $("live").textContent = "still"; return; }
  const source = new EventSource("/events");
  source.addEventListener("open", () => { $("live").textContent = "live"; });
  source.addEventListener("error", () => { $("live").textContent = "reconnecting…"; });
  source.addEventListener("state", (e) => {
    const now = performance.now();
    arrivals.push(now);
    if (arrivals.length > 20) arrivals.shift();
    events += 1;
    draw(JSON.parse(e.data));
    document.body.dataset.events = String(events);
    document.body.dataset.arrivals = arrivals.map((a) => a.toFixed(1)).join(",");
    $("live").textContent = "live · update " + events;
    if (events >= limit) { source.close(); $("live").textContent = "stopped after " + events + " updates"; }
  });
})();
