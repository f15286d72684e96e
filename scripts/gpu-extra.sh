# Sourced ON the GPU machine by the gpu-*.sh benchmark scripts, from the project root: vLLM's staged environment
# (/tmp/site/env.sh), then, once per machine, the service's dependencies the image lacks and the datasets, from the
# bundle scripts/gpu-e2e-pack.sh makes (EXTRA: the staged folder holding its parts), put on PYTHONPATH. Sets DATA
# (the datasets' folder) and DEST (where results go: $OUT, else bench/results/gpu; created).
. /tmp/site/env.sh
EXTRA=${EXTRA:-/var/tmp/stage-extra}
DATA=${DATA:-/var/tmp/extra/data}
if [[ ! -d /tmp/site2 ]]; then
  (cd "$EXTRA" && cat $(ls xpack.part.* | sort) > xpack.tar && sha256sum -c xpack.sha \
    && rm -rf /var/tmp/extra && mkdir -p /var/tmp/extra && tar xf xpack.tar -C /var/tmp/extra)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site2 /var/tmp/extra/wheels/*.whl
fi
export PYTHONPATH=/tmp/site2${PYTHONPATH:+:$PYTHONPATH}
DEST=${OUT:-bench/results/gpu}
mkdir -p "$DEST"
