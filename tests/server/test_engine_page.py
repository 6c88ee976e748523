"""The engine page and the monitoring metrics, against the real tiny-model server: the page's
files, the snapshot routes behind the API key, the block map moving while requests run, the
metrics the founding documents name, the Grafana dashboard's metric names, and the page in a
real headless Chromium (skipped where Debian's chromium and chromium-driver are missing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time

import pytest
import requests

from server_utils import API_KEY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _metric_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names


def _load(server, n: int = 6, max_tokens: int = 400) -> list[threading.Thread]:
    def one(i: int) -> None:
        requests.post(server.url + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": "tiny", "prompt": f"request {i} " * 20, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
        })

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_page_and_assets_are_served(tiny_server):
    r = requests.get(tiny_server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<canvas id="blockmap"' in r.text and "/ui/app.js" in r.text
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = requests.get(f"{tiny_server.url}/ui/{asset}", timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 500
        assert "http://" not in r.text and "https://" not in r.text  # nothing from a CDN
    assert requests.get(tiny_server.url + "/ui/nope.js", timeout=10).status_code == 404


def test_snapshot_needs_the_key(tiny_server):
    r = requests.get(tiny_server.url + "/ui/state", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.get(tiny_server.url + "/ui/state", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    r = requests.get(tiny_server.url + "/ui/state", cookies={"pagedllm_api_key": API_KEY}, timeout=10)
    assert r.status_code == 200
    s = requests.get(tiny_server.url + "/ui/state", headers=AUTH, timeout=10).json()
    assert len(s["block_map"]) == s["num_blocks"] > 0
    assert set(s["block_map"]) <= set(".cus")
    assert s["max_num_batched_tokens"] > 0 and set(s["queues"]) == {"waiting", "running", "swapped"}


def test_events_stream_shows_blocks_and_steps_while_requests_run(tiny_server):
    seen_used, steps, snaps, threads = False, {}, 0, []
    with requests.get(tiny_server.url + "/ui/events", headers=AUTH, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        threads = _load(tiny_server)
        deadline = time.monotonic() + 60
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            s = json.loads(line[6:])
            snaps += 1
            seen_used |= "u" in s["block_map"] or "s" in s["block_map"]
            for rec in s["steps"]:
                steps[rec["index"]] = rec
            if (seen_used and steps and not any(t.is_alive() for t in threads)) or time.monotonic() > deadline:
                break
    for t in threads:
        t.join()
    assert snaps >= 2 and seen_used, "the block map never showed a block in use while 6 requests ran"
    prefill = sum(r["prefill_tokens"] for r in steps.values())
    decodes = sum(r["decodes"] for r in steps.values())
    assert prefill > 0 and decodes > 0
    assert all(r["tokens"] == r["prefill_tokens"] + r["decodes"] for r in steps.values())
    # after the requests end, every block is free again (cached prefixes may stay)
    time.sleep(0.6)
    s = requests.get(tiny_server.url + "/ui/state", headers=AUTH, timeout=10).json()
    if s["queues"]["running"] == 0:
        assert set(s["block_map"]) <= {".", "c"}


def test_monitoring_metrics_are_exported(tiny_server):
    for t in _load(tiny_server, n=3, max_tokens=8):
        t.join()
    text = requests.get(tiny_server.url + "/metrics", timeout=10).text
    names = _metric_names(text)
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds", "iteration_tokens_total",
                 "prompt_tokens_cached_total", "cache_config_info", "kv_cache_fragmentation_perc",
                 "request_rejected_total", "e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert f"pagedllm:{name}" in names or f"pagedllm:{name}_bucket" in names, name
    m = re.search(r'pagedllm:iteration_tokens_total_count\{[^}]*\} ([0-9.]+)', text)
    assert m and float(m.group(1)) > 0
    m = re.search(r'pagedllm:request_prefill_time_seconds_count\{[^}]*\} ([0-9.]+)', text)
    assert m and float(m.group(1)) >= 3
    assert re.search(r'pagedllm:cache_config_info\{[^}]*block_size="16"', text)
    frag = re.search(r'pagedllm:kv_cache_fragmentation_perc\{[^}]*\} ([0-9.e+-]+)', text)
    assert frag and 0.0 <= float(frag.group(1)) <= 1.0
    if not shutil.which("nvidia-smi"):
        assert "pagedllm:gpu_utilization_perc" not in names  # absent on the CPU


def test_dashboard_and_scrape_config_use_exported_metrics(tiny_server):
    text = requests.get(tiny_server.url + "/metrics", timeout=10).text
    exported = _metric_names(text) | {"pagedllm:gpu_utilization_perc", "pagedllm:gpu_memory_used_bytes",
                                      "pagedllm:gpu_memory_total_bytes"}  # GPU-only, checked by name below
    with open(os.path.join(ROOT, "examples", "monitoring", "grafana-dashboard.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"pagedllm:[a-z0-9_]+", e)}
    assert len(used) >= 10
    assert used <= exported, f"the dashboard names metrics the server does not export: {used - exported}"
    with open(os.path.join(ROOT, "examples", "monitoring", "prometheus.yml")) as f:
        assert "metrics_path: /metrics" in f.read()
    gpu = {"pagedllm:gpu_utilization_perc", "pagedllm:gpu_memory_used_bytes", "pagedllm:gpu_memory_total_bytes"}
    src = open(os.path.join(ROOT, "pagedllm", "entrypoints", "openai", "monitoring.py")).read()
    assert all(g in src for g in gpu)


@pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                    reason="needs Debian's chromium and chromium-driver")
def test_page_in_headless_chromium(tiny_server, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1000"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(tiny_server.url + "/")
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: d.find_element(By.ID, "keybox").is_displayed())  # the key is asked for
        driver.find_element(By.ID, "apikey").send_keys(API_KEY)
        driver.find_element(By.ID, "keysave").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")
        map_before = driver.execute_script("return document.getElementById('blockmap').toDataURL()")
        driver.find_element(By.ID, "temperature").clear()
        driver.find_element(By.ID, "temperature").send_keys("0")
        driver.find_element(By.ID, "max_tokens").clear()
        driver.find_element(By.ID, "max_tokens").send_keys("200")
        driver.find_element(By.ID, "prompt").send_keys("Tell me a long story about the sea.")
        driver.find_element(By.ID, "sendbtn").click()
        threads = _load(tiny_server, n=4)  # more running requests: the map must move
        changed = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not changed:
            time.sleep(0.25)
            now = driver.execute_script("return document.getElementById('blockmap').toDataURL()")
            if now != map_before:
                changed.append(now)
        driver.save_screenshot(str(tmp_path / "page-running.png"))
        for t in threads:
            t.join()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta"))
        reply = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
        meta = reply.find_element(By.CSS_SELECTOR, ".meta").text
        driver.save_screenshot(str(tmp_path / "page-done.png"))
        shots = os.environ.get("PAGEDLLM_SCREENSHOT_DIR")
        if shots:
            os.makedirs(shots, exist_ok=True)
            for name in ("page-running.png", "page-done.png"):
                shutil.copy(tmp_path / name, os.path.join(shots, name))
        assert changed, "the KV block map did not change while requests ran"
        assert len(reply.text) > len(meta) + 5, "no streamed text in the reply"
        assert re.search(r"\d+ prompt \+ \d+ completion tokens", meta) and "tok/s" in meta
        assert not driver.find_elements(By.CSS_SELECTOR, ".msg.error")
        # the first /ui/state, before the key was typed in, is an expected 401
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"
                  and not ("/ui/state" in e["message"] and "401" in e["message"])]
        assert not severe, severe
    finally:
        driver.quit()
