// The Proxies page with the fleet the test created (10,000 proxies):
// how long until the table is rendered after navigation, and how long a
// search takes to filter and draw; each beside a baseline measured in the
// same run, alternating. Prints one JSON line of medians; asserts nothing
// about time.
'use strict';
const { chromium } = require('playwright-core');

const URL = process.env.CONSOLE_URL;
const RUNS = Number(process.env.RUNS || 7);
const median = (a) => { const s = [...a].sort((x, y) => x - y); return s[Math.floor(s.length / 2)]; };

(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking'] });
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const p = await ctx.newPage();
  p.setDefaultTimeout(120_000);
  await p.goto(URL + '/signin');
  await p.fill('#token', process.env.ADMIN_TOKEN);
  await Promise.all([p.waitForNavigation(), p.click('#signin-form button')]);
  const want = Number(process.env.PROXIES);
  const load = [], baseline = [], filter = [], clear = [], opened = [], arrived = [];
  for (let i = 0; i < RUNS; i++) {
    // Baseline: the Providers page (a few rows, server-rendered).
    await p.goto(URL + '/providers');
    baseline.push(await p.evaluate(() => performance.getEntriesByType('navigation')[0].loadEventEnd));
    await p.goto(URL + '/proxies');
    await p.waitForFunction((n) => window.__consoleProxiesRendered && Number(document.getElementById('proxy-count').textContent) >= n, want);
    load.push(await p.evaluate(() => window.__consoleProxiesRendered));
    // Where the time went: the page and script until the event stream
    // opens, the console listing the fleet until the snapshot arrives.
    opened.push(await p.evaluate(() => window.__consoleStreamOpened));
    arrived.push(await p.evaluate(() => window.__consoleSnapshotArrived));
    // A search that keeps one proxy in ten, then clearing it (every row
    // again): input event to the next painted frame.
    const timeInput = (value) => p.evaluate((v) => new Promise((resolve) => {
      const q = document.getElementById('q');
      const t0 = performance.now();
      q.value = v;
      q.dispatchEvent(new Event('input'));
      requestAnimationFrame(() => requestAnimationFrame(() => resolve(performance.now() - t0)));
    }), value);
    filter.push(await timeInput('7'));
    clear.push(await timeInput(''));
  }
  const out = { proxies: want, runs: RUNS, loadMs: median(load), providersPageLoadMs: median(baseline),
    filterMs: median(filter), clearFilterMs: median(clear), streamOpenedMs: median(opened), snapshotArrivedMs: median(arrived),
    load, baseline, filter, clear, opened, arrived };
  console.log(JSON.stringify(out));
  await browser.close();
})().catch((e) => { console.error(e); process.exit(1); });
