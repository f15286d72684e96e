# Sourced ON the GPU machine by gpu-bench.sh and gpu-e2e.sh: start vLLM through the project's own launcher with a
# model of real size (default: the Llama-3.1-8B-shape dummy folder written by `python -m app.testmodel`) unless a
# server already answers on $PORT (a later call on the same warm machine skips the start-up), and check that prefix
# caching is on. Sets URL. (The caller has sourced /tmp/site/env.sh.)
MODEL=${MODEL:-.gpu/llama-3.1-8b-dummy}
BLOCK=${BLOCK:-16}          # CUDA; the CPU backend needs 128
PORT=${PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32768}  # the model folder's max_position_embeddings must allow it
VLLM_EXTRA=${VLLM_EXTRA:-}  # further vLLM flags, e.g. --skip-tokenizer-init or --kv-cache-dtype fp8
URL=http://127.0.0.1:$PORT

up() { python3 -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; }

if ! up && pgrep -f "app\.vllm(_server|\.entry) " > /dev/null; then  # started by an earlier call, still loading
  echo "[gpu-vllm] waiting for the vLLM already starting"
  for _ in $(seq 400); do up && break; sleep 1; done
fi
if ! up; then
  echo "[gpu-vllm] starting vLLM ($MODEL $VLLM_EXTRA) $(date +%T)"
  setsid nohup python3 -m app.vllm.launcher --model "$MODEL" --load-format dummy --block-size "$BLOCK" \
    --max-model-len "$MAX_MODEL_LEN" --dev-mode --port "$PORT" -- $VLLM_EXTRA > /var/tmp/vllm.log 2>&1 &
  server=$!  # the launcher execs vLLM's entry point: this process is the server while it starts
  # Stop waiting once it is gone (a bad flag, a window the model folder does not allow): device time is counted.
  for _ in $(seq 400); do up && break; kill -0 "$server" 2>/dev/null || break; sleep 1; done
  up || { tail -60 /var/tmp/vllm.log; exit 1; }
  echo "[gpu-vllm] vLLM up $(date +%T)"
  head -3 /var/tmp/vllm.log  # the command the launcher ran
else
  echo "[gpu-vllm] reusing the vLLM already serving on $URL"
fi
python3 - "$URL" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1] + "/metrics").read().decode()
info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info")]
print(info[0] if info else "no vllm:cache_config_info")
assert info and 'enable_prefix_caching="True"' in info[0], "prefix caching is off"
PY
