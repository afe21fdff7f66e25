// Drives Debian's Chromium with playwright-core for onceproxy's e2e tests.
// Reads one JSON job on stdin, prints one JSON result on stdout.
//
// Job: {
//   scenario: "pages" | "status",
//   chromium: "/usr/bin/chromium",
//   spki: "<base64 sha256 of the CA's SPKI>",      // trusted via --ignore-certificate-errors-spki-list
//   proxy: {server, username?, password?} | null, // Playwright's proxy option
//   url: "https://127.0.0.1:PORT/page.html",
//   contexts: 2, pages: 2,                        // pages: browser contexts x tabs, all loading url at once
//   reloads: 1,                                   // then the first tab reloads this many times
//   screenshot: "/path/admin.png"                 // status: full-page screenshot
// }
import { chromium } from 'playwright-core';

import { quietFlags, fenceBypass } from './flags.mjs';

async function readJob() {
  const chunks = [];
  for await (const c of process.stdin) chunks.push(c);
  return JSON.parse(Buffer.concat(chunks).toString('utf8'));
}

async function launch(job) {
  const opts = {
    executablePath: job.chromium,
    headless: true,
    args: [...quietFlags, `--ignore-certificate-errors-spki-list=${job.spki}`],
    timeout: 30000,
  };
  if (job.proxy) opts.proxy = { bypass: fenceBypass, ...job.proxy };
  return chromium.launch(opts);
}

// loadPage opens url in page and reports what the browser saw.
async function loadPage(page, url, label) {
  const responses = [];
  const failed = [];
  page.removeAllListeners('response');
  page.removeAllListeners('requestfailed');
  page.on('response', (r) => {
    const h = r.headers();
    responses.push(r.request().allHeaders().catch(() => ({})).then((rh) => ({
      url: r.url(),
      status: r.status(),
      type: r.request().resourceType(),
      xcache: h['x-cache'] || '',
      upstream: h['x-onceproxy-upstream'] || '',
      // What Chromium sent that matters to a cache.
      sent: Object.fromEntries(['accept', 'cache-control', 'pragma', 'if-none-match', 'if-modified-since']
        .filter((k) => rh[k] !== undefined).map((k) => [k, rh[k]])),
    })));
  });
  page.on('requestfailed', (r) => failed.push({ url: r.url(), error: r.failure()?.errorText || '' }));
  const out = { label, responses, failed };
  try {
    const resp = url
      ? await page.goto(url, { waitUntil: 'load', timeout: 30000 })
      : await page.reload({ waitUntil: 'load', timeout: 30000 });
    out.status = resp ? resp.status() : 0;
    out.xcache = resp ? resp.headers()['x-cache'] || '' : '';
    out.protocol = resp ? (await resp.securityDetails())?.protocol || '' : '';
    out.issuer = resp ? (await resp.securityDetails())?.issuer || '' : '';
    await page.waitForFunction(() => document.getElementById('fetched')?.textContent !== 'pending', null, { timeout: 15000 });
    Object.assign(out, await page.evaluate(() => ({
      title: document.getElementById('title')?.textContent || '',
      images: document.images.length,
      imagesLoaded: [...document.images].filter((i) => i.complete && i.naturalWidth > 0).length,
      appRuns: window.appRuns || 0,
      fetched: document.getElementById('fetched')?.textContent || '',
      h1Color: getComputedStyle(document.getElementById('title')).color,
    })));
  } catch (e) {
    out.error = String(e.message || e).split('\n')[0];
  }
  out.responses = await Promise.all(responses);
  return out;
}

async function pages(job) {
  const browser = await launch(job);
  try {
    const tabs = [];
    for (let c = 0; c < (job.contexts || 1); c++) {
      const ctx = await browser.newContext();
      for (let p = 0; p < (job.pages || 1); p++) tabs.push({ page: await ctx.newPage(), label: `context${c}/tab${p}` });
    }
    // Every tab loads the page at the same moment.
    const results = await Promise.all(tabs.map((t) => loadPage(t.page, job.url, t.label)));
    // Then the first tab reloads, as a person pressing F5 would.
    const reloads = [];
    for (let i = 0; i < (job.reloads || 0); i++) {
      reloads.push(await loadPage(tabs[0].page, null, `${tabs[0].label}/reload${i + 1}`));
    }
    return { version: browser.version(), pages: results, reloads };
  } finally {
    await browser.close();
  }
}

async function status(job) {
  const browser = await launch({ ...job, proxy: null });
  try {
    const page = await (await browser.newContext({ viewport: { width: 1100, height: 900 } })).newPage();
    const resp = await page.goto(job.url, { waitUntil: 'load', timeout: 30000 });
    const text = async (id) => (await page.locator('#' + id).textContent())?.trim() || '';
    const out = { status: resp.status(), title: await page.title() };
    for (const id of ['savings', 'requests', 'hit', 'coalesced', 'miss', 'bypass', 'upstream', 'spki']) out[id] = await text(id);
    out.caLink = await page.locator('a[href="/ca.pem"]').count();
    out.recipes = (await page.locator('pre').allTextContents()).join('\n');
    if (job.screenshot) {
      await page.screenshot({ path: job.screenshot, fullPage: true });
      out.screenshot = job.screenshot;
    }
    return out;
  } finally {
    await browser.close();
  }
}

const job = await readJob();
const scenarios = { pages, status };
if (!scenarios[job.scenario]) {
  console.error(`unknown scenario ${job.scenario}`);
  process.exit(2);
}
try {
  process.stdout.write(JSON.stringify(await scenarios[job.scenario](job)) + '\n');
} catch (e) {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
}
