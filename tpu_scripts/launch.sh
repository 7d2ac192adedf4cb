#!/usr/bin/env bash
# Runs `python experiments/run.py FLAGS...` on every worker of a Cloud TPU VM, with per-worker logs.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/launch.sh [--name NAME] [--zone ZONE] [--project PROJECT] [--run-id ID]
                             [--stream] [--logs-dir DIR] [--env KEY=VALUE]... [--remote-dir DIR]
                             [--restart-on-preemption --create-flag=FLAG... [--setup-flag=FLAG]...
                              [--new-vm-command CMD] [--max-restarts N]] [--dry-run]
                             [-- RUN_FLAGS...]
       tpu_scripts/launch.sh --fetch-logs --run-id ID [--logs-dir DIR] [...]
       tpu_scripts/launch.sh --stop --run-id ID [...]

Starts `python experiments/run.py RUN_FLAGS...` on all workers at once (gcloud compute tpus
tpu-vm ssh --worker=all), detached in its own process group, so it outlives the ssh session.
Every worker writes ~/marl_jax_runs/ID/worker-<i>.log (and .pid, and .exit with the exit status at the end).
On SIGTERM (the notice of a Spot or preemptible VM, or --stop) run.py stops at a step boundary
with a checkpoint there, or outside a training loop at a point where nothing is half written,
every worker at the same point, and exits with status 75; the same command resumes there.
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
  --stop           only stop run --run-id on all workers (SIGTERM to its process group: run.py
                   checkpoints the step in flight and exits with 75); never relaunched. After
                   restarts (see below) the run stopped is the live one, the latest ID-rN

  --restart-on-preemption
                   follow the run as --stream does, and start it again whenever it was
                   preempted: when run.py exited with 75 on a VM still up, the same launch as
                   ID-r1, ID-r2, ...; when the VM was preempted (or deleted), first delete what
                   is left of it (teardown.sh), make it again (create.sh with the --create-flag
                   flags) and install (setup.sh with --remote-dir and the --setup-flag flags).
                   run.py resumes from the workdir's checkpoints, so the workdir must outlive
                   the VM (a Filestore/NFS or gcsfuse mount, see --new-vm-command), not sit on
                   its disk. Exits with the run's exit status once it ends otherwise (0: done)
  --create-flag=FLAG
                   a create.sh flag of the VM, for making it again (repeatable; at least one:
                   e.g. --create-flag=--accelerator-type=v4-32 --create-flag=--spot)
  --setup-flag=FLAG
                   a setup.sh flag for installing on the new VM (repeatable; e.g.
                   --setup-flag=--repo=URL; default: copy this checkout)
  --new-vm-command CMD
                   a shell command for every worker of a VM made again, after setup.sh: e.g.
                   mounting the shared workdir
  --max-restarts N relaunches before giving up (default 10)

EOF
  common_flags_help
}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

RUN_ID=
LOGS_DIR=logs
ACTION=launch
STREAM=0
RESTART=0
MAX_RESTARTS=10
ENV_VARS=()
RUN_ARGS=()
CREATE_FLAGS=()
SETUP_FLAGS=()
NEW_VM_COMMAND=
# run.py's exit status when a preemption notice (SIGTERM) stopped it (marl_jax/train/preemption.py).
PREEMPTED_STATUS=75
# Seconds between looks at a VM that is changing state, and how many looks before giving up.
POLL_S=30
MAX_POLLS=60

while (($#)); do
  case "$1" in
    --run-id | --logs-dir | --env | --remote-dir | --max-restarts | --new-vm-command)
      need_value "$@"
      flag=$1
      value=$2
      shift 2
      ;;
    --run-id=* | --logs-dir=* | --env=* | --remote-dir=* | --max-restarts=* | --create-flag=* | \
      --setup-flag=* | --new-vm-command=*)
      flag=${1%%=*}
      value=${1#*=}
      shift
      ;;
    --create-flag | --setup-flag)
      die "$1 takes its value after '=' ($1=--spot), since the value is a flag itself"
      ;;
    --stream)
      STREAM=1
      shift
      continue
      ;;
    --restart-on-preemption)
      RESTART=1
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
    --max-restarts) MAX_RESTARTS=$value ;;
    --create-flag) CREATE_FLAGS+=("$value") ;;
    --setup-flag) SETUP_FLAGS+=("$value") ;;
    --new-vm-command) NEW_VM_COMMAND=$value ;;
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
if [[ $ACTION != launch && $RESTART == 1 ]]; then
  die "--restart-on-preemption goes with a launch, not with --$ACTION"
fi
if ((RESTART)) && ((${#CREATE_FLAGS[@]} == 0)); then
  die "--restart-on-preemption needs the create.sh flags of the VM to make it again after a" \
    "preemption, e.g. --create-flag=--accelerator-type=v4-32 --create-flag=--spot"
fi
if ((!RESTART)) && { ((${#CREATE_FLAGS[@]} + ${#SETUP_FLAGS[@]})) || [[ -n $NEW_VM_COMMAND ]]; }; then
  die "--create-flag, --setup-flag and --new-vm-command go with --restart-on-preemption"
fi
if ! [[ $MAX_RESTARTS =~ ^[0-9]+$ ]]; then
  die "--max-restarts '$MAX_RESTARTS' must be a whole number"
fi
# Unbuffered, so the log (and --stream) shows run.py's output as it is printed.
env_prefix='export PYTHONUNBUFFERED=1; '
for assignment in ${ENV_VARS[@]+"${ENV_VARS[@]}"}; do
  if ! [[ $assignment =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then
    die "--env '$assignment' must look like KEY=VALUE"
  fi
  env_prefix+="export ${assignment%%=*}=$(quote_word "${assignment#*=}"); "
done

# The worker's index in its slice, from the TPU VM metadata server (the hostname elsewhere).
# shellcheck disable=SC2016  # expands on the workers
worker_id='w=$(curl -sf -H "Metadata-Flavor: Google" http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number || hostname)'
SCRIPTS=$(dirname "${BASH_SOURCE[0]}")
TARGET_FLAGS=(--name "$TPU_NAME" --zone "$ZONE" --project "$PROJECT")

# fetch_logs ID: the logs of run ID from every worker, into LOGS_DIR/ID.
fetch_logs() {
  run mkdir -p "$LOGS_DIR"
  run gcloud compute tpus tpu-vm scp "$TPU_NAME:$RUNS_DIR/$1" "$LOGS_DIR" \
    "--zone=$ZONE" "--project=$PROJECT" --worker=all --recurse
}

case "$ACTION" in
  fetch-logs)
    fetch_logs "$RUN_ID"
    exit 0
    ;;
  stop)
    # The live run is the latest of ID, ID-r1, ID-r2, ... on the worker (a VM made again holds
    # only the restarts started on it); the ones before it have ended, and their process group
    # ids may belong to other processes by now. Its `stopped` mark keeps
    # --restart-on-preemption from starting the run again.
    # shellcheck disable=SC2016  # $d, $n, $live, ... expand on the workers
    find_live="runs=$REMOTE_HOME/$RUNS_DIR; live=; latest=-1; for d in \"\$runs/$RUN_ID\" \"\$runs/$RUN_ID\"-r*; do [ -d \"\$d\" ] || continue; n=\${d#\"\$runs/$RUN_ID\"}; case \$n in '') n=0 ;; -r0* | -r | -r*[!0-9]*) continue ;; -r*) n=\${n#-r} ;; *) continue ;; esac; if [ \"\$n\" -gt \"\$latest\" ]; then latest=\$n; live=\$d; fi; done"
    # shellcheck disable=SC2016  # $live, $f and $(cat ...) expand on the workers
    ssh_all "$find_live; if [ -z \"\$live\" ]; then echo \"no run $RUN_ID here\"; exit 0; fi; touch \"\$live/stopped\"; for f in \"\$live\"/worker-*.pid; do if [ -f \"\$f\" ]; then kill -s TERM -- -\"\$(cat \"\$f\")\" 2>/dev/null && echo \"stopped \$f\" || echo \"not running: \$f\"; fi; done"
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

# start_run ID: run.py on every worker, logging to ~/RUNS_DIR/ID/worker-<i>.*
start_run() {
  # `set -m` gives the background subshell its own process group (so --stop reaches run.py too).
  # The subshell ignores SIGHUP, and outlives a SIGTERM to the group (its trap runs once run.py
  # has ended), so that it records run.py's exit status: 75 when run.py stopped at a checkpoint.
  # shellcheck disable=SC2016  # $w, $out, $? and $! expand on the workers
  ssh_all "set -e; cd $(quote_word "$REMOTE_DIR"); mkdir -p $REMOTE_HOME/$RUNS_DIR/$1; $worker_id; out=$REMOTE_HOME/$RUNS_DIR/$1/worker-\$w; set -m; (set +e; trap \"\" HUP; trap : TERM; $env_prefix$run_py; echo \"\$?\" > \"\$out.exit\") > \"\$out.log\" 2>&1 < /dev/null & echo \$! > \"\$out.pid\"; echo \"worker \$w: started $1 (log \$out.log)\""
}

# follow_run ID: worker 0's log until run ID ends there; returns its exit status (1 if none was
# recorded; 255 when ssh fails).
follow_run() {
  # shellcheck disable=SC2016  # $out and $(cat ...) expand on worker 0
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT" --worker=0 \
    "--command=out=$REMOTE_HOME/$RUNS_DIR/$1/worker-0; tail -n +1 -F --pid=\"\$(cat \"\$out.pid\")\" \"\$out.log\"; exit \"\$(cat \"\$out.exit\" 2>/dev/null || echo 1)\""
}

if ((!STREAM && !RESTART)); then
  start_run "$RUN_ID"
  if ((!DRY_RUN)); then
    printf '%s\n' "started $RUN_ID on every worker of $TPU_NAME" \
      "  fetch logs: $0 --name $TPU_NAME --zone $ZONE --project $PROJECT --fetch-logs --run-id $RUN_ID" \
      "  stop:       $0 --name $TPU_NAME --zone $ZONE --project $PROJECT --stop --run-id $RUN_ID" >&2
  fi
  exit 0
fi
if ((!RESTART)); then
  start_run "$RUN_ID"
  status=0
  follow_run "$RUN_ID" || status=$?
  fetch_logs "$RUN_ID"
  exit "$status"
fi

# ---- --restart-on-preemption --------------------------------------------------------------------
say() {
  printf 'launch.sh: %s\n' "$*" >&2
}

# vm_state: the VM's state (READY, PREEMPTED, CREATING, ...), ABSENT when it does not exist,
# UNKNOWN when gcloud could not say.
vm_state() {
  local state err
  err=$(mktemp)
  if state=$(gcloud compute tpus tpu-vm describe "$TPU_NAME" "--zone=$ZONE" \
    "--project=$PROJECT" "--format=value(state)" 2>"$err"); then
    printf '%s\n' "${state:-UNKNOWN}"
  elif grep -q NOT_FOUND "$err"; then
    echo ABSENT
  else
    cat "$err" >&2
    echo UNKNOWN
  fi
  rm -f "$err"
}

# settled_state: vm_state once the VM is in a state that decides what to do (READY, gone,
# preempted, stopped), looking every POLL_S seconds while it changes.
settled_state() {
  local state polls=0
  while :; do
    state=$(vm_state)
    case "$state" in
      READY | ABSENT | PREEMPTED | TERMINATED | FAILED | STOPPED | SUSPENDED) break ;;
    esac
    polls=$((polls + 1))
    if ((polls >= MAX_POLLS)); then
      die "$TPU_NAME stayed $state for $((MAX_POLLS * POLL_S)) s; the run is not started again"
    fi
    say "$TPU_NAME is $state; looking again in $POLL_S s"
    sleep "$POLL_S"
  done
  printf '%s\n' "$state"
}

# remake_vm STATE: delete what is left of the VM, create it again, install on it, prepare it.
remake_vm() {
  local tries=0
  if [[ $1 != ABSENT ]]; then
    run bash "$SCRIPTS/teardown.sh" "${TARGET_FLAGS[@]}"
  fi
  until run bash "$SCRIPTS/create.sh" "${TARGET_FLAGS[@]}" "${CREATE_FLAGS[@]}"; do
    tries=$((tries + 1))
    if ((tries >= MAX_POLLS)); then
      die "create.sh failed $tries times; the run is not started again"
    fi
    say "create.sh failed (Spot capacity may be short); trying again in $POLL_S s"
    sleep "$POLL_S"
    if [[ $(vm_state) != ABSENT ]]; then
      run bash "$SCRIPTS/teardown.sh" "${TARGET_FLAGS[@]}"
    fi
  done
  run bash "$SCRIPTS/setup.sh" "${TARGET_FLAGS[@]}" --remote-dir "$REMOTE_DIR" \
    ${SETUP_FLAGS[@]+"${SETUP_FLAGS[@]}"}
  if [[ -n $NEW_VM_COMMAND ]]; then
    ssh_all "$NEW_VM_COMMAND"
  fi
}

if ((DRY_RUN)); then
  start_run "$RUN_ID"
  follow_run "$RUN_ID"
  printf '# %s\n' "when the VM was preempted or deleted, it is made again with:" \
    "  $(quote_words bash "$SCRIPTS/teardown.sh" "${TARGET_FLAGS[@]}")" \
    "  $(quote_words bash "$SCRIPTS/create.sh" "${TARGET_FLAGS[@]}" "${CREATE_FLAGS[@]}")" \
    "  $(quote_words bash "$SCRIPTS/setup.sh" "${TARGET_FLAGS[@]}" --remote-dir "$REMOTE_DIR" \
      ${SETUP_FLAGS[@]+"${SETUP_FLAGS[@]}"})" \
    "  on every worker: ${NEW_VM_COMMAND:-(no --new-vm-command)}" \
    "then (also after an exit status of $PREEMPTED_STATUS on a VM still up) the same launch runs" \
    "as $RUN_ID-r1, $RUN_ID-r2, ... (at most $MAX_RESTARTS times)"
  exit 0
fi

restarts=0
run_id=$RUN_ID
while :; do
  start_run "$run_id"
  status=0
  follow_run "$run_id" || status=$?
  lost=0
  state=
  while ((status == 255)); do
    # ssh failed: the VM may be going away, or the connection dropped while the run goes on.
    state=$(settled_state)
    [[ $state == READY ]] || break
    lost=$((lost + 1))
    if ((lost >= MAX_POLLS)); then
      die "no ssh to worker 0 of $TPU_NAME for $((MAX_POLLS * POLL_S)) s"
    fi
    sleep "$POLL_S"
    state=
    status=0
    follow_run "$run_id" || status=$?
  done
  if ((status == 0)); then
    fetch_logs "$run_id" || say "could not fetch the logs of $run_id"
    exit 0
  fi
  if [[ -z $state ]]; then
    state=$(settled_state)
  fi
  case "$state" in
    READY)
      fetch_logs "$run_id" || say "could not fetch the logs of $run_id"
      if ((status != PREEMPTED_STATUS)); then
        say "$run_id ended with exit status $status; not started again"
        exit "$status"
      fi
      if run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT" \
        --worker=0 "--command=test -e $REMOTE_HOME/$RUNS_DIR/$run_id/stopped"; then
        say "$run_id was stopped with --stop; not started again"
        exit "$status"
      fi
      say "$run_id stopped at a checkpoint (exit status $status) on a VM still up"
      ;;
    ABSENT | PREEMPTED | TERMINATED | FAILED)
      say "$TPU_NAME is $state, and its logs of $run_id with it"
      ;;
    *)
      say "$TPU_NAME is $state, which no preemption leaves; the run is not started again"
      exit "$status"
      ;;
  esac
  if ((restarts >= MAX_RESTARTS)); then
    say "$run_id was preempted after $restarts restarts (--max-restarts $MAX_RESTARTS); giving up"
    exit "$PREEMPTED_STATUS"
  fi
  if [[ $state != READY ]]; then
    remake_vm "$state"
  fi
  restarts=$((restarts + 1))
  run_id=$RUN_ID-r$restarts
  say "starting the run again as $run_id (restart $restarts of at most $MAX_RESTARTS)"
done
