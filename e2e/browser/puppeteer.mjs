// Drives Debian's Chromium with puppeteer-core for onceproxy's e2e tests:
// the README's Puppeteer recipe (proxy flags, SPKI trust, page.authenticate
// answering the proxy's 407). Reads one JSON job on stdin, prints one JSON
// result on stdout.
//
// Job: {chromium, spki, proxy: "http://127.0.0.1:PORT", username?, password?, url, pages: 2}
import puppeteer from 'puppeteer-core';
import { quietFlags, fenceBypass } from './flags.mjs';

async function readJob() {
  const chunks = [];
  for await (const c of process.stdin) chunks.push(c);
  return JSON.parse(Buffer.concat(chunks).toString('utf8'));
}

async function load(browser, job, label) {
  const page = await browser.newPage();
  if (job.username) await page.authenticate({ username: job.username, password: job.password });
  const responses = [];
  page.on('response', (r) => responses.push({ url: r.url(), status: r.status(), xcache: r.headers()['x-cache'] || '' }));
  const out = { label, responses };
  try {
    const resp = await page.goto(job.url, { waitUntil: 'load', timeout: 30000 });
    out.status = resp.status();
    out.xcache = resp.headers()['x-cache'] || '';
    out.issuer = resp.securityDetails()?.issuer() || '';
    Object.assign(out, await page.evaluate(() => ({
      title: document.getElementById('title')?.textContent || '',
      images: document.images.length,
      imagesLoaded: [...document.images].filter((i) => i.complete && i.naturalWidth > 0).length,
    })));
  } catch (e) {
    out.error = String(e.message || e).split('\n')[0];
  }
  return out;
}

const job = await readJob();
const browser = await puppeteer.launch({
  executablePath: job.chromium,
  headless: true,
  args: [
    ...quietFlags,
    `--proxy-server=${job.proxy}`,
    `--proxy-bypass-list=${fenceBypass}`,
    `--ignore-certificate-errors-spki-list=${job.spki}`,
  ],
});
try {
  const labels = Array.from({ length: job.pages || 1 }, (_, i) => `tab${i}`);
  const pages = await Promise.all(labels.map((l) => load(browser, job, l)));
  process.stdout.write(JSON.stringify({ version: await browser.version(), pages }) + '\n');
} finally {
  await browser.close();
}
