// The console's only script. It runs under a strict CSP (a nonce, no
// inline code) with Trusted Types: the one HTML sink it uses takes
// fragments that this console's server rendered with its escaping
// templates and sent over its own event stream.
'use strict';

const policy = window.trustedTypes
  ? window.trustedTypes.createPolicy('console', { createHTML: (s) => s })
  : { createHTML: (s) => s };

const csrf = () => (document.querySelector('meta[name="csrf-token"]') || {}).content || '';

function flash(text, isError) {
  const el = document.getElementById('flash');
  if (!el) return;
  el.textContent = text;
  el.className = isError ? 'error' : 'ok';
}

function setLive(state) {
  const el = document.getElementById('live');
  if (el) { el.textContent = state; el.dataset.state = state; }
}

// Every form marked data-action posts through fetch, with the session's
// CSRF token in a header, and shows the service's answer in place.
document.addEventListener('submit', async (ev) => {
  const form = ev.target;
  if (!(form instanceof HTMLFormElement) || !form.hasAttribute('data-action')) return;
  ev.preventDefault();
  if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
  const body = new URLSearchParams(new FormData(form));
  let resp, out;
  try {
    resp = await fetch(form.action, {
      method: 'POST', body, credentials: 'same-origin',
      headers: { 'X-Requested-With': 'console', 'X-CSRF-Token': csrf() },
    });
    out = await resp.json();
  } catch (e) {
    flash('The console cannot be reached: ' + e, true);
    return;
  }
  if (!out.ok) { flash(out.error || ('Refused: HTTP ' + resp.status), true); return; }
  if (out.redirect) { window.location.assign(out.redirect); return; }
  flash(out.message || 'Done.', false);
  const next = form.querySelector('input[name="next"]');
  if (next && next.value !== window.location.pathname) window.location.assign(next.value);
  else if (form.closest('details')) form.reset();
});

// Live views: the server renders the part again on every change and
// sends it as HTML. A part being used waits: while a field in it has the
// focus, and while a pointer is down in it (a click must land on the
// button it was aimed at, not on its replacement).
function liveView(el) {
  const params = new URLSearchParams({ v: el.dataset.live });
  if (el.dataset.name) params.set('name', el.dataset.name);
  const es = new EventSource('/events/view?' + params.toString());
  let pending = null;
  let pressed = false;
  const apply = () => {
    if (pending === null || pressed) return;
    const a = document.activeElement;
    if (a && el.contains(a) && /^(INPUT|TEXTAREA|SELECT)$/.test(a.tagName)) return;
    el.innerHTML = policy.createHTML(pending);
    pending = null;
    el.dispatchEvent(new CustomEvent('console:updated'));
  };
  el.addEventListener('pointerdown', () => { pressed = true; });
  // After the click that follows the pointer's release has been handled.
  document.addEventListener('pointerup', () => setTimeout(() => { pressed = false; apply(); }, 0));
  document.addEventListener('pointercancel', () => { pressed = false; apply(); });
  el.addEventListener('focusout', () => setTimeout(apply, 0));
  es.addEventListener('open', () => setLive('live'));
  es.addEventListener('error', () => setLive('reconnecting'));
  es.addEventListener('html', (ev) => {
    const msg = JSON.parse(ev.data);
    if (msg.id !== el.id) return;
    pending = msg.html;
    apply();
  });
}

// The proxies table: every proxy in memory, filtered, sorted and searched
// here, and only the rows in view in the DOM, so 10,000 proxies stay
// quick. Its data comes from the orchestrator's watch, through the
// console's event stream.
function proxiesTable() {
  const ROW = 30;
  const body = document.getElementById('proxy-rows');
  const spacer = document.getElementById('proxy-spacer');
  const count = document.getElementById('proxy-count');
  const hint = document.querySelector('.hint');
  const q = document.getElementById('q');
  const fPhase = document.getElementById('f-phase');
  const fProvider = document.getElementById('f-provider');
  const fPool = document.getElementById('f-pool');
  const fHealth = document.getElementById('f-health');
  const rows = new Map();
  let shown = [];
  let sortKey = 'n', sortDir = 1;
  const pools = new Set();

  const matches = (r, text) => {
    if (fPhase.value && r.ph !== fPhase.value) return false;
    if (fProvider.value && r.pr !== fProvider.value) return false;
    if (fPool.value && r.po !== fPool.value) return false;
    if (fHealth.value && (r.h ? '1' : '0') !== fHealth.value) return false;
    if (!text) return true;
    return r._s.includes(text);
  };
  const index = (r) => { r._s = (r.n + ' ' + r.a + ' ' + r.r + ' ' + r.l + ' ' + r.pr + ' ' + r.po).toLowerCase(); return r; };

  function refilter() {
    const text = q.value.trim().toLowerCase();
    shown = [];
    for (const r of rows.values()) if (matches(r, text)) shown.push(r);
    const k = sortKey, d = sortDir;
    shown.sort((a, b) => (a[k] < b[k] ? -d : a[k] > b[k] ? d : a.n < b.n ? -1 : a.n > b.n ? 1 : 0));
    count.textContent = shown.length === rows.size ? String(rows.size) : shown.length + ' of ' + rows.size;
    spacer.style.height = (shown.length * ROW) + 'px';
    draw(true);
  }

  const cell = (text, cls) => { const s = document.createElement('span'); s.textContent = text; if (cls) s.className = cls; return s; };
  const since = (t) => {
    if (!t) return '–';
    const d = Math.max(0, Date.now() / 1000 - t);
    return d < 60 ? Math.floor(d) + 's' : d < 3600 ? Math.floor(d / 60) + 'm' : d < 172800 ? Math.floor(d / 3600) + 'h' : Math.floor(d / 86400) + 'd';
  };
  let drawn = '';
  function draw(force) {
    const first = Math.max(0, Math.floor(body.scrollTop / ROW) - 10);
    const last = Math.min(shown.length, first + Math.ceil(body.clientHeight / ROW) + 20);
    const key = first + ':' + last;
    if (!force && key === drawn) return;
    drawn = key;
    const frag = document.createDocumentFragment();
    frag.appendChild(spacer);
    for (let i = first; i < last; i++) {
      const r = shown[i];
      const a = document.createElement('a');
      a.className = 'tr';
      a.setAttribute('role', 'row');
      a.href = '/proxies/' + encodeURIComponent(r.n);
      a.style.top = (i * ROW) + 'px';
      a.dataset.name = r.n;
      a.append(cell(r.n, 'mono'), cell(r.ph + (r.d ? ' · draining' : ''), 'badge ' + r.ph), cell(r.pr), cell(r.po),
        cell(r.a || '–', 'mono'), cell(r.h ? 'yes' : 'no'), cell(r.r), cell(since(r.t)));
      frag.appendChild(a);
    }
    body.replaceChildren(frag);
  }
  body.addEventListener('scroll', () => draw(false), { passive: true });
  for (const el of [fPhase, fProvider, fPool, fHealth]) el.addEventListener('change', refilter);
  q.addEventListener('input', refilter);
  for (const h of document.querySelectorAll('[data-sort]')) {
    h.addEventListener('click', () => {
      const k = h.dataset.sort;
      sortDir = k === sortKey ? -sortDir : 1;
      sortKey = k;
      for (const o of document.querySelectorAll('[data-sort]')) o.removeAttribute('aria-sort');
      h.setAttribute('aria-sort', sortDir > 0 ? 'ascending' : 'descending');
      refilter();
    });
  }
  function addPool(p) {
    if (!p || pools.has(p)) return;
    pools.add(p);
    const o = document.createElement('option');
    o.textContent = p;
    fPool.appendChild(o);
  }
  let scheduled = false;
  const schedule = () => { if (!scheduled) { scheduled = true; requestAnimationFrame(() => { scheduled = false; refilter(); }); } };

  window.__consoleStreamOpened = performance.now();
  const es = new EventSource('/events/proxies');
  es.addEventListener('open', () => setLive('live'));
  es.addEventListener('error', () => setLive('reconnecting'));
  es.addEventListener('problem', (ev) => { setLive('reconnecting'); flash(JSON.parse(ev.data).error, true); });
  es.addEventListener('rows', (ev) => {
    if (!window.__consoleSnapshotArrived) window.__consoleSnapshotArrived = performance.now();
    const msg = JSON.parse(ev.data);
    if (msg.first) rows.clear();
    for (const r of msg.rows) { rows.set(r.n, index(r)); addPool(r.po); }
    if (!msg.last) return;
    refilter();
    if (hint) hint.textContent = '';
    if (!window.__consoleProxiesRendered) {
      window.__consoleProxiesRendered = performance.now();
      performance.mark('console:proxies-rendered');
    }
  });
  es.addEventListener('changes', (ev) => {
    for (const c of JSON.parse(ev.data)) {
      if (c.x) { const cur = rows.get(c.row.n); if (cur) rows.delete(c.row.n); }
      else { rows.set(c.row.n, index(c.row)); addPool(c.row.po); }
    }
    schedule();
  });
}

document.addEventListener('DOMContentLoaded', () => {
  if (document.body.dataset.page === 'proxies') proxiesTable();
  for (const el of document.querySelectorAll('[data-live]')) liveView(el);
});
