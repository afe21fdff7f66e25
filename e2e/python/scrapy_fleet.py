#!/usr/bin/env python3
"""A Scrapy crawl through onceproxy for the e2e tests: the README's Scrapy
recipes. The proxy comes from the environment (https_proxy / http_proxy,
read by Scrapy's HttpProxyMiddleware) or, with "meta_proxy", from each
request's meta["proxy"]; credentials in the proxy URL become
Proxy-Authorization. Scrapy does not verify TLS certificates by default, so
onceproxy's are accepted as they are.

Reads a JSON job on stdin, prints a JSON summary on stdout:

  {"base": "https://127.0.0.1:PORT", "distinct": 50, "repeat": 10, "concurrency": 32,
   "meta_proxy": "http://user:pass@127.0.0.1:PORT" (optional)}

Every URL is requested `repeat` times with different tracking parameters
(dont_filter: a fleet of spiders, not one spider's dupefilter).
"""
import collections
import json
import sys

import scrapy
from scrapy.crawler import CrawlerProcess

job = json.load(sys.stdin)
summary = {"requests": 0, "ok": 0, "x_cache": collections.Counter(), "status": collections.Counter(),
           "errors": [], "scrapy_version": scrapy.__version__}


class Fleet(scrapy.Spider):
    name = "fleet"

    def start_requests(self):
        base = job["base"].rstrip("/")
        for r in range(int(job.get("repeat", 10))):
            for i in range(int(job.get("distinct", 50))):
                url = f"{base}/data/{i}?utm_source=spider{r}&utm_campaign=c{i % 4}"
                meta = {"proxy": job["meta_proxy"]} if job.get("meta_proxy") else {}
                yield scrapy.Request(url, callback=self.parse, errback=self.failed, dont_filter=True,
                                     cb_kwargs={"i": i}, meta=meta)

    def parse(self, response, i):
        summary["requests"] += 1
        summary["status"][str(response.status)] += 1
        summary["x_cache"][response.headers.get("X-Cache", b"").decode()] += 1
        summary["ok"] += response.status == 200 and response.text == f"item {i}\n"

    def failed(self, failure):
        summary["requests"] += 1
        if len(summary["errors"]) < 5:
            summary["errors"].append(repr(failure.value))


process = CrawlerProcess(settings={
    "LOG_LEVEL": "WARNING",
    "TELNETCONSOLE_ENABLED": False,
    "ROBOTSTXT_OBEY": False,
    "RETRY_ENABLED": False,
    "HTTPPROXY_ENABLED": True,
    "CONCURRENT_REQUESTS": int(job.get("concurrency", 32)),
    "CONCURRENT_REQUESTS_PER_DOMAIN": int(job.get("concurrency", 32)),
    "DOWNLOAD_TIMEOUT": 30,
    "REQUEST_FINGERPRINTER_IMPLEMENTATION": "2.7",
})
process.crawl(Fleet)
process.start()
json.dump(summary, sys.stdout)
print()
