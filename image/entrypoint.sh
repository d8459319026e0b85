#!/bin/sh
# One image, three programs: the worker (esd-worker), the controller (esd-sweep) and the GPU
# telemetry sidecar (esd-sweep gpu-exporter). Arguments are passed through untouched ("$@"),
# never re-parsed by a shell.
set -eu
case "${1:-}" in
  esd-worker|esd-sweep) exec "$@" ;;
  gpu-exporter) shift; exec esd-sweep gpu-exporter "$@" ;;
  "") echo "usage: esd-worker ARGS | esd-sweep COMMAND ARGS | gpu-exporter ARGS" >&2; exit 2 ;;
  *) exec "$@" ;;
esac
