"""The cluster's real vllm-router, started on ports it picks itself: one taken by another process between the
pick and the router's bind (the replicas bind ports of their own while they load) makes the router exit at once;
the cluster starts it again on new ports instead of failing. A stub stands in for the replica (it answers the
router's health checks), so this runs in seconds."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

import app.vllm.cluster as cluster_module
from app.vllm.cluster import Cluster
from app.vllm.process import free_port


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_a_router_port_taken_after_it_was_picked_is_picked_again(tmp_path, monkeypatch):
    replica = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([free_port(), taken.getsockname()[1]])  # the first metrics port picked is one somebody holds
    monkeypatch.setattr(cluster_module, "free_port", lambda: next(picks, None) or free_port())
    cluster = Cluster(1, [], tmp_path, first_vllm_port=replica.server_address[1], router_port=None,
                      router_metrics_port=None, chroma_port=None, chroma_path=tmp_path)
    cluster.replicas = []  # the stub, already serving on the replica's port, is the replica
    try:
        with cluster:
            assert httpx.get(f"http://127.0.0.1:{cluster.router_port}/readiness", timeout=5).status_code == 200
        assert "Address already in use" in (tmp_path / "router.log").read_text()  # the first start did fail
    finally:
        taken.close()
        replica.shutdown()
