#!/usr/bin/env python3
"""A Scrapy-style fleet for onceproxy's e2e tests: many threads with their own
requests.Session fetch overlapping URLs through the proxy.

Reads a JSON job on stdin, prints a JSON summary on stdout:

  {"base": "https://127.0.0.1:PORT", "threads": 32, "distinct": 50,
   "mode": "env" | "proxies", "proxy": "http://...", "ca": "/path/ca.pem"}

mode "env": the proxy and the CA come from the environment, the README's
recipe: HTTPS_PROXY / HTTP_PROXY and REQUESTS_CA_BUNDLE.
mode "proxies": per call, proxies={"http": ..., "https": ...} and verify=CA
(the environment is ignored: trust_env = False).

Every thread asks for every one of the distinct URLs once, in its own
order, each with its own tracking parameters (utm_*, gclid, fbclid in
varying order), which onceproxy's key drops.
"""
import collections
import concurrent.futures
import json
import random
import sys
import threading

import requests

job = json.load(sys.stdin)
base = job["base"].rstrip("/")
threads = int(job.get("threads", 32))
distinct = int(job.get("distinct", 50))
mode = job.get("mode", "env")

local = threading.local()


def session():
    s = getattr(local, "s", None)
    if s is None:
        s = requests.Session()
        if mode == "proxies":
            s.trust_env = False  # prove the per-call settings alone do it
        local.s = s
    return s


def tracking(worker, i):
    """Tracking parameters that vary by worker and request, in varying order."""
    params = [f"utm_source=worker{worker}", f"utm_medium=m{i % 3}", f"gclid=g{worker}x{i}", f"fbclid=f{i}"]
    random.Random(worker * 1000 + i).shuffle(params)
    return "&".join(params[: 1 + (worker + i) % len(params)])


def fetch(worker, i):
    url = f"{base}/data/{i}?{tracking(worker, i)}"
    kwargs = {"timeout": 30}
    if mode == "proxies":
        kwargs["proxies"] = {"http": job["proxy"], "https": job["proxy"]}
        kwargs["verify"] = job["ca"]
    try:
        r = session().get(url, **kwargs)
    except requests.RequestException as e:
        return {"error": f"{type(e).__name__}: {e}"}
    ok = r.status_code == 200 and r.text == f"item {i}\n"
    return {"status": r.status_code, "x_cache": r.headers.get("X-Cache", ""), "ok": ok}


def worker(w):
    order = list(range(distinct))
    random.Random(w).shuffle(order)
    return [fetch(w, i) for i in order]


summary = {"requests": 0, "ok": 0, "x_cache": collections.Counter(), "status": collections.Counter(), "errors": []}
with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
    for results in pool.map(worker, range(threads)):
        for res in results:
            summary["requests"] += 1
            if "error" in res:
                if len(summary["errors"]) < 5:
                    summary["errors"].append(res["error"])
                continue
            summary["ok"] += res["ok"]
            summary["x_cache"][res["x_cache"]] += 1
            summary["status"][str(res["status"])] += 1
summary["requests_version"] = requests.__version__
json.dump(summary, sys.stdout)
print()
