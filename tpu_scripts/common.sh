# shellcheck shell=bash disable=SC2034  # the variables are read by the scripts that source this file
# Shared by the Cloud TPU VM scripts (sourced, never run): the --name/--zone/--project/--dry-run/
# --help flags, checks with clear messages, and running or printing gcloud commands.
#
# A script defines `usage` (prints its help), sources this file, and in its flag loop hands
# every flag it does not know to `parse_common_flag "$@"; shift "$FLAG_ARGS"`.

# Values from the environment; the flags below win.
TPU_NAME=${TPU_NAME:-}
ZONE=${ZONE:-}
PROJECT=${PROJECT:-}
DRY_RUN=0
FLAG_ARGS=0

# Layout on every TPU VM worker, relative to the home directory.
REMOTE_DIR=marl_jax          # the project checkout (setup.sh --remote-dir, launch.sh --remote-dir)
RUNS_DIR=marl_jax_runs       # <RUNS_DIR>/<run id>/worker-<i>.{log,pid,exit}
# Remote paths start with this unquoted tilde, so the worker's shell expands it to its home.
REMOTE_HOME='~'

SCRIPT_NAME=$(basename "$0")

die() {
  printf '%s: error: %s\n' "$SCRIPT_NAME" "$*" >&2
  exit 1
}

# need_value FLAG [VALUE...]: the flag is followed by a value (not another flag).
need_value() {
  if (($# < 2)) || [[ $2 == --* ]]; then
    die "$1 needs a value"
  fi
}

# parse_common_flag "$@": consumes one shared flag; sets FLAG_ARGS to the number of words used.
parse_common_flag() {
  case "$1" in
    --name | --zone | --project)
      need_value "$@"
      set_common "${1#--}" "$2"
      FLAG_ARGS=2
      ;;
    --name=* | --zone=* | --project=*)
      local flag=${1%%=*}
      set_common "${flag#--}" "${1#*=}"
      FLAG_ARGS=1
      ;;
    --dry-run)
      DRY_RUN=1
      FLAG_ARGS=1
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      die "unknown argument '$1' (see $SCRIPT_NAME --help)"
      ;;
  esac
}

set_common() {
  case "$1" in
    name) TPU_NAME=$2 ;;
    zone) ZONE=$2 ;;
    project) PROJECT=$2 ;;
  esac
}

common_flags_help() {
  cat <<'EOF'
Common flags (each also read from the environment; a flag wins over the variable):
  --name NAME        TPU VM name                      (TPU_NAME)
  --zone ZONE        zone, e.g. us-central2-b         (ZONE)
  --project PROJECT  Google Cloud project id          (PROJECT)
  --dry-run          print the commands, one per line, and run nothing
  -h, --help         this help
EOF
}

# require_target: TPU_NAME, ZONE and PROJECT are all set.
require_target() {
  local variable flag
  for variable in TPU_NAME ZONE PROJECT; do
    if [[ -z ${!variable} ]]; then
      case "$variable" in
        TPU_NAME) flag=--name ;;
        ZONE) flag=--zone ;;
        PROJECT) flag=--project ;;
      esac
      die "$variable is not set: export $variable=... or pass $flag"
    fi
  done
}

# require_relative_path FLAG VALUE: a path below the remote home directory (no ~, .., or /...).
require_relative_path() {
  if ! [[ $2 =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*$ ]]; then
    die "$1 '$2' must be a path relative to the home directory on the TPU VM (letters, digits, _ . - /; no ~ or ..)"
  fi
}

# quote_word WORD: WORD as one shell word, single-quoted unless it is plainly safe.
quote_word() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    local squote="'"
    printf "'%s'" "${1//$squote/$squote\\$squote$squote}"
  fi
}

# quote_words WORD...: the words quoted and joined by spaces (a command line the shell re-splits
# into exactly these words).
quote_words() {
  local word first=1
  for word in "$@"; do
    ((first)) || printf ' '
    first=0
    quote_word "$word"
  done
}

# join_and STEP...: the shell steps joined with " && ".
join_and() {
  local step first=1
  for step in "$@"; do
    ((first)) || printf ' && '
    first=0
    printf '%s' "$step"
  done
}

# run COMMAND [ARG...]: print it (dry run) or show it on stderr and run it.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(quote_words "$@")"
  else
    printf '+ %s\n' "$(quote_words "$@")" >&2
    "$@"
  fi
}

# ssh_all COMMAND_LINE: run a shell command line on every worker, concurrently.
ssh_all() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "--zone=$ZONE" "--project=$PROJECT" \
    --worker=all "--command=$1"
}
