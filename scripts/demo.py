"""The main job, end to end: start vLLM (SmolLM2-135M-Instruct on CPU), ingest examples/docs/, serve, ask two
questions, print answers, sources and cached_tokens, then shut everything down.

    .venv/bin/python scripts/demo.py [--test-model]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx

from app.vllm.process import Child, app_child, vllm_argv

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "examples" / "docs"  # the sample corpus
QUESTIONS = ("How does prefixrag order the retrieved chunks in the prompt?",
             "In what order does prefixrag put retrieved chunks into the prompt?")


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
    model = ["--test-model"] if args.test_model else ["--model", "smollm2"]
    vllm_url = f"http://127.0.0.1:{args.vllm_port}"
    env = {"PREFIXRAG_VLLM_URL": vllm_url + "/v1", "PREFIXRAG_LIMITS__MAX_TOKENS": "80",
           "PREFIXRAG_SAMPLING__REPETITION_PENALTY": "1.1", "PREFIXRAG_TOP_K": "3"}
    vllm = Child("vLLM", vllm_argv(args.vllm_port, *model), log_dir / "vllm.log")
    app = app_child(log_dir / "app.log", env, args.port)
    try:
        print(f"[demo] starting vLLM (log: {vllm.log_path})", flush=True)
        vllm.start()
        print(f"[demo] ingesting {DOCS.relative_to(ROOT)}/ while vLLM starts", flush=True)
        subprocess.run([sys.executable, "-m", "ingest", str(DOCS)], cwd=ROOT, check=True)
        vllm.wait_for(vllm_url + "/v1/models", 900)
        print(f"[demo] starting prefixrag (log: {app.log_path})", flush=True)
        app_url = f"http://127.0.0.1:{args.port}"
        app.start().wait_for(app_url + "/readyz", 300)
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
    except (RuntimeError, TimeoutError) as exc:
        print(f"[demo] error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("[demo] shutting down", flush=True)
        app.stop()
        vllm.stop()


if __name__ == "__main__":
    sys.exit(main())
