// genie-supervisor's live page: one event stream (/ui/events), the controls through the HTTP API.
// Plain JavaScript, no build step. The charts use uPlot when the daemon serves it (window.uPlot).
(function () {
  'use strict';

  var KEY_STORE = 'genie-ui-key';
  var GATE_LEVEL = { open: 0, throttled: 1, paused: 2 };
  var COLORS = ['#3b6fd8', '#c0392b', '#2e8b57', '#d08700', '#8e5bd8', '#4fb0c6', '#7f8c8d', '#e67e22'];

  var key = sessionStorage.getItem(KEY_STORE) || '';
  var source = null;
  var retryMs = 1000;
  var windowS = 300;
  var samples = [];
  var view = null;
  var charts = {};
  var drawPending = false;
  var busy = false;

  var stats = window.genieUiStats = { updates: 0, snapshots: 0 };  // read by bench/ui_stream.py

  function $(id) { return document.getElementById(id); }

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString() : '–'; }

  function mb(v) { return v === null || v === undefined ? '–' : (v >= 1024 ? (v / 1024).toFixed(2) + ' GiB' : v.toFixed(1) + ' MiB'); }

  function num(v, digits) { return v === null || v === undefined ? '–' : Number(v).toFixed(digits); }

  function authHeaders(extra) {
    var h = extra || {};
    if (key) h.Authorization = 'Bearer ' + key;
    return h;
  }

  function setConn(state, text) {
    var c = $('conn');
    c.dataset.state = state;
    c.textContent = text || state;
  }

  // -- connection --------------------------------------------------------------------------
  function showKeyForm(message) {
    $('key-message').textContent = message;
    $('key-form').hidden = false;
    $('key-input').focus();
  }

  function connect() {
    if (source) { source.close(); source = null; }
    fetch('/ui/token', { method: 'POST', headers: authHeaders(), cache: 'no-store' }).then(function (r) {
      if (r.status === 401) {
        var refused = !!key;
        key = '';
        sessionStorage.removeItem(KEY_STORE);
        setConn('locked', 'API key needed');
        $('key-button').hidden = false;
        showKeyForm(refused ? 'The key was refused.' : 'This daemon needs its API key.');
        return null;
      }
      if (!r.ok) throw new Error('token: HTTP ' + r.status);
      return r.json();
    }).then(function (tok) {
      if (!tok) return;
      $('key-form').hidden = true;
      $('key-button').hidden = !tok.key_required;
      open(tok.token);
    }).catch(function () { retry(); });
  }

  function retry() {
    setConn('reconnecting', 'reconnecting…');
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  }

  function open(token) {
    var es = new EventSource('/ui/events?token=' + encodeURIComponent(token));
    source = es;
    es.addEventListener('snapshot', function (e) {
      var data = JSON.parse(e.data);
      stats.snapshots++;
      retryMs = 1000;
      windowS = data.window_s;
      samples = data.samples;
      setConn('live', 'live');
      if (data.view) renderView(data.view);
      rebuildCharts();
      renderLatest();
    });
    es.addEventListener('update', function (e) {
      var data = JSON.parse(e.data);
      stats.updates++;
      for (var i = 0; i < data.samples.length; i++) samples.push(data.samples[i]);
      var last = samples.length ? samples[samples.length - 1].t : 0;
      var drop = 0;
      while (drop < samples.length && samples[drop].t < last - windowS) drop++;
      if (drop) samples.splice(0, drop);
      if (data.view) renderView(data.view);
      renderLatest();
      scheduleDraw();
    });
    es.onerror = function () {
      if (source !== es) return;
      es.close();
      source = null;
      retry();  // a new token each time: the old one may have expired
    };
  }

  // -- now, latest values ------------------------------------------------------------------
  function renderLatest() {
    var s = samples[samples.length - 1];
    if (!s) return;
    var g = $('gate-mode');
    g.dataset.mode = s.gate;
    g.textContent = s.gate + (s.gate === 'throttled' && s.cap ? ' ' + s.cap + ' tok/s' : '');
    $('gate-why').textContent = s.why.length ? '(' + s.why.join(', ') + ')' : '';
    $('stt').dataset.on = String(s.stt > 0);
    $('stt').textContent = 'STT' + (s.stt > 1 ? ' ×' + s.stt : '');
    $('tts').dataset.on = String(s.tts > 0);
    $('tts').textContent = 'TTS' + (s.tts > 1 ? ' ×' + s.tts : '');
    $('queue').textContent = s.run + ' running, ' + s.queue + ' queued';
    var parts = ['gate ' + s.gate, 'STT ' + s.stt, 'TTS ' + s.tts, (s.tps === null ? '–' : s.tps) + ' tok/s', 'queue ' + s.queue];
    Object.keys(s.temps).forEach(function (k) { parts.push(k + ' ' + s.temps[k] + ' °C'); });
    Object.keys(s.power).forEach(function (k) { parts.push(k + ' ' + s.power[k] + ' W'); });
    if (s.mem !== null) parts.push(mb(s.mem) + ' available');
    $('latest').textContent = 'At ' + clock(s.t) + ': ' + parts.join(' · ');
    renderGateChanges();
  }

  function renderGateChanges() {
    var list = $('gate-changes');
    var items = [];
    var prev = null;
    for (var i = 0; i < samples.length; i++) {
      var s = samples[i];
      var tag = s.gate + '|' + s.why.join(',');
      if (tag !== prev) items.push(s);
      prev = tag;
    }
    items = items.slice(-12).reverse();
    var sig = items.map(function (s) { return s.t; }).join(',');
    if (list.dataset.sig === sig) return;
    list.dataset.sig = sig;
    list.replaceChildren.apply(list, items.map(function (s) {
      return el('li', clock(s.t) + ' ' + s.gate + (s.why.length ? ' (' + s.why.join(', ') + ')' : ''));
    }));
  }

  // -- the view: models, memory, requests, services, policy ---------------------------------
  function renderView(v) {
    view = v;
    $('decision').textContent = v.decision || '–';
    $('engine').textContent = (v.engine.state || '–') + (v.engine.model ? ' · ' + v.engine.model : '') + (v.llm_enabled ? '' : ' · LLM switched off');
    renderModels(v.models);
    renderMemory(v);
    renderRequests(v.requests);
    renderServices(v.services);
    renderControls(v);
  }

  function renderModels(models) {
    var body = $('models-body');
    body.replaceChildren.apply(body, models.map(function (m) {
      var flags = [];
      if (m.resident) flags.push('resident');
      if (m.group) flags.push('group ' + m.group);
      if (m.group && m.state === 'loading') flags.push('swapping in');
      if (m.draining) flags.push('draining');
      var tr = el('tr');
      tr.dataset.model = m.id;
      tr.dataset.state = m.state;
      tr.append(el('td', m.id), el('td', (m.roles || []).join(', ') || '–'),
        el('td', m.state + (flags.length ? ' (' + flags.join(', ') + ')' : '') + (m.error ? ': ' + m.error : '')),
        el('td', m.backend || '–'), el('td', m.in_flight, 'num'), el('td', m.memory ? mb(m.memory.total_mb) : '–', 'num'));
      return tr;
    }));
  }

  function renderMemory(v) {
    var box = $('memory-bars');
    var mem = v.memory;
    var scale = Math.max(mem.budget_mb || 0, mem.available_mb || 0, 1);
    v.models.forEach(function (m) { if (m.memory) scale = Math.max(scale, m.memory.total_mb); });
    var rows = v.models.filter(function (m) { return m.memory; }).map(function (m) {
      var wrap = el('div', null, 'model-mem');
      var p = m.memory;
      wrap.append(el('div', m.id + ' (' + (m.loaded ? 'loaded' : m.state) + '): weights ' + mb(p.weights_mb) + ' + KV ' + mb(p.kv_mb) +
        ' + scratch ' + mb(p.scratch_mb) + ' = ' + mb(p.total_mb)));
      var bar = el('div', null, 'bar');
      var at = 0;
      [['weights', p.weights_mb], ['kv', p.kv_mb], ['scratch', p.scratch_mb]].forEach(function (part) {
        var span = el('span', null, part[0]);
        span.style.left = (100 * at / scale) + '%';
        span.style.width = (100 * part[1] / scale) + '%';
        at += part[1];
        bar.append(span);
      });
      if (mem.budget_mb) {
        var line = el('span', null, 'budget');
        line.style.left = Math.min(99.5, 100 * mem.budget_mb / scale) + '%';
        bar.append(line);
      }
      wrap.append(bar);
      return wrap;
    });
    box.replaceChildren.apply(box, rows.length ? rows : [el('p', 'No model has a memory plan yet.', 'hint')]);
    $('memory-text').textContent = 'Loaded models plan ' + mb(mem.planned_mb) + ' of the policy\'s LLM budget ' +
      (mem.budget_mb === null ? '(no limit)' : mb(mem.budget_mb)) + '; the box has ' + mb(mem.available_mb) +
      ' available of ' + mb(mem.total_mb) + '. Bars share one scale: ' + mb(scale) + ' full width.';
  }

  function renderRequests(requests) {
    var body = $('requests-body');
    if (!requests.length) { body.replaceChildren(emptyRow(7, 'No request has finished yet.')); return; }
    body.replaceChildren.apply(body, requests.map(function (r) {
      var tr = el('tr');
      tr.dataset.priority = r.priority;
      tr.append(el('td', clock(r.t)), el('td', r.model), el('td', r.priority),
        el('td', r.ttft_ms === null ? '–' : num(r.ttft_ms, 0) + ' ms', 'num'), el('td', num(r.tps, 1), 'num'),
        el('td', r.prompt + ' + ' + r.completion, 'num'), el('td', r.finish));
      return tr;
    }));
  }

  function emptyRow(cols, text) {
    var tr = el('tr');
    var td = el('td', text, 'hint');
    td.colSpan = cols;
    tr.append(td);
    return tr;
  }

  function renderServices(services) {
    var list = $('services-list');
    if (!services.length) { list.replaceChildren(el('li', 'No service is watched (config: services).', 'hint')); return; }
    list.replaceChildren.apply(list, services.map(function (s) {
      var state = s.up === true ? 'up' : (s.up === false ? 'down' : 'unknown');
      var li = el('li');
      li.dataset.service = s.name;
      li.append(el('strong', s.name), ' ', el('span', state, state), ' since ' + clock(s.since) +
        (s.reason ? ' · ' + s.reason : '') + (s.rss_mb ? ' · ' + mb(s.rss_mb) : ''));
      return li;
    }));
  }

  function renderControls(v) {
    var sel = $('policy-select');
    var options = v.policy.options.length ? v.policy.options : [v.policy.name || '–'];
    if (!busy && document.activeElement !== sel) {
      var sig = options.join('\n');
      if (sel.dataset.sig !== sig) {
        sel.dataset.sig = sig;
        sel.replaceChildren.apply(sel, options.map(function (o) { var opt = el('option', o); opt.value = o; return opt; }));
      }
      sel.value = v.policy.active || v.policy.name || options[0];
      sel.disabled = !v.policy.options.length;
      $('llm-switch').checked = !!v.llm_enabled;
    }
    $('policy-name').textContent = 'In force: ' + (v.policy.name || '–') + (v.policy.active ? ' (file ' + v.policy.active + '.yaml)' : ' (built-in)');
    var err = $('policy-error');
    err.hidden = !v.policy.error;
    err.textContent = v.policy.error ? 'Last reload rejected: ' + v.policy.error : '';
  }

  // -- controls ----------------------------------------------------------------------------
  function control(path, body, label) {
    busy = true;
    var buttons = document.querySelectorAll('#controls button, #controls select, #controls input');
    buttons.forEach(function (b) { b.disabled = true; });
    var result = $('control-result');
    result.textContent = label + '…';
    return fetch(path, {
      method: 'POST',
      headers: authHeaders({ 'Content-Type': 'application/json' }),
      body: JSON.stringify(body),
    }).then(function (r) {
      return r.json().then(function (data) {
        if (r.status === 401) { connect(); }
        if (r.ok && view && 'llm_enabled' in data) {  // the controls' state now, before the stream says so
          view.llm_enabled = data.llm_enabled;
          view.policy.active = data.policy;
        }
        result.textContent = r.ok ? label + ': done' : label + ' failed: ' + ((data.error && data.error.message) || ('HTTP ' + r.status));
        result.dataset.ok = String(r.ok);
      });
    }).catch(function (e) {
      result.textContent = label + ' failed: ' + e.message;
      result.dataset.ok = 'false';
    }).then(function () {
      busy = false;
      buttons.forEach(function (b) { b.disabled = false; });
      if (view) renderControls(view);
    });
  }

  function wire() {
    $('policy-select').addEventListener('change', function (e) {
      control('/control/policy', { policy: e.target.value }, 'Select policy ' + e.target.value);
    });
    $('llm-switch').addEventListener('change', function (e) {
      control('/control/llm', { enabled: e.target.checked }, e.target.checked ? 'Switch the LLM on' : 'Switch the LLM off');
    });
    $('reload-button').addEventListener('click', function () { control('/control/reload', {}, 'Reload policy'); });
    $('unload-button').addEventListener('click', function () { control('/unload', {}, 'Unload models'); });
    $('key-form').addEventListener('submit', function (e) {
      e.preventDefault();
      key = $('key-input').value.trim();
      $('key-input').value = '';
      if (key) sessionStorage.setItem(KEY_STORE, key);
      connect();
    });
    $('key-button').addEventListener('click', function () { showKeyForm('Enter another API key.'); });
    window.addEventListener('resize', function () { sizeCharts(); });
  }

  // -- charts ------------------------------------------------------------------------------
  function keysOf(field) {
    var seen = {};
    samples.forEach(function (s) { Object.keys(s[field]).forEach(function (k) { seen[k] = true; }); });
    return Object.keys(seen).sort();
  }

  function stepped() { return window.uPlot.paths.stepped({ align: 1 }); }

  function specs() {
    var temps = keysOf('temps');
    var power = keysOf('power');
    return {
      voice: {
        series: [
          { label: 'STT', stroke: COLORS[1], paths: stepped() },
          { label: 'TTS', stroke: COLORS[3], paths: stepped() },
          { label: 'gate', stroke: COLORS[0], width: 2, paths: stepped(),
            value: function (u, v) { return v === null ? '–' : ['open', 'throttled', 'paused'][v]; } },
        ],
        cols: [function (s) { return s.stt; }, function (s) { return s.tts; }, function (s) { return GATE_LEVEL[s.gate]; }],
        range: function (u, min, max) { return [0, Math.max(2, max)]; },
      },
      decode: {
        series: [
          { label: 'tokens/s', stroke: COLORS[2], scale: 'tps', points: { show: true, size: 4 } },
          { label: 'queued', stroke: COLORS[1], scale: 'n', paths: stepped() },
          { label: 'running', stroke: COLORS[4], scale: 'n', paths: stepped() },
        ],
        cols: [function (s) { return s.tps; }, function (s) { return s.queue; }, function (s) { return s.run; }],
        axes: [{ scale: 'tps' }, { scale: 'n', side: 1, grid: { show: false } }],
        scales: {
          tps: { range: function (u, min, max) { return [0, Math.max(10, (max || 0) * 1.1)]; } },
          n: { range: function (u, min, max) { return [0, Math.max(2, max || 0)]; } },
        },
      },
      temps: {
        series: temps.map(function (k, i) { return { label: k, stroke: COLORS[i % COLORS.length] }; }),
        cols: temps.map(function (k) { return function (s) { return k in s.temps ? s.temps[k] : null; }; }),
      },
      power: {
        series: power.map(function (k, i) { return { label: k, stroke: COLORS[i % COLORS.length] }; }),
        cols: power.map(function (k) { return function (s) { return k in s.power ? s.power[k] : null; }; }),
      },
    };
  }

  function dataOf(spec) {
    var data = [samples.map(function (s) { return s.t; })];
    spec.cols.forEach(function (f) { data.push(samples.map(f)); });
    return data;
  }

  function chartWidth(name) { return Math.max(200, $('chart-' + name).clientWidth || 300); }

  function rebuildCharts() {
    if (!window.uPlot) { $('charts-off').hidden = false; return; }
    var all = specs();
    Object.keys(all).forEach(function (name) {
      var spec = all[name];
      if (charts[name]) { charts[name].plot.destroy(); }
      var host = $('chart-' + name);
      host.replaceChildren();
      var opts = {
        width: chartWidth(name),
        height: 150,
        series: [{ value: function (u, v) { return v === null ? '–' : clock(v); } }].concat(spec.series),
        scales: { x: { time: true } },
        axes: [{}].concat(spec.axes || [{}]),
        legend: { live: true },
        cursor: { drag: { x: false, y: false } },
      };
      if (spec.range) opts.scales.y = { range: spec.range };
      if (spec.scales) Object.keys(spec.scales).forEach(function (k) { opts.scales[k] = spec.scales[k]; });
      charts[name] = { plot: new window.uPlot(opts, dataOf(spec), host), spec: spec, keys: spec.series.map(function (s) { return s.label; }).join('|') };
    });
  }

  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(function () {
      drawPending = false;
      if (!window.uPlot) return;
      var all = specs();
      var rebuild = Object.keys(all).some(function (name) {
        return !charts[name] || charts[name].keys !== all[name].series.map(function (s) { return s.label; }).join('|');
      });
      if (rebuild) { rebuildCharts(); return; }
      Object.keys(charts).forEach(function (name) { charts[name].plot.setData(dataOf(charts[name].spec)); });
    });
  }

  function sizeCharts() {
    Object.keys(charts).forEach(function (name) { charts[name].plot.setSize({ width: chartWidth(name), height: 150 }); });
  }

  wire();
  if (!window.uPlot) $('charts-off').hidden = false;
  connect();
})();
