#!/usr/bin/env bash
# Installs marl_jax on every worker of a Cloud TPU VM: the source, a Python venv, `pip install -e .[tpu]`.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu_scripts/setup.sh [--name NAME] [--zone ZONE] [--project PROJECT]
                            [--src DIR | --repo URL [--ref REF]] [--python VERSION]
                            [--remote-dir DIR] [--no-check] [--dry-run]

On every worker (gcloud compute tpus tpu-vm ssh --worker=all): puts the project in ~/marl_jax,
creates the venv ~/marl_jax_venv with uv (JAX needs Python >= 3.11; the TPU images ship 3.10),
runs `pip install -e .[tpu]`, and checks that JAX sees the TPU devices of all workers.
Running it again replaces the source and updates the install.

  --src DIR          copy this local checkout (default: the checkout holding this script); in a
                     git checkout only tracked and untracked-but-not-ignored files travel (no
                     .venv, no build outputs); copied with `tpu-vm scp --worker=all --recurse`
  --repo URL         git clone URL on every worker instead
  --ref REF          branch or tag to clone (with --repo; default: the default branch)
  --python VERSION   Python of the venv (default 3.11)
  --remote-dir DIR   checkout path on the workers, relative to the home directory (default
                     marl_jax; the venv is DIR_venv); launch.sh takes the same flag
  --no-check         skip the final device check

EOF
  common_flags_help
}

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SRC=
REPO=
REF=
PYTHON_VERSION=3.11
CHECK=1

while (($#)); do
  case "$1" in
    --src | --repo | --ref | --python | --remote-dir)
      need_value "$@"
      flag=$1
      value=$2
      shift 2
      ;;
    --src=* | --repo=* | --ref=* | --python=* | --remote-dir=*)
      flag=${1%%=*}
      value=${1#*=}
      shift
      ;;
    --no-check)
      CHECK=0
      shift
      continue
      ;;
    *)
      parse_common_flag "$@"
      shift "$FLAG_ARGS"
      continue
      ;;
  esac
  case "$flag" in
    --src) SRC=$value ;;
    --repo) REPO=$value ;;
    --ref) REF=$value ;;
    --python) PYTHON_VERSION=$value ;;
    --remote-dir) REMOTE_DIR=$value ;;
  esac
done

require_target
require_relative_path --remote-dir "$REMOTE_DIR"
if [[ -n $SRC && -n $REPO ]]; then
  die "--src and --repo exclude each other; choose one"
fi
if [[ -n $REF && -z $REPO ]]; then
  die "--ref needs --repo"
fi
if ! [[ $PYTHON_VERSION =~ ^3\.[0-9]+$ ]]; then
  die "--python '$PYTHON_VERSION' must look like 3.11"
fi
if [[ -z $REPO ]]; then
  SRC=${SRC:-$(dirname "${BASH_SOURCE[0]}")/..}
  if [[ ! -f $SRC/setup.cfg ]]; then
    die "--src '$SRC' is not a marl_jax checkout (no setup.cfg)"
  fi
  SRC=$(cd "$SRC" && pwd)
fi

VENV_DIR=${REMOTE_DIR}_venv
python_bin=$REMOTE_HOME/$(quote_word "$VENV_DIR")/bin/python

# copy_project SRC DEST: the project files of SRC into the new directory DEST.
copy_project() {
  mkdir -p "$2"
  if git -C "$1" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$1" ls-files -z --cached --others --exclude-standard |
      tar -C "$1" --null -T - -cf - | tar -C "$2" -xf -
  else
    tar -C "$1" --exclude=.git --exclude=.venv --exclude=__pycache__ --exclude='*.egg-info' \
      -cf - . | tar -C "$2" -xf -
  fi
}

remote_dir_word=$(quote_word "$REMOTE_DIR")
if [[ -n $REPO ]]; then
  clone=(git clone --depth 1)
  if [[ -n $REF ]]; then
    clone+=(--branch "$REF")
  fi
  ssh_all "rm -rf $remote_dir_word && $(quote_words "${clone[@]}" "$REPO" "$REMOTE_DIR")"
else
  if ((DRY_RUN)); then
    stage=${TMPDIR:-/tmp}/marl_jax_src.XXXXXX
    printf '# copy the project files of %s into %s\n' "$(quote_word "$SRC")" \
      "$(quote_word "$stage/$(basename "$REMOTE_DIR")")"
  else
    stage=$(mktemp -d "${TMPDIR:-/tmp}/marl_jax_src.XXXXXX")
    trap 'rm -rf "$stage"' EXIT
    copy_project "$SRC" "$stage/$(basename "$REMOTE_DIR")"
  fi
  parent=$(dirname "$REMOTE_DIR")
  if [[ $parent == . ]]; then
    ssh_all "rm -rf $remote_dir_word"
  else
    ssh_all "rm -rf $remote_dir_word && mkdir -p $(quote_word "$parent")"
  fi
  run gcloud compute tpus tpu-vm scp "$stage/$(basename "$REMOTE_DIR")" "$TPU_NAME:$REMOTE_DIR" \
    "--zone=$ZONE" "--project=$PROJECT" --worker=all --recurse
fi

# shellcheck disable=SC2016  # $HOME and $PATH expand on the workers
ssh_all "$(join_and \
  'export PATH="$HOME/.local/bin:$PATH"' \
  '{ command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh; }' \
  "uv venv --seed --allow-existing --python $PYTHON_VERSION $REMOTE_HOME/$(quote_word "$VENV_DIR")" \
  "cd $remote_dir_word" \
  "$python_bin -m pip install --progress-bar off -e '.[tpu]'")"

if ((CHECK)); then
  check_code='from marl_jax import distributed; distributed.initialize(); import jax; '
  check_code+='print(f"process {jax.process_index()} of {jax.process_count()}: '
  check_code+='{jax.local_device_count()} local / {jax.device_count()} global '
  check_code+='{jax.devices()[0].device_kind} devices")'
  ssh_all "cd $remote_dir_word && $python_bin -c $(quote_word "$check_code")"
fi
