#!/usr/bin/env bash
# The compose stack, proven on this machine: build the images, bring up the cpu profile (Chroma, one CPU vLLM
# replica, vllm-router, the app), ingest the sample docs through the tools profile, ask /ask, then stop the stack
# while an answer streams and check that the app drained it. Needs root (it installs and starts Docker where
# missing) and the package registries; no image registry: the base image is built from Debian's packages
# (debootstrap + docker import). Its log: docker/smoke.log. Run it before every change to docker/.
#   bash scripts/docker-smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p docker/smoke
exec > >(tee docker/smoke.log) 2>&1
say() { printf '[smoke %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
started=$SECONDS
say "prefixrag $(git describe --always --dirty 2>/dev/null || echo "(not a git checkout)")"

# Docker (the daemon), debootstrap and docker-compose, from Debian.
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (--iptables=false: this machine's network is not Docker's to rewrite)"
  dockerd --iptables=false >docker/smoke/dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker version --format 'docker client {{.Client.Version}}, server {{.Server.Version}}'

# The stand-in for python:3.11-slim: Debian bookworm from Debian's packages, with this machine's own CPython 3.11
# build (bookworm's 3.11.2 is older than the pinned packages allow: soupsieve 4.1.3 needs 3.11.5), its
# site-packages left out.
PYTHON_HOME=$(python3.11 -c 'import sys; print(sys.base_prefix)')
BASE=prefixrag-base:bookworm-py$(python3.11 -c 'import platform; print(platform.python_version())')
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  say "building $BASE with debootstrap and $PYTHON_HOME"
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase \
    --include=ca-certificates,libssl3,libffi8,libsqlite3-0,liblzma5,libbz2-1.0,zlib1g,libreadline8,libuuid1,libgdbm6 \
    bookworm "$rootfs" http://deb.debian.org/debian >docker/smoke/debootstrap.log
  mkdir -p "$rootfs/opt/python3.11"
  tar -C "$PYTHON_HOME" --exclude='./lib/python3.11/site-packages/*' --exclude='__pycache__' -c . \
    | tar -C "$rootfs/opt/python3.11" -x
  echo /opt/python3.11/lib >"$rootfs/etc/ld.so.conf.d/python3.11.conf"
  chroot "$rootfs" ldconfig
  # On PATH where it lies (a venv finds the standard library from the interpreter's own folder).
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/opt/python3.11/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE"
  rm -rf "$rootfs"
fi
docker run --rm "$BASE" python3 -c 'import ssl, sqlite3, venv, sys; print("base:", sys.version.split()[0], ssl.OPENSSL_VERSION)'

# This machine's CPU torch wheel (pip's find-links here): preferred by the image's pip over the registries'.
find "$(pip config get global.find-links 2>/dev/null || echo /opt/wheels)" -name 'torch-*+cpu-cp311-*.whl' \
  -exec cp -u {} docker/wheels/ \; 2>/dev/null || true

# This machine reaches the registries through a TLS-inspecting proxy its own CA bundle trusts: so does the build.
cp /etc/ssl/certs/ca-certificates.crt docker/certs/host.crt

say "building the images (app, vllm-cpu) on $BASE"
for target in app vllm-cpu; do
  tag=$([[ $target == app ]] && echo prefixrag:latest || echo prefixrag-vllm-cpu:latest)
  docker build --network host --build-arg BASE="$BASE" --build-arg TORCH_INDEX= -f docker/Dockerfile \
    --target "$target" -t "$tag" . >docker/smoke/build-$target.log 2>&1 \
    || { tail -n 30 docker/smoke/build-$target.log; exit 1; }
  tail -n 2 docker/smoke/build-$target.log
done
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep prefixrag

compose=(docker-compose -f docker/compose.yaml --env-file docker/smoke/.env -p prefixrag-smoke)
cp docker/.env.example docker/smoke/.env
printf 'APP_ENV_FILE=smoke/.env\nVLLM_CPU_KVCACHE_SPACE=2\nMAX_MODEL_LEN=4096\n' >>docker/smoke/.env
export APP_ENV_FILE=smoke/.env
cleanup() { "${compose[@]}" --profile cpu --profile tools down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup

say "up: --profile cpu"
"${compose[@]}" --profile cpu up -d
for _ in $(seq 120); do
  [[ $("${compose[@]}" ps -q router-cpu | xargs -r docker inspect -f '{{.State.Health.Status}}') == healthy ]] && break
  sleep 5
done
"${compose[@]}" --profile cpu ps

say "ingest: --profile tools (the sample docs)"
"${compose[@]}" --profile tools run --rm ingest /docs

say "waiting for /readyz"
for _ in $(seq 120); do
  curl -sf http://127.0.0.1:8080/readyz >/dev/null && break
  sleep 2
done
curl -s http://127.0.0.1:8080/readyz | python3 -c 'import json, sys; r = json.load(sys.stdin); print("readyz:", \
  {k: r[k] for k in ("ready", "reason", "vllm_url")}, "router:", r["router"], "warmup:", r["warmup"]["state"])'
say "ask"
curl -sf http://127.0.0.1:8080/ask -H 'content-type: application/json' \
  -d '{"question": "How does prefix caching help?", "max_tokens": 16}' | python3 -c \
  'import json, sys; a = json.load(sys.stdin); print("answer:", a["answer"][:80], "| sources:", [s["id"] for s in a["sources"]][:3], "| usage:", a["usage"]); assert a["sources"], "no sources"'

for _ in $(seq 30); do  # the served model's tokenizer loads in the background once vLLM is seen
  "${compose[@]}" logs --no-color app | grep -E "token-id prompts (on|off)" && break
  sleep 2
done
"${compose[@]}" logs --no-color app | grep -q "token-id prompts on" && say "token-id prompts on: the app found the \
served model's tokenizer" || { say "FAILED: token-id prompts off in the app"; exit 1; }

say "down while an answer streams: the app drains it (stop_grace_period above the drain)"
curl -sN http://127.0.0.1:8080/ask -H 'content-type: application/json' \
  -d '{"question": "Write at length about units.", "max_tokens": 400, "stream": true}' >docker/smoke/stream.txt &
streamer=$!
sleep 3
stopping=$SECONDS
"${compose[@]}" --profile cpu stop -t 45 app
say "app stopped after $((SECONDS - stopping)) s"
wait "$streamer" || true
tail -c 300 docker/smoke/stream.txt; echo
"${compose[@]}" logs --no-color app | grep -E "drain|Shutting down|Finished server process|shutting" | tail -n 5
grep -q '^event: done' docker/smoke/stream.txt && say "the streamed answer ended with its done event" \
  || { say "FAILED: the stream did not end with a done event"; exit 1; }
cleanup
trap - EXIT
say "passed in $((SECONDS - started)) s"
