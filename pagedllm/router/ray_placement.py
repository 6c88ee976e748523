"""Optional placement on Ray (`placement: ray`): each backend with a `launch:` section is started
as a Ray actor that runs `python -m pagedllm.entrypoints.openai_api_server MODEL ARGS` on its node
(with the actor's GPUs), on a free port; the router then routes to the URLs the actors report.
Ray places actors across the cluster of $RAY_ADDRESS (or a local one), so one config describes
a deployment over several machines. Ray is imported only here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request

from pagedllm.router.config import BackendConfig, RouterConfig

logger = logging.getLogger(__name__)


class ServerActor:
    """Runs one pagedllm server process on the actor's node; the actor's death ends it."""

    def __init__(self, model: str, args: list[str], ready_timeout_s: float) -> None:
        host = socket.gethostbyname(socket.gethostname()) if os.environ.get("RAY_ADDRESS") else "127.0.0.1"
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai_api_server", "--model", model,
               "--host", host, "--port", str(port), *args]
        self.proc = subprocess.Popen(cmd)
        self.ready_timeout_s = ready_timeout_s

    def wait_ready(self) -> str:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server for {self.url} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server at {self.url} was not ready after {self.ready_timeout_s} s")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode


class RayPlacement:
    """Starts the config's `launch` backends as Ray actors; `start()` returns the config with
    their URLs filled in, `stop()` ends them."""

    def __init__(self, cfg: RouterConfig, ready_timeout_s: float = 600.0) -> None:
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.actors: list = []

    def start(self) -> RouterConfig:
        import ray

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
        remote = ray.remote(ServerActor)
        pending: list[tuple[int, int, object]] = []
        for ti, tier in enumerate(self.cfg.tiers):
            for bi, b in enumerate(tier.backends):
                if b.launch is None:
                    continue
                actor = remote.options(num_gpus=b.launch.num_gpus, num_cpus=b.launch.num_cpus).remote(
                    b.launch.model, list(b.launch.args), self.ready_timeout_s)
                self.actors.append(actor)
                pending.append((ti, bi, actor.wait_ready.remote()))
        urls = {(ti, bi): ray.get(ref) for ti, bi, ref in pending}
        tiers = []
        for ti, tier in enumerate(self.cfg.tiers):
            backends = []
            for bi, b in enumerate(tier.backends):
                if (ti, bi) in urls:
                    logger.info("tier %s: replica of %s started on Ray at %s", tier.name, b.launch.model, urls[ti, bi])
                    b = BackendConfig(url=urls[ti, bi], models=b.models, api_key=b.api_key, launch=b.launch)
                backends.append(b)
            tiers.append(dataclasses.replace(tier, backends=tuple(backends)))
        return dataclasses.replace(self.cfg, tiers=tuple(tiers))

    def stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=60)
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                logger.exception("stopping a Ray replica failed")
        self.actors.clear()
