#!/usr/bin/env bash
# Deletes a Cloud TPU VM (every worker of a pod slice), without a confirmation prompt.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: tpu_scripts/teardown.sh [--name NAME] [--zone ZONE] [--project PROJECT] [--async] [--dry-run]

Deletes the TPU VM with `gcloud compute tpus tpu-vm delete --quiet` (no prompt). Its disks and
everything on them (the checkout, the venv, ~/marl_jax_runs logs) go with it: fetch the logs
first (launch.sh --fetch-logs) and keep checkpoints in a gs:// workdir.

  --async   return at once instead of waiting for the deletion to finish

USAGE
  common_flags_help
}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ASYNC=()
while (($#)); do
  case "$1" in
    --async)
      ASYNC=(--async)
      shift
      ;;
    *)
      parse_common_flag "$@"
      shift "$FLAG_ARGS"
      ;;
  esac
done

require_target
run gcloud compute tpus tpu-vm delete "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT" --quiet \
  ${ASYNC[@]+"${ASYNC[@]}"}
