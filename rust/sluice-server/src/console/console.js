// The sluice web console: polls the admin endpoint's GET /status, keeps a few minutes of history
// in this tab, and draws it.
//
// Constraints that shape this file:
// - The endpoint serves it under a strict Content-Security-Policy (script-src 'self',
//   style-src 'self', connect-src 'self'): no inline scripts or style attributes, no eval, and
//   no request to anything but the node. Styles that change with data are set through the
//   CSSOM (element.style.x = ...), which the policy allows.
// - Data from the node (topic names, error texts, addresses) only ever goes into textContent
//   or attributes, never into innerHTML, so a topic named "<img onerror=...>" stays text.
// - Every field is optional: an older or newer node, an active or a replica, a node in a
//   cluster or not, all report different subsets. A missing field shows as "—" or hides its
//   block; it never stops the rest of the page.
'use strict';

(function () {
  const POLL_MS = 2000;
  // 5 minutes of samples at one per POLL_MS.
  const HISTORY = Math.ceil((5 * 60 * 1000) / POLL_MS);
  const WINDOW_S = 5 * 60;
  // How long a first click on an action stays armed waiting for the confirming second click.
  const CONFIRM_MS = 5000;
  // Saturated colours, told apart from the grey axes and grid (the browser test counts them).
  const INTEGER_STEPS = [1, 2, 5].flatMap((m) => [1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12]
    .map((p) => m * p)).sort((a, b) => a - b);
  const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#e377c2', '#17becf',
    '#8c564b', '#bcbd22'];

  // ---------------------------------------------------------------------------------------
  // Small helpers

  const $ = (id) => document.getElementById(id);

  /** An element with properties (`class`, `title`, `text`, `data-*`, others as attributes)
   * and children (nodes or strings, which become text). */
  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  const isNum = (v) => typeof v === 'number' && Number.isFinite(v);
  const DASH = '—';

  function fmtInt(n) {
    return isNum(n) ? Math.round(n).toLocaleString('en-US') : DASH;
  }

  function fmtBytes(n) {
    if (!isNum(n)) return DASH;
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    // Whole bytes as such; a rate's fraction of a byte is noise.
    const digits = i === 0 ? (Number.isInteger(n) || n >= 10 ? 0 : 1) : n < 10 ? 2 : 1;
    return n.toFixed(digits) + ' ' + units[i];
  }

  const fmtByteRate = (x) => (isNum(x) ? fmtBytes(x) + '/s' : DASH);

  function fmtRate(x) {
    if (!isNum(x)) return DASH;
    if (x === 0) return '0';
    if (Math.abs(x) < 10) return x.toFixed(1);
    return Math.round(x).toLocaleString('en-US');
  }

  function fmtSeconds(s) {
    if (!isNum(s)) return DASH;
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 0) + ' ms';
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + ' s';
    return fmtDuration(s);
  }

  function fmtDuration(s) {
    if (!isNum(s)) return DASH;
    s = Math.floor(s);
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60), sec = s % 60;
    if (d) return `${d}d ${h}h ${m}m`;
    if (h) return `${h}h ${m}m ${sec}s`;
    if (m) return `${m}m ${sec}s`;
    return `${sec}s`;
  }

  const orDash = (v) => (v === undefined || v === null || v === '' ? DASH : String(v));
  const sum = (xs) => xs.reduce((a, b) => a + (isNum(b) ? b : 0), 0);
  // The sum of what is known, or null when nothing is (a dash, not a misleading 0).
  const sumKnown = (xs) => (xs.some(isNum) ? sum(xs) : null);
  const arr = (v) => (Array.isArray(v) ? v : []);

  /** A table of `rows` (arrays of cells: strings, nodes, or {text, class, field}). */
  function fillTable(tbody, rows) {
    tbody.replaceChildren(...rows.map(({ attrs, cells }) => el('tr', attrs,
      cells.map((c) => (c && typeof c === 'object' && !(c instanceof Node)
        ? el('td', { class: c.class, 'data-field': c.field, title: c.title }, c.node || c.text)
        : el('td', {}, c))))));
  }

  const num = (value, field, fmt = fmtInt) => ({ text: fmt(value), class: 'num', field });

  /** A definition list of [label, value, field] pairs; values may be nodes. */
  function facts(dl, pairs) {
    dl.replaceChildren(...pairs.flatMap(([label, value, field]) => [
      el('dt', {}, label), el('dd', { 'data-field': field }, value instanceof Node ? value : orDash(value)),
    ]));
  }

  // ---------------------------------------------------------------------------------------
  // History: fixed-size ring buffers, one per series, sharing a ring of timestamps

  class Ring {
    constructor(capacity) { this.buf = new Array(capacity); this.start = 0; this.len = 0; }
    push(v) {
      const cap = this.buf.length;
      if (this.len < cap) { this.buf[(this.start + this.len) % cap] = v; this.len++; } else {
        this.buf[this.start] = v; this.start = (this.start + 1) % cap;
      }
    }
    toArray() {
      const out = new Array(this.len);
      for (let i = 0; i < this.len; i++) out[i] = this.buf[(this.start + i) % this.buf.length];
      return out;
    }
    any(pred) {
      for (let i = 0; i < this.len; i++) if (pred(this.buf[(this.start + i) % this.buf.length])) return true;
      return false;
    }
  }

  /** Series that come and go (a replica connects, a topic is created): a new one is padded
   * with nulls back to the first sample; one with nothing but nulls left in the window is
   * dropped, so history costs a bounded amount of memory whatever happens. */
  class Timeline {
    constructor(capacity) { this.capacity = capacity; this.times = new Ring(capacity); this.series = new Map(); }
    record(t, values) {
      this.times.push(t);
      for (const [name, ring] of this.series) ring.push(isNum(values[name]) ? values[name] : null);
      for (const [name, v] of Object.entries(values)) {
        if (this.series.has(name) || !isNum(v)) continue;
        const ring = new Ring(this.capacity);
        for (let i = 1; i < this.times.len; i++) ring.push(null);
        ring.push(v);
        this.series.set(name, ring);
      }
      for (const [name, ring] of this.series) if (!ring.any(isNum)) this.series.delete(name);
    }
    names() { return [...this.series.keys()]; }
    data(names) { return [this.times.toArray(), ...names.map((n) => this.series.get(n).toArray())]; }
  }

  /** Per-second rates from counters between two polls; null on the first poll, or when a
   * counter went back (the node restarted). */
  class Rates {
    constructor() { this.prev = null; this.cur = null; }
    next(t, counters) { this.prev = this.cur; this.cur = { t, counters }; }
    of(key) {
      if (!this.prev || !this.cur) return null;
      const a = this.prev.counters.get(key), b = this.cur.counters.get(key);
      const dt = this.cur.t - this.prev.t;
      if (!isNum(a) || !isNum(b) || b < a || dt <= 0) return null;
      return (b - a) / dt;
    }
  }

  // ---------------------------------------------------------------------------------------
  // Live charts (uPlot)

  /** A chart over a Timeline, rebuilt when its set of series changes and otherwise just
   * given the new data. `scales` maps a scale name to {label, fmt, side}; `scaleOf(name)`
   * picks the scale of a series. */
  class LiveChart {
    constructor(container, scales, scaleOf) {
      this.container = container;
      this.scales = scales;
      this.scaleOf = scaleOf;
      this.plot = null;
      this.names = [];
      // Keeps each series' colour as others come and go.
      this.colours = new Map();
      new ResizeObserver(() => {
        if (this.plot) this.plot.setSize({ width: this.width(), height: this.plot.height });
      }).observe(container);
    }
    width() { return Math.max(240, this.container.clientWidth || 600); }
    colour(name) {
      if (!this.colours.has(name)) this.colours.set(name, PALETTE[this.colours.size % PALETTE.length]);
      return this.colours.get(name);
    }
    update(timeline) {
      if (typeof uPlot === 'undefined') return;
      const names = timeline.names();
      if (names.length === 0) {
        if (this.plot) { this.plot.destroy(); this.plot = null; }
        this.names = [];
        this.container.replaceChildren(el('p', { class: 'muted' }, 'No data yet.'));
        return;
      }
      const data = timeline.data(names);
      if (this.plot && names.join('\n') === this.names.join('\n')) {
        this.plot.setData(data);
        return;
      }
      if (this.plot) this.plot.destroy();
      this.container.replaceChildren();
      this.names = names;
      const used = [...new Set(names.map(this.scaleOf))];
      // The window grows with the history, from one minute up to WINDOW_S, then scrolls.
      const scales = { x: { time: true, range: (u, min, max) => [Math.max(max - WINDOW_S, Math.min(min, max - 60)), max] } };
      const axes = [{ stroke: '#555', grid: { stroke: '#eee' }, ticks: { stroke: '#ddd' } }];
      used.forEach((key, i) => {
        const s = this.scales[key];
        // From zero: a lag or a rate read against a moving floor misleads.
        scales[key] = { range: (u, min, max) => [0, isNum(max) && max > 0 ? max * 1.1 : 1] };
        axes.push({
          scale: key,
          label: s.label,
          side: i === 0 ? 3 : 1,
          stroke: '#555',
          grid: { show: i === 0, stroke: '#eee' },
          ticks: { stroke: '#ddd' },
          size: i === 0 ? 70 : 90,
          // Counts (seqnos) step by whole numbers: no "0, 0, 1, 1" ticks on a flat line.
          incrs: s.integer ? INTEGER_STEPS : undefined,
          values: (u, vals) => vals.map(s.fmt),
        });
      });
      const opts = {
        width: this.width(),
        height: 220,
        // Live charts scroll; a drag-zoom would be undone by the next poll.
        cursor: { drag: { x: false, y: false } },
        scales,
        axes,
        series: [{}, ...names.map((name) => ({
          label: name,
          scale: this.scaleOf(name),
          stroke: this.colour(name),
          width: 2,
          dash: this.scales[this.scaleOf(name)].dash,
          points: { show: false },
          value: (u, v) => (v === null || v === undefined ? DASH : this.scales[this.scaleOf(name)].fmt(v)),
        }))],
      };
      this.plot = new uPlot(opts, data, this.container);
    }
  }

  // ---------------------------------------------------------------------------------------
  // Talking to the node

  // Credentials typed into the login box. Kept in this closure only: never in localStorage or
  // a cookie, so closing the tab forgets them.
  let credentials = null;

  function basicHeader(user, password) {
    // btoa takes Latin-1 only; the endpoint decodes the pair as UTF-8.
    const bytes = new TextEncoder().encode(`${user}:${password}`);
    let bin = '';
    for (const b of bytes) bin += String.fromCharCode(b);
    return 'Basic ' + btoa(bin);
  }

  function authHeaders() {
    return credentials ? { Authorization: credentials.header } : {};
  }

  class HttpError extends Error {
    constructor(status, text) { super(`${status}: ${text.trim()}`); this.status = status; this.text = text; }
  }

  async function get(path) {
    // Signed out, credentials 'same-origin': Basic credentials the browser already holds for
    // this node (it asked for them when the page itself needed them) go along with the poll.
    // Signed in, 'omit': the login box's header alone, and a wrong password comes back as a
    // 401 to the page rather than as the browser's own login dialog.
    const r = await fetch(path, {
      headers: authHeaders(),
      cache: 'no-store',
      credentials: credentials ? 'omit' : 'same-origin',
    });
    const text = await r.text();
    if (!r.ok) throw new HttpError(r.status, text);
    return text;
  }

  /** A state change: the endpoint's CSRF rule wants X-Sluice-Request (a cross-site page
   * cannot send it without a preflight the endpoint never grants). Credentials 'omit': only
   * what was typed into this page's login box authorises a change, never credentials the
   * browser would add by itself, and a 401 comes back to the page instead of the browser's
   * own login dialog. */
  async function post(path, body) {
    const headers = { 'X-Sluice-Request': '1', ...authHeaders() };
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    const r = await fetch(path, {
      method: 'POST',
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
      credentials: 'omit',
    });
    return { status: r.status, statusText: r.statusText, text: await r.text() };
  }

  /** Per front: its connections and requests, as /status reports them for every front. */
  function frontCounters(st) {
    const out = {};
    for (const [name, f] of Object.entries(st.fronts || {})) {
      const s = f?.status || {};
      out[name] = { requests: s.requests, connections: s.connections };
    }
    return out;
  }

  // ---------------------------------------------------------------------------------------
  // State kept between polls

  const rates = new Rates();
  const lines = {
    requests: new Timeline(HISTORY),
    lag: new Timeline(HISTORY),
    topics: new Timeline(HISTORY),
  };
  let charts = null;
  let polls = 0;
  let paused = false;

  function makeCharts() {
    const perSecond = (v) => fmtRate(v);
    charts = {
      requests: new LiveChart($('chart-requests'), { rps: { label: 'requests/s', fmt: perSecond } }, () => 'rps'),
      lag: new LiveChart($('chart-lag'), {
        seq: { label: 'seqnos behind', fmt: fmtInt, integer: true },
        sec: { label: 'seconds behind', fmt: fmtSeconds, dash: [6, 4] },
      }, (name) => (name.endsWith(' (s)') ? 'sec' : 'seq')),
      topics: new LiveChart($('chart-topics'), {
        msg: { label: 'messages/s', fmt: perSecond },
        bytes: { label: 'bytes/s', fmt: fmtByteRate, dash: [6, 4] },
      }, (name) => (name.endsWith(' consumed B/s') ? 'bytes' : 'msg')),
    };
  }

  /** Everything a counter is kept for, flattened to one key each. */
  function counters(st, fronts) {
    const c = new Map();
    for (const [name, f] of Object.entries(fronts)) c.set(`front:${name}`, f.requests);
    for (const b of arr(st.buckets)) c.set(`evictions:${b.name}`, b.evictions);
    for (const t of arr(st.topics)) {
      for (const p of arr(t.partitions)) {
        c.set(`produced:${t.name}:${p.partition}`, p.produced_messages);
        c.set(`consumed:${t.name}:${p.partition}`, p.consumed_bytes);
      }
    }
    return c;
  }

  /** The replicas following this (active) node, from each vbucket's followers. */
  function followersOf(st) {
    const by = new Map();
    for (const b of arr(st.buckets)) {
      for (const vb of arr(b.vbuckets)) {
        for (const f of arr(vb.followers)) {
          const key = f.replica;
          if (!by.has(key)) {
            by.set(key, { name: key, kv_address: f.kv_address, vbuckets: 0, lag: 0, unpersisted: 0, lagMs: null });
          }
          const r = by.get(key);
          r.vbuckets++;
          if (isNum(vb.high_seqno) && isNum(f.acked_seqno)) r.lag += Math.max(0, vb.high_seqno - f.acked_seqno);
          if (isNum(vb.high_seqno) && isNum(f.persisted_seqno)) {
            r.unpersisted += Math.max(0, vb.high_seqno - f.persisted_seqno);
          }
          // Not in /status yet (issue 52): the follower's lag in time, shown once reported.
          if (isNum(f.lag_ms)) r.lagMs = Math.max(r.lagMs ?? 0, f.lag_ms);
        }
      }
    }
    return [...by.values()];
  }

  /** On a replica: per bucket followed, the seqnos behind (summed) and the time behind
   * (the worst vbucket's). */
  function replicaLag(st) {
    return arr(st.replication?.buckets).map((b) => {
      const vbs = arr(b.vbuckets);
      const ms = vbs.map((v) => v.lag_ms).filter(isNum);
      return {
        bucket: b,
        seqnos: sumKnown(vbs.map((v) => v.lag_seqnos)),
        seconds: ms.length ? Math.max(...ms) / 1000 : null,
        byVbucket: new Map(vbs.map((v) => [v.vbucket, v])),
      };
    });
  }

  function record(st, fronts, t) {
    rates.next(t, counters(st, fronts));
    const rps = {};
    for (const name of Object.keys(fronts)) rps[name] = rates.of(`front:${name}`);
    lines.requests.record(t, rps);

    const lag = {};
    for (const f of followersOf(st)) {
      lag[`${f.name} (seqnos)`] = f.lag;
      if (isNum(f.lagMs)) lag[`${f.name} (s)`] = f.lagMs / 1000;
    }
    for (const r of replicaLag(st)) {
      const name = `${r.bucket.bucket} from ${r.bucket.active}`;
      lag[`${name} (seqnos)`] = r.seqnos;
      lag[`${name} (s)`] = r.seconds;
    }
    const tu = st.tarantool_upstream;
    if (tu) {
      lag[`tarantool ${tu.address} rows (seqnos)`] = tu.lag_rows;
      lag[`tarantool ${tu.address} (s)`] = tu.lag_seconds;
    }
    lines.lag.record(t, lag);

    const topicRates = {};
    for (const tp of arr(st.topics)) {
      const parts = arr(tp.partitions);
      topicRates[`${tp.name} produced msg/s`] = sumRates(parts.map((p) => `produced:${tp.name}:${p.partition}`));
      topicRates[`${tp.name} consumed B/s`] = sumRates(parts.map((p) => `consumed:${tp.name}:${p.partition}`));
    }
    lines.topics.record(t, topicRates);
  }

  function sumRates(keys) {
    return sumKnown(keys.map((k) => rates.of(k)));
  }

  // ---------------------------------------------------------------------------------------
  // Rendering, one function a section; each is guarded so one section's surprise leaves the
  // others drawn.

  /** Active, replica, or unknown when /status says nothing of replication. */
  function roleOf(st) {
    if (st.replication === undefined) return null;
    return st.replication ? 'replica' : 'active';
  }

  function renderHeader(st) {
    const role = orDash(roleOf(st));
    $('node-name').textContent = `${orDash(st.instance)} · ${role} · v${orDash(st.version)}`;
    document.title = `sluice ${st.listen || ''} (${role})`;
  }

  function renderOverview(st, fronts) {
    const rep = st.replication;
    const role = rep ? (rep.replica_of ? `replica of ${rep.replica_of}` : 'replica (cluster map)') : roleOf(st);
    const wal = st.wal;
    const pairs = [
      ['instance', st.instance, 'instance'],
      ['version', st.version, 'version'],
      ['uptime', fmtDuration(st.uptime_s), 'uptime'],
      ['role', role, 'role'],
      ['KV address', st.listen, 'listen'],
      ['KV TLS address', st.tls_listen, 'tls_listen'],
      ['admin over HTTPS', st.admin_https === undefined ? null : (st.admin_https ? 'yes' : 'no'), 'admin_https'],
      ['client connections', fmtInt(st.connections), 'connections'],
    ];
    // Not in /status yet: shown as soon as the node reports it.
    if (st.data_dir !== undefined) pairs.splice(3, 0, ['data directory', st.data_dir, 'data_dir']);
    if (wal) {
      const w = `${orDash(wal.mode)} · LSN ${fmtInt(wal.last_lsn)} written ${fmtInt(wal.written_lsn)} synced ${fmtInt(wal.synced_lsn)}`;
      pairs.push(['WAL', wal.failing ? el('span', { class: 'bad' }, w + ' · FAILING') : w, 'wal']);
    }
    facts($('node-facts'), pairs);

    fillTable($('fronts').tBodies[0], Object.entries(st.fronts || {}).map(([name, f]) => ({
      attrs: { 'data-front': name },
      cells: [
        name,
        orDash(f?.listen),
        f?.tls_listen ? el('span', { class: 'good' }, f.tls_listen) : 'off',
        num(fronts[name]?.connections, 'connections'),
        num(rates.of(`front:${name}`), 'rps', fmtRate),
      ],
    })));

    $('memory').replaceChildren(...arr(st.buckets).map((b) => {
      const frac = isNum(b.mem_used) && isNum(b.memory_quota) && b.memory_quota > 0 ? b.mem_used / b.memory_quota : null;
      const fill = el('div', { class: 'fill' });
      if (frac !== null) {
        // CSSOM, not a style attribute: allowed by style-src 'self'.
        fill.style.width = `${Math.min(100, frac * 100).toFixed(2)}%`;
        fill.classList.toggle('warn', frac >= 0.75);
        fill.classList.toggle('bad', frac >= 0.9);
      }
      return el('div', { class: 'memrow', 'data-bucket': b.name },
        el('span', { class: 'memname' }, b.name),
        el('div', { class: 'bar', title: `${orDash(b.mem_used)} of ${orDash(b.memory_quota)} bytes` }, fill),
        el('span', { class: 'memtext', 'data-field': 'memory' },
          `${fmtBytes(b.mem_used)} of ${fmtBytes(b.memory_quota)}` + (frac !== null ? ` (${(frac * 100).toFixed(1)}%)` : '')));
    }));
  }

  // The vbucket grids' cells are kept between polls and only changed where their state did:
  // rebuilding them would close a tooltip the user is reading.
  const grids = new Map();

  function renderBuckets(st) {
    const buckets = arr(st.buckets);
    fillTable($('bucket-table').tBodies[0], buckets.map((b) => {
      const vbs = arr(b.vbuckets);
      const items = sumKnown(vbs.map((v) => v.items)) ?? b.items;
      return {
        attrs: { 'data-bucket': b.name },
        cells: [b.name, num(items, 'items'), num(b.mem_used, 'mem_used', fmtBytes),
          num(b.memory_quota, 'memory_quota', fmtBytes), orDash(b.eviction), num(b.evictions, 'evictions'),
          num(rates.of(`evictions:${b.name}`), 'evictions_rate', fmtRate)],
      };
    }));

    const lagOf = new Map(replicaLag(st).map((r) => [r.bucket.bucket, r.byVbucket]));
    const container = $('vbucket-grids');
    const seen = new Set();
    for (const b of buckets) {
      seen.add(b.name);
      let g = grids.get(b.name);
      if (!g) {
        g = { head: el('h3'), grid: el('div', { class: 'vbgrid', 'data-bucket': b.name }), cells: [] };
        g.box = el('div', { class: 'vbbox' }, g.head, g.grid);
        container.append(g.box);
        grids.set(b.name, g);
      }
      const vbs = arr(b.vbuckets);
      g.grid.classList.toggle('dense', vbs.length > 256);
      while (g.cells.length < vbs.length) {
        const cell = el('div', { class: 'vb' });
        g.cells.push(cell);
        g.grid.append(cell);
      }
      while (g.cells.length > vbs.length) g.cells.pop().remove();
      const counts = {};
      vbs.forEach((v, i) => {
        const state = String(v.state || 'unknown');
        counts[state] = (counts[state] || 0) + 1;
        const cell = g.cells[i];
        const cls = `vb vb-${state.replace(/[^a-z]/g, '')}`;
        if (cell.className !== cls) cell.className = cls;
        cell.dataset.state = state;
        cell.dataset.vbucket = String(v.vbucket);
        const label = vbs.length <= 256 ? String(v.vbucket) : '';
        if (cell.textContent !== label) cell.textContent = label;
        const tip = [`vbucket ${v.vbucket}: ${state}`, `high seqno ${orDash(v.high_seqno)}`,
          `persisted seqno ${orDash(v.persisted_seqno)}`, `items ${orDash(v.items)}`];
        for (const f of arr(v.followers)) {
          tip.push(`replica ${f.kv_address || f.replica}: acked ${orDash(f.acked_seqno)}, persisted ${orDash(f.persisted_seqno)}`);
        }
        const lag = lagOf.get(b.name)?.get(v.vbucket);
        if (lag) tip.push(`behind the active: ${orDash(lag.lag_seqnos)} seqnos, ${fmtSeconds(lag.lag_ms / 1000)}`);
        const title = tip.join('\n');
        if (cell.title !== title) cell.title = title;
      });
      g.head.textContent = `${b.name}: ${vbs.length} vbuckets — ` +
        Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(', ');
    }
    for (const [name, g] of grids) if (!seen.has(name)) { g.box.remove(); grids.delete(name); }
  }

  function renderReplication(st) {
    const body = $('replication-body');
    const parts = [];
    const rep = st.replication;
    if (rep) {
      parts.push(el('p', { 'data-field': 'replica_of' },
        rep.replica_of ? `This node is a replica of ${rep.replica_of}.` : 'This node follows the actives of the cluster map.'));
      const table = el('table', { id: 'followed' },
        el('thead', {}, el('tr', {}, ['bucket', 'active', 'streaming', 'connects', 'changes applied', 'rollbacks',
          'seqnos behind', 'time behind', 'last error'].map((h, i) => el('th', { class: i >= 3 && i <= 7 ? 'num' : null }, h)))),
        el('tbody'));
      fillTable(table.tBodies[0], replicaLag(st).map((r) => ({
        attrs: { 'data-bucket': r.bucket.bucket },
        cells: [orDash(r.bucket.bucket), orDash(r.bucket.active),
          r.bucket.connected ? el('span', { class: 'good' }, 'yes') : el('span', { class: 'bad' }, 'no'),
          num(r.bucket.connects, 'connects'), num(r.bucket.items, 'items'), num(r.bucket.rollbacks, 'rollbacks'),
          num(r.seqnos, 'lag_seqnos'), num(r.seconds, 'lag_seconds', fmtSeconds),
          { text: orDash(r.bucket.last_error), class: r.bucket.last_error ? 'bad' : null, field: 'last_error' }],
      })));
      parts.push(table);
    }
    const followers = followersOf(st);
    if (followers.length) {
      const table = el('table', { id: 'replicas' },
        el('thead', {}, el('tr', {}, ['replica', 'KV address', 'vbuckets', 'seqnos not acknowledged',
          'seqnos not persisted there', 'time behind'].map((h, i) => el('th', { class: i >= 2 ? 'num' : null }, h)))),
        el('tbody'));
      fillTable(table.tBodies[0], followers.map((f) => ({
        attrs: { 'data-replica': f.name },
        cells: [f.name, orDash(f.kv_address), num(f.vbuckets, 'vbuckets'), num(f.lag, 'lag_seqnos'),
          num(f.unpersisted, 'unpersisted'), num(isNum(f.lagMs) ? f.lagMs / 1000 : null, 'lag_seconds', fmtSeconds)],
      })));
      parts.push(el('p', {}, `${followers.length} replica(s) follow this node.`), table);
    } else if (!rep) {
      parts.push(el('p', { class: 'muted' }, 'No replica follows this node.'));
    }
    // Not in /status yet: shown per bucket as soon as the node reports it.
    const waiting = arr(st.buckets).filter((b) => isNum(b.durable_writes_waiting));
    if (waiting.length) {
      parts.push(el('p', { 'data-field': 'durable_writes_waiting' }, 'Durable writes waiting: ' +
        waiting.map((b) => `${b.name} ${fmtInt(b.durable_writes_waiting)}`).join(', ')));
    }
    body.replaceChildren(...parts);

    const tu = st.tarantool_upstream;
    const tb = $('tarantool-body');
    if (!tu) {
      tb.replaceChildren(el('p', { class: 'muted' }, 'This node follows no Tarantool.'));
    } else {
      const dl = el('dl', { class: 'facts' });
      facts(dl, [
        ['address', tu.address, 'address'],
        ['state', el('span', { class: tu.state === 'follow' || tu.state === 'following' ? 'good' : null }, orDash(tu.state)), 'state'],
        ['reason', tu.reason, 'reason'],
        ['rows behind', fmtInt(tu.lag_rows), 'lag_rows'],
        ['time behind', fmtSeconds(tu.lag_seconds), 'lag_seconds'],
        ['rows applied', fmtInt(tu.rows_applied), 'rows_applied'],
        ['rows skipped', fmtInt(tu.rows_skipped), 'rows_skipped'],
        ['reconnects', fmtInt(tu.reconnects), 'reconnects'],
        ['stopped spaces', arr(tu.stopped_spaces).length ? JSON.stringify(tu.stopped_spaces) : 'none', 'stopped_spaces'],
      ]);
      tb.replaceChildren(dl);
    }
  }

  function renderTopics(st) {
    const topics = arr(st.topics);
    const body = $('topics-body');
    if (!topics.length) {
      body.replaceChildren(el('p', { class: 'muted' }, 'No topics.'));
      return;
    }
    const table = el('table', { id: 'topic-table' },
      el('thead', {}, el('tr', {}, ['topic', 'partition', 'first seq', 'high-water mark', 'bytes retained',
        'produced msg/s', 'consumed bytes/s', 'long-polls waiting'].map((h, i) => el('th', { class: i >= 2 ? 'num' : null }, h)))),
      el('tbody'));
    const rows = [];
    for (const t of topics) {
      const parts = arr(t.partitions);
      rows.push({
        attrs: { 'data-topic': t.name, class: 'topic-row' },
        cells: [{ text: t.name, title: t.settings || null, class: 'topic-name' }, `${parts.length} partition(s)`,
          '', '', num(sumKnown(parts.map((p) => p.bytes)), 'bytes', fmtBytes),
          num(sumRates(parts.map((p) => `produced:${t.name}:${p.partition}`)), 'produce_rate', fmtRate),
          num(sumRates(parts.map((p) => `consumed:${t.name}:${p.partition}`)), 'consume_rate', fmtByteRate),
          num(t.long_polls, 'long_polls')],
      });
      for (const p of parts) {
        rows.push({
          attrs: { 'data-topic': t.name, 'data-partition': p.partition },
          cells: ['', num(p.partition, 'partition'), num(p.first_seq, 'first_seq'),
            num(p.high_water_mark, 'high_water_mark'), num(p.bytes, 'bytes', fmtBytes),
            num(rates.of(`produced:${t.name}:${p.partition}`), 'produce_rate', fmtRate),
            num(rates.of(`consumed:${t.name}:${p.partition}`), 'consume_rate', fmtByteRate), ''],
        });
      }
    }
    fillTable(table.tBodies[0], rows);
    body.replaceChildren(table);
  }

  /** A small square in a node's colour (CSSOM, as the policy wants). */
  function swatch(colour) {
    const s = el('span', { class: 'swatch' });
    if (colour) s.style.backgroundColor = colour;
    return s;
  }

  // The cluster's vbucket placement cells, kept between polls like the buckets' grids.
  const clusterCells = [];

  function renderCluster(st) {
    const c = st.cluster;
    const body = $('cluster-body');
    const placement = $('cluster-placement');
    if (!c || typeof c !== 'object') {
      body.replaceChildren(el('p', { class: 'muted' }, 'This node is not in a cluster.'));
      placement.hidden = true;
      $('rebalance-action').hidden = true;
      return;
    }
    $('rebalance-action').hidden = false;
    const dl = el('dl', { class: 'facts' });
    facts(dl, [
      ['cluster', c.cluster, 'cluster'],
      ['this node', c.node, 'node'],
      ['nodes up', fmtInt(c.nodes_up), 'nodes_up'],
      ['failed over', fmtInt(c.failed_over), 'failed_over'],
      ['orchestrator', c.orchestrator ? c.orchestrator + (c.orchestrator_here ? ' (this node)' : '') : null, 'orchestrator'],
      ['map revision', fmtInt(c.map_revision), 'map_revision'],
    ]);
    const parts = [dl];

    // Each vbucket's chain [active, replica...] as node names (null: an empty slot, or no
    // chain at all); each topic's leader per partition.
    const chains = Array.isArray(c.vbuckets) ? c.vbuckets.map(arr) : null;
    const topics = c.topics && typeof c.topics === 'object' && !Array.isArray(c.topics) ? c.topics : null;
    const nodes = arr(c.nodes).filter((n) => n && typeof n === 'object');

    // A colour per node, by name: it stays put as nodes come and go.
    const names = new Set(nodes.map((n) => n.name).filter(Boolean));
    for (const ch of chains || []) for (const n of ch) if (n) names.add(n);
    const sorted = [...names].map(String).sort();
    const colourOf = (n) => (n ? PALETTE[sorted.indexOf(String(n)) % PALETTE.length] : null);
    const count = (m, k) => m.set(k, (m.get(k) || 0) + 1);
    const actives = new Map(), replicas = new Map(), leads = new Map();
    for (const ch of chains || []) {
      if (ch[0]) count(actives, ch[0]);
      for (const r of ch.slice(1)) if (r) count(replicas, r);
    }
    for (const leaders of Object.values(topics || {})) for (const l of arr(leaders)) if (l) count(leads, l);

    if (Array.isArray(c.nodes)) {
      const heads = ['node', 'KV address', 'TANK address', 'health', 'failed over', 'active vbuckets',
        'replica vbuckets', 'partitions led'];
      const table = el('table', { id: 'cluster-nodes' },
        el('thead', {}, el('tr', {}, heads.map((h, i) => el('th', { class: i >= 5 ? 'num' : null }, h)))), el('tbody'));
      fillTable(table.tBodies[0], nodes.map((n) => ({
        attrs: { 'data-node': n.name, class: n.name === c.node ? 'this-node' : null },
        cells: [
          { node: el('span', {}, swatch(colourOf(n.name)), orDash(n.name), n.name === c.node ? ' (this node)' : ''), field: 'name' },
          { text: orDash(n.kv_address), field: 'kv_address' },
          { text: orDash(n.tank_address), field: 'tank_address' },
          { node: n.up === undefined ? DASH : el('span', { class: n.up ? 'good' : 'bad' }, n.up ? 'up' : 'down'), field: 'up' },
          { node: n.failed_over ? el('span', { class: 'bad' }, 'failed over') : n.failed_over === false ? 'no' : DASH, field: 'failed_over' },
          num(chains ? actives.get(n.name) || 0 : null, 'actives'),
          num(chains ? replicas.get(n.name) || 0 : null, 'replicas'),
          num(topics ? leads.get(n.name) || 0 : null, 'leads'),
        ],
      })));
      parts.push(table);
    }

    const r = c.rebalance;
    if (r && typeof r === 'object' && Object.keys(r).length) {
      const total = isNum(r.total) && r.total > 0 ? r.total : null;
      const done = isNum(r.done) ? r.done : 0;
      const bar = el('progress', { max: total || 1, value: total ? Math.min(done, total) : (r.state === 'done' ? 1 : 0) });
      const pct = total ? ` (${Math.floor((100 * Math.min(done, total)) / total)}%)` : '';
      parts.push(el('div', { class: 'rebalance', 'data-field': 'rebalance', 'data-state': r.state || null },
        el('h3', {}, 'Rebalance'),
        el('p', {}, `${orDash(r.state)}${r.phase ? ' · ' + r.phase : ''} · ${fmtInt(r.done)} of ${fmtInt(r.total)} moves${pct}`),
        bar,
        r.error ? el('p', { class: 'bad' }, String(r.error)) : null));
    } else {
      parts.push(el('p', { class: 'muted', 'data-field': 'rebalance' }, 'No rebalance has run.'));
    }
    body.replaceChildren(...parts);

    placement.hidden = !chains && !topics;
    renderPlacement(chains, colourOf, sorted, actives);
    renderLeaders(topics, colourOf);
  }

  function renderPlacement(chains, colourOf, names, actives) {
    const grid = $('cluster-vbuckets');
    const head = $('cluster-vbuckets-head');
    const legend = $('cluster-legend');
    const show = !!chains;
    grid.hidden = head.hidden = legend.hidden = !show;
    if (!show) return;
    const n = chains.length;
    grid.classList.toggle('dense', n > 256);
    while (clusterCells.length < n) {
      const cell = el('div', { class: 'vb' });
      clusterCells.push(cell);
      grid.append(cell);
    }
    while (clusterCells.length > n) clusterCells.pop().remove();
    chains.forEach((ch, i) => {
      const cell = clusterCells[i];
      const active = ch[0] ? String(ch[0]) : '';
      const cls = active ? 'vb vb-node' : 'vb vb-none';
      if (cell.className !== cls) cell.className = cls;
      cell.dataset.vbucket = String(i);
      cell.dataset.active = active;
      const chain = ch.map((x) => (x ? String(x) : '')).join(',');
      if (cell.dataset.chain !== chain) cell.dataset.chain = chain;
      const colour = colourOf(active) || '';
      // The style reads back normalised (rgb(...)): compared through a data attribute instead.
      if (cell.dataset.colour !== colour) { cell.dataset.colour = colour; cell.style.backgroundColor = colour; }
      const label = n <= 256 ? String(i) : '';
      if (cell.textContent !== label) cell.textContent = label;
      const reps = ch.slice(1).map((x) => (x ? String(x) : 'none (empty slot)'));
      const title = `vbucket ${i}\nactive: ${active || 'none'}` + (reps.length ? `\nreplicas: ${reps.join(', ')}` : '');
      if (cell.title !== title) cell.title = title;
    });
    head.textContent = `vbucket placement: ${n} vbuckets, coloured by their active node`;
    const orphans = chains.filter((ch) => !ch[0]).length;
    legend.replaceChildren(...names.map((name) => el('span', { class: 'legend-item', 'data-node': name },
      swatch(colourOf(name)), `${name} (${actives.get(name) || 0})`)),
    orphans ? el('span', { class: 'legend-item' }, el('span', { class: 'swatch vb-none' }), `no active (${orphans})`) : null,
    el('span', { class: 'muted' }, '— hover a vbucket for its chain'));
  }

  function renderLeaders(topics, colourOf) {
    const box = $('cluster-topics');
    const list = Object.entries(topics || {}).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
    if (!topics) {
      box.replaceChildren(el('p', { class: 'muted' }, 'This node does not report the topics\' placement.'));
      return;
    }
    if (!list.length) {
      box.replaceChildren(el('p', { class: 'muted' }, 'No topics in the cluster.'));
      return;
    }
    const table = el('table', { id: 'cluster-topic-table' },
      el('thead', {}, el('tr', {}, el('th', {}, 'topic'), el('th', { class: 'num' }, 'partition'), el('th', {}, 'leader'))),
      el('tbody'));
    const rows = [];
    for (const [name, leaders] of list) {
      arr(leaders).forEach((leader, p) => rows.push({
        attrs: { 'data-topic': name, 'data-partition': p },
        cells: [p === 0 ? name : '', num(p, 'partition'), {
          node: leader ? el('span', {}, swatch(colourOf(leader)), String(leader)) : el('span', { class: 'bad' }, 'none'),
          field: 'leader',
        }],
      }));
    }
    fillTable(table.tBodies[0], rows);
    box.replaceChildren(table);
  }

  function guarded(name, fn) {
    try { fn(); } catch (e) {
      // A bug in this page, not in the node: said in the console (the browser test fails on it).
      console.error(`console: drawing ${name} failed`, e);
    }
  }

  function render(st, fronts) {
    guarded('header', () => renderHeader(st));
    guarded('overview', () => renderOverview(st, fronts));
    guarded('buckets', () => renderBuckets(st));
    guarded('replication', () => renderReplication(st));
    guarded('topics', () => renderTopics(st));
    guarded('cluster', () => renderCluster(st));
    if (!charts && typeof uPlot !== 'undefined') makeCharts();
    if (charts) for (const k of Object.keys(charts)) guarded(`the ${k} chart`, () => charts[k].update(lines[k]));
  }

  // ---------------------------------------------------------------------------------------
  // The poll loop: one request at a time, the next POLL_MS after the previous one started.

  function setPollState(state, text) {
    const b = $('poll-state');
    b.dataset.state = state;
    b.textContent = text;
  }

  async function poll() {
    const started = performance.now();
    try {
      const st = JSON.parse(await get('/status'));
      const fronts = frontCounters(st);
      record(st, fronts, Date.now() / 1000);
      render(st, fronts);
      polls++;
      document.body.dataset.polls = String(polls);
      $('poll-error').hidden = true;
      setPollState('ok', `live · ${new Date().toLocaleTimeString()}`);
    } catch (e) {
      const err = $('poll-error');
      err.hidden = false;
      if (e instanceof HttpError && (e.status === 401 || e.status === 403)) {
        // Polling on would ask again every 2 s for what only the user can give.
        paused = true;
        setPollState('error', 'sign in needed');
        err.textContent = `The node refused to show its status (${e.status}): sign in above.`;
      } else {
        setPollState('error', 'no answer');
        err.textContent = `Cannot read /status: ${e.message}. Retrying every ${POLL_MS / 1000} s.`;
      }
    }
    if (!paused) setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
  }

  function resume() {
    if (paused) { paused = false; poll(); }
  }

  // ---------------------------------------------------------------------------------------
  // Login box and actions

  function setupLogin() {
    const form = $('login');
    form.addEventListener('submit', (ev) => {
      ev.preventDefault();
      const user = $('login-user').value.trim();
      const password = $('login-password').value;
      if (!user) return;
      credentials = { user, header: basicHeader(user, password) };
      $('login-password').value = '';
      $('login-state').textContent = `signed in as ${user}`;
      $('login-user').hidden = $('login-password').hidden = $('login-use').hidden = true;
      $('login-clear').hidden = false;
      resume();
    });
    $('login-clear').addEventListener('click', () => {
      credentials = null;
      $('login-state').textContent = 'not signed in';
      $('login-user').hidden = $('login-password').hidden = $('login-use').hidden = false;
      $('login-clear').hidden = true;
    });
  }

  /** Shows an action's answer: its status and text; 401 and 403 read as "refused". */
  function showResult(out, r) {
    let text = r.text.trim();
    try { text = JSON.stringify(JSON.parse(text), null, 1); } catch (_) { /* plain text */ }
    const refused = r.status === 401 || r.status === 403;
    out.dataset.status = String(r.status);
    out.className = `result ${refused ? 'refused' : r.status >= 200 && r.status < 300 ? 'ok' : 'failed'}`;
    out.textContent = `${refused ? 'refused' : r.status < 300 ? 'done' : 'failed'} (${r.status}${r.statusText ? ' ' + r.statusText : ''}): ${text}`;
  }

  /** The first click arms the button (its label asks for confirmation); a second click
   * within CONFIRM_MS runs `act`. A confirm() dialog would do too, but blocks the page's
   * polling and is easy to click through by habit. */
  function twoStep(button, out, act) {
    let timer = null;
    const disarm = () => {
      clearTimeout(timer);
      timer = null;
      button.classList.remove('armed');
      button.textContent = button.dataset.label;
    };
    return async () => {
      if (!timer) {
        button.classList.add('armed');
        button.textContent = `Confirm: ${button.dataset.label.toLowerCase()}?`;
        timer = setTimeout(disarm, CONFIRM_MS);
        return;
      }
      disarm();
      button.disabled = true;
      out.className = 'result';
      out.dataset.status = '';
      out.textContent = 'working…';
      try {
        showResult(out, await act());
      } catch (e) {
        out.className = 'result failed';
        out.dataset.status = 'error';
        out.textContent = `failed: ${e.message}`;
      } finally {
        button.disabled = false;
      }
    };
  }

  function setupActions() {
    const promote = $('promote');
    promote.addEventListener('click', twoStep(promote, $('promote-result'), () => post('/promote')));

    const topicForm = $('topic-form');
    const createTopic = twoStep($('topic-create'), $('topic-result'), () => {
      const topic = { name: $('topic-name').value.trim(), partitions: Number($('topic-partitions').value) };
      // The endpoint reads the query, as /takeover does (its permission check names the topic
      // from it before any body is read); the JSON body says the same for a reader of bodies.
      return post(`/topics?${new URLSearchParams({ name: topic.name, partitions: String(topic.partitions) })}`, topic);
    });
    topicForm.addEventListener('submit', (ev) => { ev.preventDefault(); createTopic(); });

    const moveForm = $('move-form');
    const move = twoStep($('move-start'), $('move-result'), () => {
      const q = new URLSearchParams({
        bucket: $('move-bucket').value.trim(),
        vbucket: $('move-vbucket').value,
        source: $('move-source').value.trim(),
      });
      return post(`/takeover?${q}`);
    });
    moveForm.addEventListener('submit', (ev) => { ev.preventDefault(); move(); });

    const rebalance = $('rebalance');
    rebalance.addEventListener('click', twoStep(rebalance, $('rebalance-result'), () => post('/rebalance')));
  }

  function start() {
    setupLogin();
    setupActions();
    if (typeof uPlot === 'undefined') console.error('console: uPlot did not load; charts are off');
    poll();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
}());
