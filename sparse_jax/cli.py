"""What every entry point (`scripts/*.py`) shares: one error path.

`run(main)` parses the flags and calls `main(argv)` like `absl.app.run`, except that a user
error ends the command with ONE line on stderr and exit status 1:

  error: <what is wrong, the path or field, what to do>

User errors are bad flags and `--config.FIELD` overrides, bad config arguments and values
(ValueError), missing or damaged files, unusable workdirs and full disks (OSError), a
training run stopped by a non-finite loss (FloatingPointError), and a missing optional
dependency (ModuleNotFoundError, e.g. TFDS for CIFAR-10: the message says what to install).
Ctrl-C outside the training loop (which saves a checkpoint itself) ends with "interrupted" and
status 130. Anything else is a bug and keeps its traceback. Set the environment variable
SPARSE_JAX_TRACEBACK=1, or pass `--verbosity=1`, to see the traceback of a user error too.

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

import os
import re
import sys

from absl import app, flags, logging

USER_ERRORS = (ValueError, OSError, FloatingPointError, ModuleNotFoundError)
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
    sys.stderr.write(f"error: {one_line(message)}\n")
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
            if not os.path.isfile(path):
                fail(f"--config: config file {path} not found; give the path of one, e.g. "
                     "configs/quickstart.py", 2)
            import configs  # here: the benchmark scripts run without ml_collections

            try:
                module = configs.module(path)
            except Exception as e:  # noqa: BLE001  (a config file can fail in any way)
                fail(f"--config: {path} cannot be loaded ({type(e).__name__}: {e})", 2)
            if not callable(getattr(module, "get_config", None)):
                fail(f"--config: {path} defines no get_config(arg) function; see "
                     "configs/quickstart.py for one", 2)
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{one_line(str(e)).rstrip('.')}. See --helpshort.", 2)
    except (KeyError, AttributeError) as e:  # a --config.FIELD override that does not exist
        fail(_unknown_config_field(e, argv), 2)
    except ValueError as e:
        fail(str(e), 2)


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
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def run(main, huge_pages: bool = False) -> None:
    """`absl.app.run(main)` with the one error path of the module docstring; `huge_pages`:
    restart under `huge_pages_env` first."""
    try:
        check_environment()
    except ValueError as e:
        fail(str(e), 2)
    if huge_pages:
        _restart_with_huge_pages()

    def guarded(argv):
        if not flags.FLAGS["verbosity"].present:  # Orbax and TFDS log at INFO
            logging.set_verbosity(logging.WARNING)
        try:
            return main(argv)
        except app.UsageError as e:
            fail(str(e), 2)
        except USER_ERRORS as e:
            if _tracebacks_wanted():
                raise
            if isinstance(e, OSError) and e.strerror:  # not "[Errno 5] ..."
                fail(e.strerror + (f": {e.filename}" if e.filename else ""))
            fail(str(e))
        except KeyboardInterrupt:
            if _tracebacks_wanted():
                raise
            fail("interrupted", 130)

    app.run(guarded, flags_parser=parse_flags)
