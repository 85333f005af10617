// The web console end to end: headless Chromium (Debian's chromium,
// driven by playwright-core) against the real suite that tests/e2e's
// TestConsole starts. Every step waits on what the page shows, without
// reloading: the live parts must bring each change.
'use strict';
const { test, before, after } = require('node:test');
const assert = require('node:assert/strict');
const { execFileSync } = require('node:child_process');
const path = require('node:path');
const { chromium } = require('playwright-core');

const env = (k) => { const v = process.env[k]; if (!v) throw new Error(k + ' is not set'); return v; };
const URL = env('CONSOLE_URL');
const shots = process.env.SCREENSHOTS || '';
const WAIT = 60_000;

let browser;
before(async () => {
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking'],
  });
});
after(async () => { await browser?.close(); });

async function page() {
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const p = await ctx.newPage();
  p.setDefaultTimeout(WAIT);
  p.on('dialog', (d) => d.accept());
  const errors = [];
  p.on('pageerror', (e) => errors.push(e.message));
  // A CSP violation would show as a console error; none may happen.
  p.on('console', (m) => { if (m.type() === 'error' && !/favicon/.test(m.text())) errors.push(m.text()); });
  p.errors = errors;
  return p;
}

async function signIn(p, token) {
  await p.goto(URL + '/signin');
  await p.fill('#token', token);
  await Promise.all([p.waitForNavigation(), p.click('#signin-form button')]);
}

async function shot(p, name) {
  if (shots) await p.screenshot({ path: path.join(shots, name + '.png'), fullPage: true });
}

function egressctl(...args) {
  return execFileSync(env('EGRESSCTL'), args, {
    env: { ...process.env, EGRESS_TOKEN: env('CRAWLER_TOKEN') }, encoding: 'utf8',
  });
}

let admin;

test('a bad token is refused with a clear message', async () => {
  const p = await page();
  await signIn(p, 'not-a-token');
  assert.match(await p.textContent('#signin-error'), /Sign-in refused: the orchestrator does not accept this token \(invalid bearer token\)/);
  await signIn(p, env('CRAWLER_TOKEN'));
  assert.match(await p.textContent('#signin-error'), /has the role crawler; the console needs viewer or admin/);
  // The token never reaches a URL, and nothing is kept in the browser's storage.
  assert.ok(!p.url().includes('not-a-token'));
  await p.context().close();
});

test('an admin signs in; the session cookie is httpOnly and SameSite', async () => {
  admin = await page();
  await signIn(admin, env('ADMIN_TOKEN'));
  await admin.waitForSelector('#who');
  assert.match(await admin.textContent('#who'), /ops\s+admin/);
  const [cookie] = await admin.context().cookies();
  assert.equal(cookie.httpOnly, true);
  assert.equal(cookie.sameSite, 'Lax');
  assert.ok(!cookie.value.includes(env('ADMIN_TOKEN')), 'the cookie is sealed');
  const stored = await admin.evaluate(() => JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + document.cookie);
  assert.ok(!stored.includes(env('ADMIN_TOKEN')));
  const resp = await admin.goto(URL + '/');
  const csp = resp.headers()['content-security-policy'];
  assert.match(csp, /script-src 'nonce-[^']+' 'strict-dynamic'/);
  assert.match(csp, /require-trusted-types-for 'script'/);
  await admin.waitForSelector('#live[data-state=live]');
  await shot(admin, 'overview');
});

test('create a proxy and watch it turn Ready without reloading', async () => {
  await admin.goto(URL + '/proxies');
  await admin.waitForSelector('#live[data-state=live]');
  await admin.click('#create-proxy summary');
  const form = admin.locator('#create-proxy form');
  await form.locator('input[name=name]').fill('web-1');
  await form.locator('input[name=labels]').fill('team=crawl');
  await form.locator('select[name=provider]').selectOption('local');
  await form.locator('button[type=submit]').click();
  await admin.waitForSelector('#flash.ok');
  assert.match(await admin.textContent('#flash'), /Proxy web-1 created/);
  // The row appears and turns Ready on its own (the page is not reloaded:
  // a marker set now would be lost by a reload).
  await admin.evaluate(() => { window.__noReload = true; });
  await admin.waitForSelector('.tr[data-name="web-1"] .badge.Ready');
  assert.equal(await admin.evaluate(() => window.__noReload), true);
  await admin.fill('#q', 'team=crawl');
  await admin.waitForFunction(() => document.querySelectorAll('.tr').length === 1);
  await shot(admin, 'proxies');
  await admin.fill('#q', '');
});

test('drain it from its page', async () => {
  await admin.goto(URL + '/proxies/web-1');
  await admin.waitForSelector('#live[data-state=live]');
  assert.match(await admin.textContent('#timeline'), /Running → Ready/);
  await admin.evaluate(() => { window.__noReload = true; });
  await admin.fill('#proxy-actions input[name=timeout]', '30m');
  await admin.click('#drain');
  await admin.waitForSelector('#proxy-draining');
  await admin.waitForFunction(() => /draining/.test(document.getElementById('timeline').textContent));
  assert.equal(await admin.evaluate(() => window.__noReload), true);
  await shot(admin, 'proxy');
});

test('scale a pool and see its proxies appear', async () => {
  await admin.goto(URL + '/pools');
  await admin.click('#create-pool summary');
  const form = admin.locator('#create-pool form');
  await form.locator('input[name=name]').fill('fleet');
  await form.locator('input[name=replicas]').fill('1');
  await form.locator('select[name=provider]').selectOption('local');
  await form.locator('button[type=submit]').click();
  await admin.waitForSelector('#pools-table tr[data-pool="fleet"]');
  await admin.goto(URL + '/pools/fleet');
  await admin.waitForSelector('#live[data-state=live]');
  await admin.waitForFunction(() => document.querySelectorAll('#pool-proxies tbody a').length === 1);
  await admin.evaluate(() => { window.__noReload = true; });
  await admin.fill('#scale-replicas', '3');
  await admin.click('#scale');
  await admin.waitForSelector('#flash.ok');
  await admin.waitForFunction(() => document.querySelectorAll('#pool-proxies tbody a').length === 3);
  await admin.waitForFunction(() => document.querySelectorAll('#pool-proxies .badge.Ready').length === 3);
  await admin.waitForFunction(() => /1 → 3/.test(document.getElementById('pool-scaling')?.textContent || ''));
  assert.equal(await admin.evaluate(() => window.__noReload), true);
  await shot(admin, 'pool');
  await admin.goto(URL + '/pools');
  await admin.waitForSelector('#pools-table tr[data-pool="fleet"]');
  await shot(admin, 'pools');
});

test('a lease acquired by egressctl shows up live', async () => {
  await admin.goto(URL + '/leases');
  await admin.waitForSelector('#live[data-state=live]');
  await admin.evaluate(() => { window.__noReload = true; });
  const out = egressctl('--lease', env('LEASE_ADDR'), 'leases', 'acquire', '--target', 'example.com', '--ttl', '5m', '-l', 'pool=fleet');
  const id = out.split('\n')[1].split(/\s+/)[0];
  await admin.waitForSelector(`#leases-table tr[data-lease="${id}"]`);
  assert.match(await admin.textContent(`#leases-table tr[data-lease="${id}"]`), /crawler-a.*fleet.*example\.com/s);
  egressctl('--lease', env('LEASE_ADDR'), 'leases', 'report', id, '--outcome', 'banned');
  await admin.waitForFunction(() => /banned/.test(document.getElementById('cooldowns-table').textContent));
  assert.equal(await admin.evaluate(() => window.__noReload), true);
  await shot(admin, 'leases');
  await admin.goto(URL + '/providers');
  await admin.waitForSelector('section.provider[data-provider="local"] .badge');
  await shot(admin, 'providers');
  await admin.goto(URL + '/');
  await admin.waitForFunction(() => document.getElementById('ov-leases')?.textContent.trim() === '1');
  await shot(admin, 'overview');
});

test('a viewer sees everything and no action; a forced action is refused', async () => {
  const v = await page();
  await signIn(v, env('VIEWER_TOKEN'));
  assert.match(await v.textContent('#who'), /viewer/);
  await v.goto(URL + '/pools/fleet');
  const member = await v.getAttribute('#pool-proxies tbody a', 'href', { timeout: WAIT });
  for (const [url, sel] of [['/proxies', '.tr'], [member, '#timeline'], ['/pools/fleet', '#pool-proxies'], ['/leases', '#leases-table'], ['/', '#ov-total']]) {
    await v.goto(URL + url);
    await v.waitForSelector(sel);
    assert.equal(await v.locator('form[data-action], #create-proxy, #create-pool, #proxy-actions, #pool-actions').count(), 0, url + ' offers an action');
  }
  await v.goto(URL + member);
  await v.waitForSelector('#cloud-init-hidden');
  assert.deepEqual(v.errors, []);
  // Forced by hand, with this session's CSRF token: the orchestrator refuses.
  const forced = await v.evaluate(async () => {
    const csrf = document.querySelector('meta[name="csrf-token"]').content;
    const r = await fetch('/actions/pools/fleet/delete', { method: 'POST', headers: { 'X-Requested-With': 'console', 'X-CSRF-Token': csrf } });
    return { status: r.status, body: await r.json() };
  });
  assert.equal(forced.status, 403);
  assert.match(forced.body.error, /needs the role admin; client "dashboard" has viewer/);
  // Without the CSRF token nothing reaches the orchestrator.
  const noToken = await v.evaluate(async () => (await fetch('/actions/pools/fleet/delete', { method: 'POST', headers: { 'X-Requested-With': 'console' } })).status);
  assert.equal(noToken, 403);
  await v.context().close();
});

test('no script error and no CSP violation on any page', async () => {
  assert.deepEqual(admin.errors, []);
});
