#!/usr/bin/env bash
# Run one ESD sweep on a Kubernetes cluster from CI (or a terminal) and collect its outcome.
#
# `esd-sweep run --backend kubernetes --wait` runs here, shards the models not done yet into
# Indexed Jobs on the cluster of the current kubeconfig context, waits for them, and writes
# report.json; summary.csv is then copied out of the result store. Re-running it only does
# what is missing, and a run that was cut off (CI timeout) is re-attached by the next one.
#
# Needs: esd-sweep on PATH (pip install ".[s3,kube]" in this repository), KUBECONFIG for a
# context allowed what manifests/base/rbac.yaml grants, the store's credentials in the
# environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL…), and in the
# cluster the namespace and Secrets of docs/kubernetes.md (the workers read those, not these).
#
# Environment:
#   ESD_OUTPUT      result store URL (required), e.g. s3://esd-results/sweeps/atlas
#   MODEL_LIST      models CSV, a path or a store URL (required: the list decides what is
#                   analysed and written to the store, so no example list stands in for it;
#                   manifests/components/model-list-configmap/models.csv is a small one)
#   ESD_NAMESPACE   namespace of the worker Jobs (default: esd-sweep)
#   ESD_IMAGE       worker image (read by esd-sweep itself; default: its built-in tag)
#   ESD_EXTRA_ARGS  more `esd-sweep run` flags, split on spaces (default: --no-telemetry,
#                   since pod IPs are not reachable from outside the cluster; drop it on a
#                   runner inside the cluster network)
#   OUT_DIR         where report.json and summary.csv are written (default: ./sweep-out)
#   PYTHON          the Python that has esd-sweep installed (default: python3)
#
# Exit status: esd-sweep's. 0 every model done; 1 some models failed (see report.json);
# 2 usage or configuration error; 3 infrastructure (cluster or store unreachable, RBAC).
set -euo pipefail

# A missing setting is a usage error: exit 2, as esd-sweep's own (1 would read as "some
# models failed" to whoever checks the status).
usage() { echo "run-sweep: $1" >&2; exit 2; }
[ -n "${ESD_OUTPUT:-}" ] || usage "set ESD_OUTPUT to the result store, e.g. s3://bucket/prefix"
[ -n "${MODEL_LIST:-}" ] || usage "set MODEL_LIST to the models CSV (a path or a store URL, \
e.g. s3://bucket/lists/models.csv)"
model_list=$MODEL_LIST
namespace=${ESD_NAMESPACE:-esd-sweep}
out_dir=${OUT_DIR:-sweep-out}
python=${PYTHON:-python3}
read -r -a extra_args <<< "${ESD_EXTRA_ARGS---no-telemetry}"

mkdir -p "$out_dir"
status=0
esd-sweep run \
  --backend kubernetes \
  --model-list "$model_list" \
  --output-dir "$ESD_OUTPUT" \
  --namespace "$namespace" \
  --service-account esd-sweep-worker \
  --hf-token-secret hf-token:token \
  --s3-secret s3-credentials \
  --wait \
  --report "$out_dir/report.json" \
  "${extra_args[@]}" || status=$?

# summary.csv from the store (written when the run got that far), with the project's own
# store code, so whatever URL esd-sweep accepted works here too.
if ! "$python" - "$ESD_OUTPUT" "$out_dir/summary.csv" <<'PY'
import sys
from pathlib import Path

from esd_worker.core.store.opener import open_store

data = open_store(sys.argv[1]).get_bytes("summary.csv")
if data is None:
    sys.exit(f"no summary.csv in {sys.argv[1]}")
Path(sys.argv[2]).write_bytes(data)
PY
then
  echo "run-sweep: summary.csv not copied (see above); the run's exit status was $status" >&2
fi

echo "run-sweep: esd-sweep exited $status; report: $out_dir/report.json" >&2
exit "$status"
