"""The main job, end to end: start vLLM (SmolLM2-135M-Instruct on CPU), ingest docs/, serve, ask two
questions, print answers, sources and cached_tokens, then shut everything down.

    .venv/bin/python scripts/demo.py [--test-model] [--keep-running]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("How does prefixrag order the retrieved chunks in the prompt?",
             "In what order does prefixrag put retrieved chunks into the prompt?")


def start(name: str, argv: list[str], env: dict, log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "w")
    print(f"[demo] starting {name} (log: {log.name})", flush=True)
    return subprocess.Popen(argv, cwd=ROOT, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait(url: str, process: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"[demo] {what} exited with {process.returncode}; see its log")
        try:
            if httpx.get(url, timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"[demo] {what} not ready after {timeout:.0f}s")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def show(number: int, question: str, body: dict) -> None:
    usage = body["usage"]
    print(f"\nQ{number}: {question}\nA{number}: {body['answer'].strip()}")
    for source in body["sources"]:
        print(f"    source: {source['id']}  ({source['headings'] or source['title']}, score {source['score']:.2f})")
    print(f"    strategy={body['strategy']} prompt_tokens={usage['prompt_tokens']} "
          f"cached_tokens={usage['cached_tokens']} ttft={body['timings_ms']['ttft']:.0f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test-model", action="store_true", help="dummy-weight model: fast, but noise text")
    parser.add_argument("--vllm-port", type=int, default=8000)
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    log_dir = ROOT / "data" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    model = ["--test-model"] if args.test_model else ["--model", "smollm2"]
    vllm_url = f"http://127.0.0.1:{args.vllm_port}"
    env = {"RAG_VLLM_URL": vllm_url + "/v1", "RAG_SERVICE__PORT": str(args.port), "RAG_GENERATION__MAX_TOKENS": "80",
           "RAG_GENERATION__REPETITION_PENALTY": "1.1",
           "RAG_TOP_K": "3"}
    processes: list[subprocess.Popen] = []
    try:
        processes.append(start("vllm", [python, "-m", "app.vllm_server", *model, "--port", str(args.vllm_port)],
                               {}, log_dir))
        print("[demo] ingesting docs/ while vLLM starts", flush=True)
        subprocess.run([python, "-m", "ingest", "docs"], cwd=ROOT, check=True)
        wait(vllm_url + "/v1/models", processes[0], 900, "vLLM")
        processes.append(start("app", [python, "-m", "app"], env, log_dir))
        app_url = f"http://127.0.0.1:{args.port}"
        wait(app_url + "/readyz", processes[-1], 300, "prefixrag")
        for number, question in enumerate(QUESTIONS, 1):
            response = httpx.post(app_url + "/ask", json={"question": question}, timeout=300)
            response.raise_for_status()
            show(number, question, response.json())
        print("\n[demo] cached_tokens is what vLLM served from its prefix cache: the stable prefix (system prompt "
              "and, with the default 'auto' strategy on this small corpus, the whole corpus) was pre-warmed at "
              "start-up.")
        if args.test_model:
            print("[demo] note: --test-model has random weights: its answer text is noise.")
        return 0
    finally:
        print("[demo] shutting down", flush=True)
        stop(processes)


if __name__ == "__main__":
    sys.exit(main())
