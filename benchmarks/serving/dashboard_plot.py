"""The Grafana dashboard's series, plotted from a real Prometheus scraping a real server.

Starts an embedded cluster (SmolLM2, one CPU worker, a small KV pool so preemptions happen)
with its HTTP port, a Prometheus (Debian package ``prometheus``) on 127.0.0.1 with
deploy/prometheus.yml pointed at it, drives a few waves of concurrent requests (shared
prefixes, so the prefix cache hits), then asks Prometheus' HTTP API (``query_range``) for
every expression of deploy/grafana/pagedserve.json and draws one subplot per panel.
Writes ``benchmarks/results/dashboard.png``.

Usage::

    .venv/bin/python benchmarks/serving/dashboard_plot.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import yaml

from pagedserve.cluster.client import Client
from pagedserve.cluster.config import CacheConfig, ClusterConfig, ModelConfig, ServerConfig
from pagedserve.cluster.launcher import RAY_ENV, start_cluster
from pagedserve.scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SYSTEM = "You are a concise assistant. Answer in one or two sentences, plainly. " * 3
QUESTIONS = [
    "Why is the sky blue?",
    "What is a bicycle?",
    "Name a primary color.",
    "What is rain?",
    "Why do cats purr?",
    "What is a prime number?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(address: str, i: int, max_tokens: int) -> None:
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
    ]
    with Client(address, timeout_s=600) as c:
        c.generate(chat=chat, max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)


def query_range(port: int, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {"query": expr, "start": start, "end": end, "step": step}
    url = f"http://127.0.0.1:{port}/api/v1/query_range?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.loads(r.read())
    return body["data"]["result"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", default="2,8,16,4", help="concurrent requests per wave")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=48, help="small: forces preemptions")
    ap.add_argument("--preemption-mode", default="swap", help="recompute|swap|auto")
    ap.add_argument("--swap-space-gib", type=float, default=1.0)
    ap.add_argument("--out", default=str(RESULTS / "dashboard.png"))
    args = ap.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("needs the Prometheus server: apt-get install prometheus")
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    config = ClusterConfig(
        model=ModelConfig(model="default"),
        cache=CacheConfig(num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(preemption_mode=args.preemption_mode),
        server=ServerConfig(port=0, http_port=0),
        cpus_per_worker=os.cpu_count() or 1,
        swap_space=int(args.swap_space_gib * (1 << 30)),
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    handle = asyncio.run_coroutine_threadsafe(start_cluster(config), loop).result()
    tmp = Path(tempfile.mkdtemp(prefix="prom"))
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s")
    cfg["scrape_configs"][0]["static_configs"] = [{"targets": [handle.http_address]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    prom = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp / 'data'}",
            "--log.level=warn",
        ],
        start_new_session=True,
    )
    try:
        start = time.time()
        time.sleep(5)
        n = 0
        for wave in (int(w) for w in args.waves.split(",")):
            with ThreadPoolExecutor(wave) as ex:
                list(ex.map(lambda i: one(handle.address, i, args.max_tokens), range(n, n + wave)))
            n += wave
            time.sleep(5)
        end = time.time()
        time.sleep(2)
        dash = json.loads((ROOT / "deploy" / "grafana" / "pagedserve.json").read_text())
        panels = [p for p in dash["panels"] if p.get("targets")]
        cols = 2
        rows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(13, 3.0 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, panels):
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "10s")
                expr = expr.replace('model_name=~"$model_name"', 'model_name=~".+"')
                for series in query_range(port, expr, start, end, 1.0):
                    label = target["legendFormat"]
                    for key, val in series["metric"].items():
                        label = label.replace("{{" + key + "}}", val)
                    ts = [float(t) - start for t, _ in series["values"]]
                    vs = [float(v) for _, v in series["values"]]
                    ax.plot(ts, vs, label=label)
            ax.set_title(panel["title"], fontsize=10)
            ax.set_xlabel("seconds", fontsize=8)
            ax.tick_params(labelsize=8)
            ax.legend(fontsize=7, loc="upper left")
        for ax in list(axes.flat)[len(panels) :]:
            ax.axis("off")
        fig.suptitle(
            f"pagedserve dashboard series from Prometheus ({n} requests in waves "
            f"{args.waves}, {args.num_blocks} KV blocks, SmolLM2-135M on CPU)",
            fontsize=11,
        )
        fig.tight_layout()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=80)
        print(f"wrote {out}")
    finally:
        prom.terminate()
        prom.wait(timeout=10)
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
