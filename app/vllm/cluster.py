"""``python -m app.cluster --replicas 2 --test-model``: the scale-out topology on one machine, no containers.

Starts N vLLM replicas through ``python -m app.vllm_server`` (the project's flags), a ``chroma run`` server,
vllm-router in front of the replicas with its ``consistent_hash`` policy (prefixrag keys every request by its
prompt's stable prefix in the ``X-Session-ID`` header, so each unit is cached on one replica and served there),
optionally ingests folders into the Chroma server, then serves the app pointed at the router and at Chroma.
Ctrl-C (or SIGTERM) stops everything. Each server logs to its own file under ``--logs``.

On CPU each replica is pinned to its own share of the cores (VLLM_CPU_OMP_THREADS_BIND), on GPUs to its own
device (CUDA_VISIBLE_DEVICES), when there are enough of them.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from app.core.devices import has_cuda
from app.core.version import add_version
from app.vllm.process import Child, app_child, chroma_child, free_port, vllm_argv

# vllm-router's flags, the same in docker/compose.yaml. consistent_hash is keyed by X-Session-ID, which prefixrag
# sets to the prompt's stable prefix (app.rag.affinity); each key has a home replica it returns to after a restart.
# sticky_least_loaded (keyed the same) balanced a skewed stream better (docs/operations.md), but it keeps a key
# where it was last placed: after a replica restarts, the keys that moved off it stay on the survivor, so one
# replica carries them all (tests/cluster caught it). Measured with a SIGKILLed replica: by default the router
# retries a request 5 times on the same (dead) replica, since its circuit opens only after 10 failures, and the
# request fails; with the circuit opening after 2, the third attempt goes to a live replica. Health checks every
# 2 s drop a dead replica after 3 failures (~6 s) and re-admit it after 2 successes; its circuit is retried
# after 10 s (not 60), so a replica that came back gets its units again soon.
ROUTER_FLAGS = ["--policy", "consistent_hash", "--health-check-interval-secs", "2", "--cb-failure-threshold", "2",
                "--cb-timeout-duration-secs", "10"]


def replica_devices(replicas: int, gpu: bool) -> list[dict[str, str]]:
    """Per replica, the env that gives it its own GPU or its own CPU cores; {} each where there are too few."""
    if gpu:
        import torch

        count = torch.cuda.device_count()
        return [{"CUDA_VISIBLE_DEVICES": str(i)} if count >= replicas else {} for i in range(replicas)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < replicas:
        return [{} for _ in range(replicas)]
    share = len(cores) // replicas
    groups = [cores[i * share:(i + 1) * share] for i in range(replicas)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, group))} for group in groups]


class Cluster:
    """The topology as a context manager (the CLI, the scale-out benchmark and the tests use it)."""

    def __init__(self, replicas: int, vllm_flags: list[str], logs: Path, *, first_vllm_port: int,
                 router_port: int | None, router_metrics_port: int | None, chroma_port: int | None,
                 chroma_path: Path, replica_env: dict[str, str] | None = None, startup_timeout_s: float = 900,
                 router_policy: str = ROUTER_FLAGS[1]) -> None:
        """``router_port``/``router_metrics_port`` None: free ones, picked as the router starts (and picked again
        if another process took one meanwhile: the replicas bind ports of their own while they load).
        ``router_policy``: vllm-router's ``--policy`` (benchmarks compare others; the stack uses the default)."""
        logs.mkdir(parents=True, exist_ok=True)
        self.logs, self.startup_timeout_s = logs, startup_timeout_s
        self.router_flags = ["--policy", router_policy, *ROUTER_FLAGS[2:]]  # ROUTER_FLAGS opens with its policy
        self.replica_ports = [first_vllm_port + i for i in range(replicas)]
        devices = replica_devices(replicas, has_cuda())
        self.replicas = [Child(f"vLLM replica {i}", vllm_argv(port, *vllm_flags), logs / f"vllm-{i}.log",
                               devices[i] | (replica_env or {})) for i, port in enumerate(self.replica_ports)]
        self._router_ports = router_port, router_metrics_port
        self.router = self._router_child(router_port or 0, router_metrics_port or 0)  # 0: picked as it starts
        self.chroma_port = chroma_port
        self.chroma = None if chroma_port is None else chroma_child(chroma_path, chroma_port, logs / "chroma.log")

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.replica_ports]

    @property
    def router_url(self) -> str:
        """What the app's PREFIXRAG_VLLM_URL is set to."""
        return f"http://127.0.0.1:{self.router_port}/v1"

    @property
    def chroma_url(self) -> str | None:
        return None if self.chroma_port is None else f"http://127.0.0.1:{self.chroma_port}"

    def app_env(self) -> dict[str, str]:
        chroma = {"PREFIXRAG_CHROMA_URL": self.chroma_url} if self.chroma_url else {}
        return {"PREFIXRAG_VLLM_URL": self.router_url} | chroma

    def __enter__(self) -> Cluster:
        try:
            for child in self.replicas + ([self.chroma] if self.chroma else []):
                child.start()  # all at once: replicas load in parallel
            if self.chroma:
                self.chroma.wait_for(f"{self.chroma_url}/api/v2/heartbeat", 120)
            for i in range(len(self.replicas)):
                self.wait_replica(i)
            self._start_router()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _router_child(self, port: int, metrics_port: int) -> Child:
        self.router_port = port
        return Child("vllm-router", [
            sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *self.replica_urls, *self.router_flags,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)], self.logs / "router.log")

    def _start_router(self) -> None:
        """Start it and wait until it serves; where its ports were ours to pick, a router that exits at once (a
        port taken since it was picked) is started again on new ones."""
        ours = self._router_ports == (None, None)
        attempts = 3 if ours else 1
        for attempt in range(1, attempts + 1):
            if ours:
                self.router = self._router_child(free_port(), free_port())
            try:
                self.router.start().wait_for(f"http://127.0.0.1:{self.router_port}/readiness", 120)
                return
            except RuntimeError:  # it exited (a timeout is not retried)
                if attempt == attempts:
                    raise

    def wait_replica(self, index: int) -> None:
        self.replicas[index].wait_for(f"{self.replica_urls[index]}/v1/models", self.startup_timeout_s)

    def kill_replica(self, index: int) -> None:
        """SIGKILL one replica and its engine (a crash, for failure benchmarks and tests)."""
        self.replicas[index].kill()

    def restart_replica(self, index: int, wait: bool = True) -> None:
        self.replicas[index].start()
        if wait:
            self.wait_replica(index)

    def __exit__(self, *exc: object) -> None:
        for child in [self.router, *self.replicas, *([self.chroma] if self.chroma else [])]:
            child.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas behind the router (default 2)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="what each replica serves: an HF id or folder, or 'smollm2'")
    model.add_argument("--test-model", action="store_true", help="the dummy-weight CPU test model")
    p.add_argument("--max-model-len", type=int, help="each replica's context window (launcher default if unset)")
    p.add_argument("--port", type=int, default=8080, help="the app's port (default 8080)")
    p.add_argument("--router-port", type=int, default=8000, help="vllm-router's port (default 8000)")
    p.add_argument("--router-metrics-port", type=int, default=8009, help="vllm-router's Prometheus port")
    p.add_argument("--vllm-port", type=int, default=8001, help="first replica's port; the next ones follow")
    p.add_argument("--chroma-port", type=int, default=8002, help="the Chroma server's port (default 8002)")
    p.add_argument("--chroma-path", type=Path, default=Path("data/chroma-server"), help="the Chroma server's data")
    p.add_argument("--ingest", type=Path, nargs="*", default=[], help="folders to ingest before serving")
    p.add_argument("--logs", type=Path, default=Path("data/cluster-logs"), help="one log file per server here")
    return add_version(p).parse_args(argv)


def serve(env: dict[str, str]) -> int:
    """The app in the foreground; on Ctrl-C/SIGTERM it is sent SIGTERM, so it drains (PREFIXRAG_TRAFFIC__DRAIN_S)."""
    return app_child(None, env).start().wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = ["--test-model"] if args.test_model else ["--model", args.model]
    flags += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the topology like Ctrl-C
    print(f"[prefixrag] starting {args.replicas} vLLM replicas, vllm-router and Chroma (logs in {args.logs})",
          flush=True)
    try:
        with Cluster(args.replicas, flags, args.logs, first_vllm_port=args.vllm_port, router_port=args.router_port,
                     router_metrics_port=args.router_metrics_port, chroma_port=args.chroma_port,
                     chroma_path=args.chroma_path) as cluster:
            env = os.environ | cluster.app_env()
            print(f"[prefixrag] router {cluster.router_url} -> {', '.join(cluster.replica_urls)}; Chroma "
                  f"{cluster.chroma_url}", flush=True)
            for folder in args.ingest:
                subprocess.run([sys.executable, "-m", "ingest", str(folder)], env=env, check=True)
            return serve(env | {"PREFIXRAG_SERVICE__PORT": str(args.port)})
    except KeyboardInterrupt:
        print("[prefixrag] stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
