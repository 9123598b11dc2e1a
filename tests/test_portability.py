"""localspec without POSIX-only modules, as on Windows (no Windows machine here): every module
imports and the CLI's --help, models and a tiny model's run work when localspec's own code cannot
import fcntl, resource, termios, pwd or grp and os has no wait4, sched_getaffinity or posix_spawnp;
the locks keep their meaning between two processes of that kind; no module calls an os or signal
name that Windows lacks."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import portalocker
import pytest

import localspec
from conftest import tiny_model, tiny_tokenizer
from localspec.base.files import remove_unless_held

WITHOUT_POSIX = textwrap.dedent("""
    import builtins, os, sys

    # Refused to localspec's own modules only: the libraries beneath it (portalocker, psutil, numpy)
    # choose their POSIX or Windows code by platform, so on Linux they rightly import these still.
    WINDOWS_LACKS = {"fcntl", "resource", "termios", "pwd", "grp"}
    real_import = builtins.__import__

    def import_as_on_windows(name, globals=None, locals=None, fromlist=(), level=0):
        if name.partition(".")[0] in WINDOWS_LACKS and (globals or {}).get("__name__", "").startswith("localspec"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = import_as_on_windows
    for name in ("wait4", "sched_getaffinity", "posix_spawnp"):
        delattr(os, name)
""")
CLI = "from localspec.apps.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def run_without_posix(code: str, *args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALSPEC_HOME": str(home), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", WITHOUT_POSIX + code, *args], env=env, text=True,
                          capture_output=True, timeout=600)


IMPORT_EVERYTHING = textwrap.dedent("""
    import importlib, pkgutil
    import localspec

    try:  # the shim itself: a localspec module importing fcntl is refused
        exec("import fcntl", {"__name__": "localspec.probe"})
        sys.exit("the shim let localspec import fcntl")
    except ImportError:
        pass
    failed = []
    for module in pkgutil.walk_packages(localspec.__path__, "localspec.", onerror=failed.append):
        if module.name == "localspec.__main__":
            continue  # importing it runs the CLI (with no arguments, the chat); the CLI runs below
        try:
            importlib.import_module(module.name)
        except Exception as exc:
            failed.append(f"{module.name}: {exc!r}")
    assert not failed, failed

    from pathlib import Path

    import torch
    from localspec.apps.bench import peak_memory_mb
    from localspec.apps.llamacpp import measured_run
    from localspec.kernels import cpu_build

    # Linux's psutil has no peak working set (Windows' figure): no figure rather than a wrong one
    assert peak_memory_mb(torch.device("cpu")) is None
    ran = measured_run([sys.executable, "-c", "print('ran')"], "a child")
    assert ran.stdout.strip() == "ran" and ran.peak_rss_mb is None, ran
    os.environ["CXX"] = "no-such-compiler"
    try:
        cpu_build.build(Path(localspec.__file__).parent / "kernels" / "cpu_w4a8.cpp", Path(os.environ["LOCALSPEC_HOME"]),
                        "probe kernel")
    except cpu_build.KernelUnavailable as exc:
        print(exc)
""")


def test_every_module_imports_and_degrades_without_posix_modules(tmp_path):
    done = run_without_posix(IMPORT_EVERYTHING, home=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("no C++ compiler found"), done.stdout


def test_the_cli_helps_lists_and_runs_a_tiny_model_without_posix_modules(tmp_path):
    folder = tmp_path / "tiny"
    tiny_model("llama", hidden=64).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    home = tmp_path / "home"
    helped = run_without_posix(CLI, "--help", home=home)
    assert helped.returncode == 0 and "run" in helped.stdout, helped.stderr[-3000:]
    listed = run_without_posix(CLI, "models", home=home)
    assert listed.returncode == 0 and "qwen2.5-coder-1.5b" in listed.stdout, listed.stderr[-3000:]
    ran = run_without_posix(CLI, "run", "--model", str(folder), "--max-new-tokens", "4", "--proposer", "ngram",
                            "abc abc", home=home)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip() and "4 tokens" in ran.stderr, ran.stderr[-3000:]


HOLDER = textwrap.dedent("""
    from pathlib import Path
    from localspec.base.files import hold, locked

    folder = Path(sys.argv[1])
    with locked(folder / "registry.toml"):
        held = hold(folder / "complete")
        print("held" if held else "missing", flush=True)
        sys.stdin.readline()
""")


def test_a_hold_and_a_lock_in_another_process_keep_the_folder_until_released(tmp_path):
    root = tmp_path / "root"
    folder = root / "copy"
    folder.mkdir(parents=True)
    (folder / "weights").write_bytes(b"w")
    (folder / "complete").write_text("ok\n")
    holder = subprocess.Popen([sys.executable, "-c", WITHOUT_POSIX + HOLDER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(folder / "registry.toml.lock", "a") as handle, pytest.raises(portalocker.AlreadyLocked):
            portalocker.lock(handle, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING)
        assert not remove_unless_held(folder, folder / "complete", root), "another process holds it"
        assert (folder / "weights").is_file() and (folder / "complete").is_file()
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    assert remove_unless_held(folder, folder / "complete", root) and not folder.exists()


# Names a program is likely to reach for that Windows' os and signal modules do not have.
OS_ONLY_ON_POSIX = {
    "uname", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getpgid", "getpgrp", "setsid", "setpgrp",
    "killpg", "fork", "forkpty", "wait3", "wait4", "waitid", "posix_spawn", "posix_spawnp", "sched_getaffinity",
    "sched_setaffinity", "getloadavg", "statvfs", "fstatvfs", "sync", "mkfifo", "chown", "lchown", "fchown",
    "nice", "pipe2", "openpty", "getpriority", "setpriority", "O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC",
}
SIGNAL_ONLY_ON_POSIX = {"SIGKILL", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGALRM", "SIGPIPE",
                        "SIGSTOP", "SIGCONT", "SIGTSTP", "SIGWINCH", "alarm", "setitimer", "pause", "pthread_kill"}


def _unguarded_posix_names(node: ast.AST) -> list[ast.Attribute]:
    """The os / signal attributes Windows lacks under `node`, but for those in the body of a `try`
    that catches AttributeError (the fallback is then the handler's)."""
    if isinstance(node, ast.Try) and any(
            handler.type is not None and "AttributeError" in ast.unparse(handler.type) for handler in node.handlers):
        children = [*node.handlers, *node.orelse, *node.finalbody]
    else:
        children = list(ast.iter_child_nodes(node))
    found = [node] if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
        (node.value.id == "os" and node.attr in OS_ONLY_ON_POSIX)
        or (node.value.id == "signal" and node.attr in SIGNAL_ONLY_ON_POSIX)) else []
    return found + [name for child in children for name in _unguarded_posix_names(child)]


def test_no_module_calls_what_windows_lacks():
    found = [f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}"
             for path in sorted(Path(localspec.__file__).parent.rglob("*.py"))
             for node in _unguarded_posix_names(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, found


def test_the_check_sees_an_unguarded_call_and_passes_a_guarded_one():
    assert [n.attr for n in _unguarded_posix_names(ast.parse("os.getuid()\nsignal.SIGKILL"))] == ["getuid", "SIGKILL"]
    guarded = "try:\n    n = len(os.sched_getaffinity(0))\nexcept (AttributeError, OSError):\n    os.uname()\n"
    assert [n.attr for n in _unguarded_posix_names(ast.parse(guarded))] == ["uname"]
