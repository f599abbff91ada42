# Sourced by the GPU run scripts: Ray from the wheels in .whl/ (tools/ray-wheels-py312.sh),
# Ray on loopback, unbuffered output, and $OUT ready.
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# The repacked wheel loses exec bits: give Ray's binaries theirs back.
find /tmp/site/ray/core -type f \( -name gcs_server -o -name raylet -o -name '*.so' \) -exec chmod +x {} +
find /tmp/site/bin -type f -exec chmod +x {} + 2>/dev/null
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_DEDUP_LOGS=1
# step SECONDS FILE CMD...: run CMD under a time limit, its output and exit status in $OUT/FILE.
step() {
  local t=$1 name=$2 s=$SECONDS; shift 2
  echo "== $*" > "$OUT/$name"
  timeout "$t" "$@" >> "$OUT/$name" 2>&1
  echo "rc=$? wall $((SECONDS - s))s" >> "$OUT/$name"
}
