"""Runs marl_jax: the default MA-PPO vs PPO experiment, or any stage of any config.

    python experiments/run.py                                   # the default experiment
    python experiments/run.py --config=configs/synthetic.py --config.stage=all --workdir=runs/x
    python experiments/run.py --config=configs/tldr_smollm2.py --config.ppo.ngram=10

`--config.stage` in {sft, rm, ppo, all, experiment, eval}; every field of the config file can be
overridden as `--config.<section>.<field>=<value>`. Running the same command again resumes.

A SIGTERM (the notice a Spot or preemptible VM gets before it goes away) stops the run at the
next step boundary with a checkpoint there, or outside a training loop at the next point where
nothing is half written, every process at the same point, and ends it with one line
`preempted: ...` on stderr and exit status 75 (marl_jax/train/preemption.py); the same command
resumes there. A configuration or input error (a bad config field, a missing data file
or checkpoint) ends the run with one line `error: <message>` on stderr and exit status 2;
`--traceback` shows its traceback instead. Any other error is a bug and always shows its
traceback. Before anything else, an installed dependency outside the range setup.cfg supports
is named in one line: older stops the run (status 2), newer continues
(marl_jax/dependencies.py).
"""
import logging as std_logging
import os
import pathlib
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if __name__ == "__main__":
    # Before any dependency is imported: one line per package outside its supported range.
    from marl_jax import dependencies

    if dependencies.check():
        sys.exit(2)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

# transformers' package logger announces at import that PyTorch is absent (marl_jax needs only its
# tokenizers); a filter on that logger alone drops its notices below ERROR, while the warnings of
# transformers' modules (loggers `transformers.*`, which this filter does not see) still show.
std_logging.getLogger("transformers").addFilter(lambda record: record.levelno >= std_logging.ERROR)

def exit_if_unknown_field(argv) -> None:
    """Ends the process with one line and status 2 when `argv` overrides a field the config
    file does not have (ml_collections raises AttributeError or KeyError for it, while the flag
    is defined when no --config is given, or while flags are parsed)."""
    if "--traceback" in argv:
        return
    from marl_jax import config as config_lib

    config_file, fields = config_lib.command_line_fields(argv)
    try:
        config_lib.check_fields_exist(config_lib.load_config_file(config_file or DEFAULT_CONFIG),
                                      fields)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv):
    """absl's flag parsing, except that a flag it cannot parse (a value of the wrong type) and
    an override of an unknown field end with one line and status 2, as every input error."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except (AttributeError, KeyError):
        exit_if_unknown_field(argv)
        raise


DEFAULT_CONFIG = str(ROOT / "configs" / "synthetic.py")
try:
    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG,
                                    "Experiment config file.", lock_config=True)
except (AttributeError, KeyError):
    exit_if_unknown_field(sys.argv)
    raise
flags.DEFINE_string("workdir", None, "Output directory (default: runs/<config name>).")
flags.DEFINE_bool("traceback", False,
                  "Show the traceback of configuration and input errors, not just their message.")

# The exception types of the project's own checks of configs, data and checkpoints.
INPUT_ERRORS = (ValueError, FileNotFoundError)


def is_input_error(error: BaseException) -> bool:
    """Whether `error` is the project's own message about its input, to be shown without a
    traceback.

    Catching every ValueError would also hide bugs: jax, numpy and the other libraries raise
    ValueError for programming errors too. So an error counts only when it was raised by the
    project's own code (configs/, experiments/ or the marl_jax package) with nothing but that
    code and the standard library (e.g. `open`, `pathlib`) from the first project frame down to
    the raise: not inside a library, nor in project code a library called back (a function jax
    traces, say). jax removes its own frames from the traceback of an error raised while it
    traces; the frames that remain still know their callers (`f_back`), so the frames between two
    entries of the traceback count too.
    """
    if not isinstance(error, INPUT_ERRORS):
        return False
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    first = next((i for i, frame in enumerate(frames) if _is_project(frame.f_code.co_filename)), None)
    if first is None:
        return False
    files = [frames[first].f_code.co_filename]
    for previous, frame in zip(frames[first:], frames[first + 1:]):
        files += [*_callers_between(frame, previous), frame.f_code.co_filename]
    return all(_is_project(f) or _is_stdlib(f) for f in files)


def _callers_between(frame, previous, limit: int = 1000) -> list[str]:
    """File names of the frames that called `frame`, up to `previous` (the traceback entry
    before it), that the traceback does not show; [] where none were removed."""
    names, caller = [], frame.f_back
    while caller is not None and caller is not previous and len(names) < limit:
        names.append(caller.f_code.co_filename)
        caller = caller.f_back
    return names


def _is_stdlib(filename: str) -> bool:
    if filename.startswith("<frozen "):
        return True
    path = pathlib.Path(filename).resolve()
    if {"site-packages", "dist-packages"} & set(path.parts):
        return False
    paths = sysconfig.get_paths()
    return any(path.is_relative_to(pathlib.Path(paths[key]).resolve())
               for key in ("stdlib", "platstdlib"))


def _is_project(filename: str) -> bool:
    import marl_jax

    path = pathlib.Path(filename).resolve()
    return any(path.is_relative_to(folder) for folder in (
        pathlib.Path(marl_jax.__file__).resolve().parent, ROOT / "configs", ROOT / "experiments"))


def _shown(path: str) -> str:
    """A config file path as a user of this checkout would type it."""
    resolved = pathlib.Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    config = flags.FLAGS.config
    config_file = flags.FLAGS["config"].config_filename
    workdir = flags.FLAGS.workdir or os.path.join("runs", pathlib.Path(config_file).stem)
    from marl_jax.train import preemption

    try:
        # Checking the config starts no JAX backend: the XLA flags still take effect after it.
        from marl_jax import config as config_lib, config_check, xla_flags

        config_lib.resolve_size(config, overridden=config_lib.command_line_fields(sys.argv)[1])
        config_check.validate_config(config, config_file=_shown(config_file))
        added = xla_flags.apply(mode=config.model.get("xla_gpu_flags", "auto"))
        if added:
            print(f"XLA flags set for this GPU (config.model.xla_gpu_flags=auto; none sets "
                  f"none): {' '.join(added)} (a flag named in XLA_FLAGS wins)")
        from marl_jax import stages

        stages.run(config, workdir)
    except preemption.Preempted as stop:
        print(stop, file=sys.stderr, flush=True)
        return preemption.EXIT_STATUS
    except INPUT_ERRORS as error:
        if flags.FLAGS.traceback or not is_input_error(error):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
