#!/usr/bin/env bash
# Runs `python experiments/run.py FLAGS...` on every worker of a Cloud TPU VM, with per-worker logs.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/launch.sh [--name NAME] [--zone ZONE] [--project PROJECT] [--run-id ID]
                             [--stream] [--logs-dir DIR] [--env KEY=VALUE]... [--remote-dir DIR]
                             [--dry-run] [-- RUN_FLAGS...]
       tpu_scripts/launch.sh --fetch-logs --run-id ID [--logs-dir DIR] [...]
       tpu_scripts/launch.sh --stop --run-id ID [...]

Starts `python experiments/run.py RUN_FLAGS...` on all workers at once (gcloud compute tpus
tpu-vm ssh --worker=all), detached in its own process group, so it outlives the ssh session.
Every worker writes ~/marl_jax_runs/ID/worker-<i>.log (and .pid, and .exit with the exit status at the end).
RUN_FLAGS reach run.py exactly as given, spaces and parentheses included, e.g.
  tpu_scripts/launch.sh --stream -- --config=configs/synthetic.py --workdir=/mnt/shared/run1 \
      --config.seeds="(1, 2, 3)"
Without RUN_FLAGS it runs the default experiment (configs/synthetic.py, workdir runs/synthetic
in the checkout). On more than one host, --workdir must be the same shared directory on every
worker (an NFS / Filestore mount, or a bucket mounted with gcsfuse at the same path).
The command run on every worker is printed first (with --dry-run as a "# ..." line).

  --run-id ID      names the run's log directory (default: run-<UTC date>-<time>)
  --stream         follow worker 0's log until the run ends, then fetch all logs; exits with
                   worker 0's exit status (Ctrl-C stops following; the run goes on)
  --logs-dir DIR   local directory for fetched logs, written to DIR/ID/ (default logs)
  --env KEY=VALUE  environment variable for run.py on every worker (repeatable)
  --remote-dir DIR checkout on the workers, as given to setup.sh (default marl_jax)
  --fetch-logs     only copy the logs of run --run-id from all workers into --logs-dir
  --stop           only stop run --run-id on all workers (SIGTERM to its process group)

EOF
  common_flags_help
}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_ID=
LOGS_DIR=logs
ACTION=launch
STREAM=0
ENV_VARS=()
RUN_ARGS=()

while (($#)); do
  case "$1" in
    --run-id | --logs-dir | --env | --remote-dir)
      need_value "$@"
      flag=$1
      value=$2
      shift 2
      ;;
    --run-id=* | --logs-dir=* | --env=* | --remote-dir=*)
      flag=${1%%=*}
      value=${1#*=}
      shift
      ;;
    --stream)
      STREAM=1
      shift
      continue
      ;;
    --fetch-logs | --stop)
      if [[ $ACTION != launch ]]; then
        die "--fetch-logs and --stop exclude each other"
      fi
      ACTION=${1#--}
      shift
      continue
      ;;
    --)
      shift
      RUN_ARGS=("$@")
      break
      ;;
    *)
      parse_common_flag "$@"
      shift "$FLAG_ARGS"
      continue
      ;;
  esac
  case "$flag" in
    --run-id) RUN_ID=$value ;;
    --logs-dir) LOGS_DIR=$value ;;
    --env) ENV_VARS+=("$value") ;;
    --remote-dir) REMOTE_DIR=$value ;;
  esac
done

require_target
require_relative_path --remote-dir "$REMOTE_DIR"
if [[ -z $RUN_ID ]]; then
  if [[ $ACTION != launch ]]; then
    die "--$ACTION needs --run-id (the id launch.sh printed)"
  fi
  RUN_ID=run-$(date -u +%Y%m%d-%H%M%S)
fi
if ! [[ $RUN_ID =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]]; then
  die "--run-id '$RUN_ID' may contain only letters, digits, _ . - (not first: . -)"
fi
if [[ -z $LOGS_DIR ]]; then
  die "--logs-dir must not be empty"
fi
if [[ $ACTION != launch && ${#RUN_ARGS[@]} -gt 0 ]]; then
  die "--$ACTION takes no run.py flags"
fi
if [[ $ACTION != launch && $STREAM == 1 ]]; then
  die "--stream goes with a launch, not with --$ACTION"
fi
# Unbuffered, so the log (and --stream) shows run.py's output as it is printed.
env_prefix='export PYTHONUNBUFFERED=1; '
for assignment in ${ENV_VARS[@]+"${ENV_VARS[@]}"}; do
  if ! [[ $assignment =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
    die "--env '$assignment' must look like KEY=VALUE"
  fi
  env_prefix+="export ${assignment%%=*}=$(quote_word "${assignment#*=}"); "
done

run_dir=$RUNS_DIR/$RUN_ID
# The worker's index in its slice, from the TPU VM metadata server (the hostname elsewhere).
# shellcheck disable=SC2016  # expands on the workers
worker_id='w=$(curl -sf -H "Metadata-Flavor: Google" http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'

fetch_logs() {
  run mkdir -p "$LOGS_DIR"
  run gcloud compute tpus tpu-vm scp "$TPU_NAME:$run_dir" "$LOGS_DIR" \
    "--zone=$ZONE" "--project=$PROJECT" --worker=all --recurse
}

case "$ACTION" in
  fetch-logs)
    fetch_logs
    exit 0
    ;;
  stop)
    # shellcheck disable=SC2016  # $f and $(cat ...) expand on the workers
    ssh_all "for f in $REMOTE_HOME/$run_dir/worker-*.pid; do if [ -f \"\$f\" ]; then kill -s TERM -- -\"\$(cat \"\$f\")\" 2>/dev/null && echo \"stopped \$f\" || echo \"not running: \$f\"; fi; done"
    exit 0
    ;;
esac

python_bin=$REMOTE_HOME/$(quote_word "${REMOTE_DIR}_venv")/bin/python
run_py="$python_bin experiments/run.py"
if ((${#RUN_ARGS[@]})); then
  run_py+=" $(quote_words "${RUN_ARGS[@]}")"
fi
if ((DRY_RUN)); then
  printf '# every worker runs, in %s: %s\n' "$REMOTE_HOME/$REMOTE_DIR" "$env_prefix$run_py"
else
  printf 'every worker runs, in %s: %s\n' "$REMOTE_HOME/$REMOTE_DIR" "$env_prefix$run_py" >&2
fi
# `set -m` gives the background subshell its own process group (so --stop reaches run.py too);
# the subshell ignores SIGHUP and records run.py's exit status once it ends.
# shellcheck disable=SC2016  # $w, $out, $? and $! expand on the workers
ssh_all "set -e; cd $(quote_word "$REMOTE_DIR"); mkdir -p $REMOTE_HOME/$run_dir; $worker_id; out=$REMOTE_HOME/$run_dir/worker-\$w; set -m; (set +e; trap \"\" HUP; $env_prefix$run_py; echo \"\$?\" > \"\$out.exit\") > \"\$out.log\" 2>&1 < /dev/null & echo \$! > \"\$out.pid\"; echo \"worker \$w: started $RUN_ID (log \$out.log)\""

if ((STREAM)); then
  status=0
  # shellcheck disable=SC2016  # $out and $(cat ...) expand on worker 0
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT" --worker=0 \
    "--command=out=$REMOTE_HOME/$run_dir/worker-0; tail -n +1 -F --pid=\"\$(cat \"\$out.pid\")\" \"\$out.log\"; exit \"\$(cat \"\$out.exit\" 2>/dev/null || echo 1)\"" ||
    status=$?
  fetch_logs
  exit "$status"
fi
if ((!DRY_RUN)); then
  printf '%s\n' "started $RUN_ID on every worker of $TPU_NAME" \
    "  fetch logs: $0 --name $TPU_NAME --zone $ZONE --project $PROJECT --fetch-logs --run-id $RUN_ID" \
    "  stop:       $0 --name $TPU_NAME --zone $ZONE --project $PROJECT --stop --run-id $RUN_ID" >&2
fi
