#!/usr/bin/env bash
# Creates a Cloud TPU VM (a single host or a pod slice) for marl_jax.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/create.sh [--name NAME] [--zone ZONE] [--project PROJECT]
                             [--accelerator-type TYPE] [--version RUNTIME] [--spot | --preemptible]
                             [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Creates the TPU VM with `gcloud compute tpus tpu-vm create`.

  --accelerator-type TYPE  TPU type and size (default v4-8): v4-8 (one host), v4-32 (4 hosts),
                           v5litepod-8, v5p-8, v6e-8, ...
  --version RUNTIME        TPU software (runtime) version. Default by TPU generation:
                             v2, v3, v4     tpu-ubuntu2204-base
                             v5e (v5litepod) v2-alpha-tpuv5-lite
                             v5p            v2-alpha-tpuv5
                             v6e            v2-alpha-tpuv6e
                           (list them: gcloud compute tpus tpu-vm versions list --zone=ZONE)
  --spot                   Spot VM: much cheaper, may be preempted at any time
  --preemptible            preemptible VM (older pricing model; runs at most 24 h)
  -- FLAGS...              passed to gcloud unchanged (e.g. -- --reserved --internal-ips)

EOF
  common_flags_help
}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ACCELERATOR_TYPE=v4-8
VERSION=
SPOT=0
PREEMPTIBLE=0
EXTRA=()

while (($#)); do
  case "$1" in
    --accelerator-type)
      need_value "$@"
      ACCELERATOR_TYPE=$2
      shift 2
      ;;
    --accelerator-type=*)
      ACCELERATOR_TYPE=${1#*=}
      shift
      ;;
    --version)
      need_value "$@"
      VERSION=$2
      shift 2
      ;;
    --version=*)
      VERSION=${1#*=}
      shift
      ;;
    --spot)
      SPOT=1
      shift
      ;;
    --preemptible)
      PREEMPTIBLE=1
      shift
      ;;
    --)
      shift
      EXTRA=("$@")
      break
      ;;
    *)
      parse_common_flag "$@"
      shift "$FLAG_ARGS"
      ;;
  esac
done

require_target
if ((SPOT && PREEMPTIBLE)); then
  die "--spot and --preemptible exclude each other; choose one"
fi
if ! [[ $ACCELERATOR_TYPE =~ ^[a-z0-9]+-[0-9]+$ ]]; then
  die "--accelerator-type '$ACCELERATOR_TYPE' must look like v4-8, v5litepod-16 or v5p-32"
fi

if [[ -z $VERSION ]]; then
  case "$ACCELERATOR_TYPE" in
    v2-* | v3-* | v4-*) VERSION=tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) VERSION=v2-alpha-tpuv5 ;;
    v6e-*) VERSION=v2-alpha-tpuv6e ;;
    *) die "no default runtime for --accelerator-type '$ACCELERATOR_TYPE'; pass --version" ;;
  esac
fi

command=(gcloud compute tpus tpu-vm create "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT"
  "--accelerator-type=$ACCELERATOR_TYPE" "--version=$VERSION")
if ((SPOT)); then
  command+=(--spot)
fi
if ((PREEMPTIBLE)); then
  command+=(--preemptible)
fi
# The ${X[@]+...} form keeps an empty array from tripping `set -u` in bash 3.2 (macOS).
run "${command[@]}" ${EXTRA[@]+"${EXTRA[@]}"}
