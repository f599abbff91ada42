#!/usr/bin/env bash
# Submit a cpkv scaling sweep (`cpkv bench`) to a running Ray cluster as a Ray job.
#
#   cluster/submit-scaling.sh [--no-wait] [--dry-run] [-- extra cpkv bench args]
#
# The cluster's job API must be reachable at $RAY_ADDRESS (default
# http://127.0.0.1:8265): `ray dashboard cluster/ray-up.yaml` for a `ray up`
# cluster, `kubectl port-forward svc/cpkv-head-svc 8265:8265` for KubeRay.
# This checkout is uploaded as the job's working_dir (first on PYTHONPATH on every
# node), so the cluster runs this code; the nodes need cpkv's dependencies
# (torch, triton), which ray-up.yaml and kuberay-raycluster.yaml install.
# A cluster with Ray token auth (default for local Ray since 2.59) also needs
# RAY_AUTH_MODE=token here, and the token in RAY_AUTH_TOKEN or ~/.ray/auth_token.
#
# Overridable environment (defaults in brackets):
#   LANES [1,2,4,8]  CONTEXT [32k,128k]  REQUESTS [8]  PAGE_SIZE [64]
#   STRATEGY [SPREAD]  NUM_GPUS_PER_LANE [1]
#   OUT      [/tmp/cpkv-bench/<submission id>]  results dir on the node running the job
#   JOB_ID   [cpkv-scaling-<UTC time>]           Ray submission id
#   PIP      [matplotlib>=3.7]                   extra pip packages for the job (spaces)
#   RUNTIME_ENV_JSON                             replaces the whole runtime env
set -euo pipefail
# NOTE: a possibly empty array is expanded as ${a[@]+"${a[@]}"}: under set -u, bash < 4.4
# (macOS's 3.2) takes "${a[@]}" of an empty array for an unbound variable.

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

wait_flag=()
dry_run=0
extra=()
while (($#)); do
    case "$1" in
        --no-wait) wait_flag=(--no-wait) ;;
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) echo "submit-scaling.sh: unknown option '$1' (cpkv bench args go after --)" >&2
           exit 2 ;;
    esac
    shift
done

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
LANES="${LANES:-1,2,4,8}"
CONTEXT="${CONTEXT:-32k,128k}"
REQUESTS="${REQUESTS:-8}"
PAGE_SIZE="${PAGE_SIZE:-64}"
STRATEGY="${STRATEGY:-SPREAD}"
NUM_GPUS_PER_LANE="${NUM_GPUS_PER_LANE:-1}"
JOB_ID="${JOB_ID:-cpkv-scaling-$(date -u +%Y%m%dT%H%M%SZ)}"
OUT="${OUT:-/tmp/cpkv-bench/$JOB_ID}"
PIP="${PIP:-matplotlib>=3.7}"

if [[ -z "${RUNTIME_ENV_JSON:-}" ]]; then
    read -r -a pkgs <<<"$PIP"
    pip_json=""
    for pkg in ${pkgs[@]+"${pkgs[@]}"}; do
        pip_json+="${pip_json:+, }\"$pkg\""
    done
    # Ray skips .gitignore'd files itself; these are ignored only locally or are big.
    RUNTIME_ENV_JSON="{\"pip\": [$pip_json], \"excludes\": [\".git\", \".whl\", \"results\", \
\".hypothesis\", \".pytest_cache\", \".ruff_cache\", \"*.egg-info\", \"__pycache__\"]}"
fi

cmd=(
    ray job submit
    --address "$address"
    --submission-id "$JOB_ID"
    --working-dir .
    --runtime-env-json "$RUNTIME_ENV_JSON"
    ${wait_flag[@]+"${wait_flag[@]}"}
    --
    cpkv bench
    --address auto
    --lanes "$LANES"
    --context "$CONTEXT"
    --requests "$REQUESTS"
    --page-size "$PAGE_SIZE"
    --strategy "$STRATEGY"
    --num-gpus-per-lane "$NUM_GPUS_PER_LANE"
    --out "$OUT"
    ${extra[@]+"${extra[@]}"}
)

echo "submitting $JOB_ID to $address"
printf ' %q' "${cmd[@]}"
echo
if ((dry_run)); then
    exit 0
fi

status=0
"${cmd[@]}" || status=$?

cat <<EOF

job:     $JOB_ID  (ray job status|logs|stop $JOB_ID --address $address)
results: $OUT/bench.{json,csv,png} on the node that ran the job (the head by default)
fetch:   ray rsync-down cluster/ray-up.yaml $OUT results/$JOB_ID          # ray up
         kubectl cp \$(kubectl get pod -l ray.io/cluster=cpkv,ray.io/node-type=head \\
             -o name | cut -d/ -f2):$OUT results/$JOB_ID                   # KubeRay
EOF
exit "$status"
