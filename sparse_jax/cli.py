"""What every entry point (`scripts/*.py`) shares: one error path.

`run(main)` parses the flags and calls `main(argv)` like `absl.app.run`, except that a user
error ends the command with ONE line on stderr:

  error: <what is wrong, the path or field, what to do>

and one exit status for each kind: 2 for a bad flag or `--config` value (refused when the flags
are parsed or by the script's `check`, before any work: `BAD_VALUE`), 1 for what only the work
finds (a damaged file, a full disk, a training run stopped by a non-finite loss: `FAILED`).
User errors are bad flags and `--config.FIELD` overrides, bad config arguments and values
(ValueError), missing or damaged files, unusable workdirs and full disks (OSError), a
training run stopped by a non-finite loss (FloatingPointError), and a missing optional
dependency (ModuleNotFoundError, e.g. TFDS for CIFAR-10: the message says what to install).
SIGTERM and Ctrl-C at any instant end the script with one line ("stopped by SIGTERM",
"interrupted") and status 143 or 130, with no child process or temporary file left
(`sparse_jax.stopping`: in the checks and `main` they raise `Stopped` where the script is; the
training loop saves a checkpoint first).
Anything else is a bug and keeps its traceback. Set the environment variable
SPARSE_JAX_TRACEBACK=1, or pass `--verbosity=1`, to see the traceback of a user error too.

`run(main, check=check)`: `check(argv)` runs first, through the same error path, and checks
every flag without doing any work (no compile, no child process, nothing written): a bad value
is refused before any is done. Every script's flags are also held, when they are parsed, to the
rules no script waives (`check_flag_values`: numbers finite, integers within int32, lists not
empty and without repeats unless `list_rules` allows it), and the checks of paths (`input_file`,
`input_dir`, `output_file`, `output_dir`: no file a script did not write in this run is
replaced without its --overwrite), of lists of numbers (`integers`, `numbers`), of time limits
(`seconds`: at most `MAX_SECONDS`, a week) and of sizes against the memory here (`memory_fits`)
name the flag in their one line. tests/bad_flags.py tries every flag of every script with the
values users mistype.

`run(main, huge_pages=True)` (the scripts that compute) first restarts the process, once, with
glibc's malloc backing its large blocks with transparent huge pages (`huge_pages_env`). XLA:CPU
allocates a step's buffers afresh on every call, and glibc maps blocks over 32 MB from the kernel
and unmaps them on free, so every step touched them page by page again: ~390,000 page faults per
training step at context 1,024, a third of the step. With 2 MB pages a step takes ~1,700 and runs
1.5x faster (docs/benchmarks/training). Set SPARSE_JAX_HUGE_PAGES=0 to run without.

The switches SPARSE_JAX_TRACEBACK and SPARSE_JAX_HUGE_PAGES take 1 or 0 (or are unset); any
other value is one `error:` line before anything runs (`check_environment`), not a guess.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import traceback

from absl import app, flags, logging

from sparse_jax import stopping
from sparse_jax.flag_checks import (  # noqa: F401  (the scripts' names for them)
    MAX_INTEGER,
    MAX_SECONDS,
    available_memory,
    input_dir,
    input_file,
    integers,
    memory_fits,
    numbers,
    output_dir,
    output_file,
    seconds,
)
from sparse_jax.stopping import Stopped  # noqa: F401  (the scripts' name for it)

USER_ERRORS = (ValueError, OSError, FloatingPointError, ModuleNotFoundError)
BAD_VALUE = 2  # exit status: a flag or config value refused before any work
FAILED = 1  # exit status: a user error the work itself met
TRACEBACK_ENV = "SPARSE_JAX_TRACEBACK"
HUGE_PAGES_ENV = "SPARSE_JAX_HUGE_PAGES"
_HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) its maps


def one_line(text: str) -> str:
    """`text` as one line: an embedded traceback is reduced to its last line (the exception's
    message), the exception's class name is dropped, and whitespace runs become one space."""
    if "Traceback (most recent call last)" in text:
        head = text.split("Traceback (most recent call last)")[0]
        head = re.sub(r"Error whilst parsing config file:\s*$", "", head.strip())
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = f"{head.strip()} {re.sub(r'^[A-Za-z_.]*(Error|Exception): ', '', last.strip())}"
    return " ".join(text.split())


SWITCHES = (TRACEBACK_ENV, HUGE_PAGES_ENV)  # environment variables that take 1 or 0


def env_switch(name: str, default: bool, env=None) -> bool:
    """The switch `name` of `env` (default: this process's environment): "1" on, "0" off, unset
    or empty `default`; ValueError (one line naming it) for any other value."""
    value = (os.environ if env is None else env).get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"${name}={value!r} must be 1 or 0 (or unset); set it to one of them")
    return default if value == "" else value == "1"


def check_environment(env=None) -> None:
    """ValueError for a malformed value of an environment variable the scripts read."""
    for name in SWITCHES:
        env_switch(name, False, env)


def _tracebacks_wanted() -> bool:
    verbose = "verbosity" in flags.FLAGS and flags.FLAGS.is_parsed() \
        and flags.FLAGS["verbosity"].value >= 1
    return env_switch(TRACEBACK_ENV, False) or verbose


def fail(message: str, status: int = 1):
    """Prints `error: <message>` as one line on stderr and exits with `status`."""
    text = f"error: {one_line(message)}"
    if status - 128 in stopping.SIGNALS:  # a stop's one line (not a second one after it)
        stopping.report(status - 128, text)
    else:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    sys.exit(status)


def _unknown_config_field(error: Exception, argv: list[str]) -> str:
    """The message for a `--config.FIELD=...` naming no field (ml_collections raises a
    KeyError/AttributeError whose text is the field name plus a suggestion)."""
    text = str(error).strip("'\"").replace("\\n", "\n").replace("\\'", "'")
    name, _, hint = text.partition("\n")
    name = name.strip("'\"")
    arg = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                and name in a.split("=")[0].split(".")), f"--config.{name}")
    return f"{arg}: the config has no field {name!r}" + (f" ({hint.strip()})" if hint else "") \
        + "; the fields are listed in configs/common.py"


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with every parsing error as one `error:` line (status 2)."""
    for arg in argv[1:]:  # a missing config file, before ml_collections' long report of it
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1].split(":")[0]
            if os.path.isdir(path):
                fail(f"--config: {path} is a folder; give the path of a config file, e.g. "
                     "configs/quickstart.py", BAD_VALUE)
            if not os.path.isfile(path):
                fail(f"--config: config file {path} not found; give the path of one, e.g. "
                     "configs/quickstart.py", BAD_VALUE)
            import configs  # here: the benchmark scripts run without ml_collections

            try:
                module = configs.module(path)
            except Exception as e:  # noqa: BLE001  (a config file can fail in any way)
                fail(f"--config: {path} cannot be loaded ({type(e).__name__}: {e})", BAD_VALUE)
            if not callable(getattr(module, "get_config", None)):
                fail(f"--config: {path} defines no get_config(arg) function; see "
                     "configs/quickstart.py for one", BAD_VALUE)
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{one_line(str(e)).rstrip('.')}. See --helpshort.", BAD_VALUE)
    except (KeyError, AttributeError) as e:  # a --config.FIELD override that does not exist
        fail(_unknown_config_field(e, argv), BAD_VALUE)
    except ValueError as e:
        fail(str(e), BAD_VALUE)
    try:
        check_flag_values(flags.FLAGS)
    except ValueError as e:
        fail(f"{e}. See --helpshort.", BAD_VALUE)
    fields = [a.split("=")[0][2:] for a in argv[1:] if a.startswith("--config.")]
    for name in sorted({f for f in fields if fields.count(f) > 1}):  # the last one wins, but
        if isinstance(flags.FLAGS[name].value, (tuple, list)):  # a tuple's values are joined
            fail(f"--{name} is given twice, and a tuple field's values would be joined; give "
                 "it once", BAD_VALUE)
    return rest


# The rules every script's flags follow, checked when they are parsed (`check_flag_values`), so
# that a new flag is held to them without a line of its own:
_EMPTY_LISTS: dict[str, str] = {}  # list flags that may be given empty: name -> what it means
_REPEATS: dict[str, str] = {}  # list flags whose items may repeat: name -> why


def list_rules(holder, empty: str | None = None, repeats: str | None = None) -> None:
    """Declares that the list flag of `holder` (a FlagHolder or a name) may be given empty
    (`empty`: what an empty list means) or with an item twice (`repeats`: why); without it
    either is refused when the flags are parsed."""
    name = getattr(holder, "name", holder)
    if empty:
        _EMPTY_LISTS[name] = empty
    if repeats:
        _REPEATS[name] = repeats


def _ours(flag_values) -> list:
    """The flags of this program that are not absl's own (logging, debugging, help)."""
    return [flag for module, module_flags in flag_values.flags_by_module_dict().items()
            if not module.startswith("absl.") for flag in module_flags]


def check_flag_values(flag_values=None) -> None:
    """ValueError (one line naming the flag) for a value no script accepts: a number that is
    not finite, an integer beyond `MAX_INTEGER` where the flag sets no bound of its own, and a
    list given empty, with an empty item or with an item twice (unless `list_rules` allows it).
    Only flags given on the command line are checked."""
    flag_values = flags.FLAGS if flag_values is None else flag_values
    for flag in _ours(flag_values):
        if not flag.present or flag.value is None:
            continue
        name, parser, value = flag.name, flag.parser, flag.value
        given = f"--{name}={flag.serialize().split('=', 1)[-1]}"
        if isinstance(parser, flags.FloatParser) and not math.isfinite(value):
            raise ValueError(f"{given}: not a finite number")
        if isinstance(parser, flags.IntegerParser) and parser.upper_bound is None \
                and abs(value) > MAX_INTEGER:
            raise ValueError(f"{given}: above the limit {MAX_INTEGER:,} (2^31 - 1)")
        if isinstance(parser, flags.ListParser) and not isinstance(flag, flags.MultiFlag):
            if not value and name not in _EMPTY_LISTS:
                default = ",".join(flag.default) if flag.default else "none"
                raise ValueError(f"--{name}= is an empty list: give one or more items, or "
                                 f"leave the flag out for its default ({default})")
            if any(not item.strip() for item in value):
                raise ValueError(f"{given}: an empty item; separate the items by single commas")
            twice = sorted({item for item in value if value.count(item) > 1})
            if twice and name not in _REPEATS:
                raise ValueError(f"{given}: {', '.join(twice)} given twice; give each once")


def preset_total_steps(flag_values=None) -> int | None:
    """For `train.train`: the total_steps of the config file that `--config` names, before the
    command line's `--config.*` overrides, when those leave optimizer.warmup_steps alone (the
    warmup then follows a shortened run: `config.follow_total_steps`); None when they set it.
    `flag_values`: the parsed flags (default: absl's)."""
    from ml_collections import config_flags

    flag = (flags.FLAGS if flag_values is None else flag_values)["config"]
    overrides = config_flags.get_override_values(flag)
    if "optimizer.warmup_steps" in overrides:
        return None
    if "total_steps" not in overrides:
        return flag.value.total_steps
    import configs  # the same file again, without the overrides

    return configs.load(config_flags.get_config_filename(flag)).total_steps


def huge_pages_env(env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with glibc's malloc asked to use transparent
    huge pages for the blocks it maps (GLIBC_TUNABLES, read when a process starts), where this
    host supports it: Linux, glibc >= 2.35, transparent huge pages not "never", and
    SPARSE_JAX_HUGE_PAGES not 0. Elsewhere `env` unchanged."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not _huge_pages_supported(env):
        return env
    env["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGES_TUNABLE}" if tunables \
        else _HUGE_PAGES_TUNABLE
    return env


def _huge_pages_supported(env: dict) -> bool:
    if not env_switch(HUGE_PAGES_ENV, True, env) or not sys.platform.startswith("linux"):
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except (ValueError, OSError, AttributeError):  # not glibc, or no THP
        return False
    major, minor = (int(x) for x in version.split(".")[:2])
    return name == "glibc" and (major, minor) >= (2, 35) and "[never]" not in mode


def _restart_with_huge_pages() -> None:
    """Replaces this process by the same command under `huge_pages_env`, once (the restarted
    process finds the tunable set). Nothing has run yet but imports."""
    env = huge_pages_env()
    if env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        sys.stderr.flush()
        stopping.blocked()  # a signal meanwhile waits for the new process's handler
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
        finally:  # not restarted: the signals act here again
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping.SIGNALS)


def call(fn, argv: list[str], status: int = FAILED):
    """`fn(argv)` through the one error path of the module docstring: a user error ends the
    process with one `error:` line (SystemExit) and `status` (BAD_VALUE for a UsageError;
    `status=BAD_VALUE` for a script's `check`, whose every refusal is of a value). After a stop
    signal, whatever exception the stop became on the way up (a library may wrap it) ends it
    with the stop's line."""
    try:
        return fn(argv)
    except SystemExit:
        raise
    except BaseException as e:
        signum = stopping.received()
        if signum is None and isinstance(e, KeyboardInterrupt):  # Ctrl-C, or a script's own
            signum = getattr(e, "signal", None) or getattr(e, "signum", None) or signal.SIGINT
        if signum is not None:
            if _tracebacks_wanted():
                raise
            stopping.report(signum)
            sys.exit(128 + signum)
        if isinstance(e, app.UsageError):
            fail(str(e), BAD_VALUE)
        if not isinstance(e, USER_ERRORS) or _tracebacks_wanted():
            raise
        if isinstance(e, OSError) and e.strerror:  # not "[Errno 5] ..."
            fail(e.strerror + (f": {e.filename}" if e.filename else ""), status)
        fail(str(e), status)


def run(main, huge_pages: bool = False, check=None) -> None:
    """`absl.app.run(main)` with the one error path of the module docstring and the stops of
    `sparse_jax.stopping`; `huge_pages`:
    restart under `huge_pages_env` first. `check(argv)`: the script's checks of its flags,
    called before `main` through the same error path; it does no work (no compile, no child
    process, nothing written), so that every bad value is refused before any is done
    (tests/bad_flags.py calls it with the values users mistype)."""
    try:
        check_environment()
    except ValueError as e:
        fail(str(e), BAD_VALUE)
    if huge_pages:
        _restart_with_huge_pages()

    stopping.install()

    def guarded(argv):
        if not flags.FLAGS["verbosity"].present:  # Orbax and TFDS log at INFO
            logging.set_verbosity(logging.WARNING)
        stopping.during()
        try:
            if check is not None:
                call(check, argv, BAD_VALUE)
            return call(main, argv)
        finally:
            stopping.after()

    try:
        app.run(guarded, flags_parser=parse_flags)
    except SystemExit as e:  # after a stop: no finalisation (`stopping.exit_now`)
        status = stopping.forced(e.code)
        if stopping.received() is None and status not in (130, 143):
            if not _main_is_a_script():
                raise
            stopping.finish(status)  # a signal during Python's teardown: still the one line
        if stopping.received() is not None:
            stopping.report(stopping.received())
        stopping.exit_now(status)
    except BaseException as e:  # a stop that became another exception (Python turns one in
        # __set_name__ into a RuntimeError), or SPARSE_JAX_TRACEBACK=1: the traceback, the line
        signum = stopping.received() or getattr(e, "signal", None)
        if signum is None and not isinstance(e, KeyboardInterrupt):
            raise
        if _tracebacks_wanted():
            traceback.print_exc()
        stopping.report(signum or signal.SIGINT)
        stopping.exit_now(128 + (signum or signal.SIGINT))


def no_arguments(argv: list[str]) -> None:
    """UsageError for positional arguments (the scripts take flags only)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")


def _main_is_a_script() -> bool:
    """Whether this process runs one of the scripts (scripts/*.py beside this package)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    return bool(path) and os.path.dirname(os.path.abspath(path)) == scripts


if _main_is_a_script():  # from the script's first imports on (`sparse_jax.stopping`)
    stopping.install()
