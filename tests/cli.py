"""`rankmix` commands for the tests, each in a process of its own, as a user runs them.

A fresh interpreter spends seconds of CPU importing torch, torchrec and torchmetrics before
the command starts, and the suite runs well over a hundred commands. So each command is a
child forked from a server process that imported the training stack once (multiprocessing's
forkserver, with preloading): still a process of its own, with its own working folder,
environment, distributed state, signal handlers, exit code and output, without the import.

`spawn` starts the ranks of an in-process multi-rank test the same way (what
`torch.multiprocessing.spawn` does, from the preloaded server instead of fresh interpreters).
Its ranks meet at a `rendezvous_port()`: a store this process holds, as torchrun's agent
holds one for its ranks, so that no other process can take the port before they bind it.

What a fork cannot show, a test that needs it starts a real interpreter instead: a clean
interpreter exit (`tests/test_distributed.py`), signals through torchrun
(`tests/test_lifecycle.py`), and everything under `rankmix launch`, whose ranks torchrun starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from multiprocessing.connection import wait
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the server imports once; the children find it loaded.
_PRELOAD = ["launch.cli", "trainer.run", "trainer.score", "trainer.serving.predict", "launch.sweep", "launch.plan",
            "torch.distributed.optim"]  # the last: what every training and `score --checkpoint` imports on use
_context: multiprocessing.context.ForkServerContext | None = None
_stores: list = []  # the rendezvous stores this process holds, alive until it exits


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        if "RANKMIX_TESTS_CPU_PEAK" not in os.environ:  # for tests/server_peak.py, timed here, not in the server:
            import torch  # it would start its children with OpenMP's threads in use, which a fork does not carry

            from dense.cost import peak_flops
            os.environ["RANKMIX_TESTS_CPU_PEAK"] = repr(peak_flops(torch.device("cpu")))
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([*_PRELOAD, "tests.server_peak"])  # the server's path: the folder it started in
    return _context


def rendezvous_port() -> int:
    """The port of a new rendezvous store held by this process, for ranks started by `spawn`
    or `spawn_fresh` (they set MASTER_PORT to it). The store binds a port it picks itself: a
    port found free and released can be taken by another process before a rank binds it."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _stores.append(store)
    return store.port


def join_held_store(rank: int, fn, *args) -> None:
    """In a rank: join the store at MASTER_PORT as a client (what torchrun's ranks do with
    the agent's store, TORCHELASTIC_USE_AGENT_STORE), then `fn(rank, *args)`."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    fn(rank, *args)


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes forked from the server, meeting at the
    `rendezvous_port()` that `args` carries; raises if one fails."""
    import torch.multiprocessing as mp

    _server()  # the preloading forkserver, started before any other use of it
    mp.start_processes(join_held_store, args=(fn, *args), nprocs=nprocs, start_method="forkserver")


def spawn_fresh(fn, args: tuple, nprocs: int) -> None:
    """`spawn` in fresh interpreters, for tests of how a process exits."""
    import torch.multiprocessing as mp

    mp.spawn(join_held_store, args=(fn, *args), nprocs=nprocs)


def run_env(**extra: str) -> dict[str, str]:
    """This process's environment for a command of its own: no torchrun rank variables (each
    command is a world of its own), Python warnings off (stderr holds only the command's
    messages), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


def rankmix(*args: str, cwd: Path | str = REPO, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`rankmix ARGS` in `cwd` with `env` (default `run_env()`): its exit code, stdout and stderr."""
    env = run_env() if env is None else env
    with tempfile.TemporaryDirectory(prefix="rankmix-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = start_rankmix(list(args), cwd, env, out, err)
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["rankmix", *args], timeout, read_output(out), read_output(err))
        return subprocess.CompletedProcess(["rankmix", *args], child.exitcode, read_output(out), read_output(err))


def rankmix_ranks(world: int, *args: str, timeout: float = 300, env: dict[str, str] | None = None,
                  local_world_size: int = 0) -> subprocess.CompletedProcess:
    """`rankmix train ARGS` on `world` ranks forked from the preloaded server, as
    torchrun would start them (its environment, its agent's store), without the seconds of
    CPU that `rankmix launch` spends importing torchrun and the stack in each fresh rank:
    the exit code is the first failing rank's, stdout rank 0's, stderr every rank's. The
    tests of `rankmix launch` itself (torchrun, its signals) start it for real. `env`: as
    `rankmix`'s (default `run_env()`), the ranks' variables added. `local_world_size`: ranks
    per node, as `--nnodes` nodes of it (default: one node of `world`)."""
    env = run_env() if env is None else env
    if world == 1:
        return rankmix("train", *args, timeout=timeout, env=env)
    port, local = rendezvous_port(), local_world_size or world
    with tempfile.TemporaryDirectory(prefix="rankmix-ranks-") as tmp:
        children, files = [], []
        for rank in range(world):
            ranked = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
                          LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
            out, err = Path(tmp) / f"stdout-{rank}", Path(tmp) / f"stderr-{rank}"
            children.append(start_rankmix(["train", *args], REPO, ranked, out, err))
            files.append((out, err))
        deadline = time.monotonic() + timeout
        while any(c.is_alive() for c in children) and time.monotonic() < deadline:
            if any(c.exitcode not in (None, 0) for c in children):  # torchrun's agent stops the rest then
                deadline = min(deadline, time.monotonic() + 30)
            wait([c.sentinel for c in children if c.is_alive()], timeout=0.5)
        if any(child.is_alive() for child in children):
            for child in children:
                child.kill()
                child.join()
            raise subprocess.TimeoutExpired(["rankmix", "train", *args], timeout)
        code = next((c.exitcode for c in children if c.exitcode != 0), 0)
        return subprocess.CompletedProcess(["rankmix", "train", *args], code, read_output(files[0][0]),
                                           "".join(read_output(err) for _, err in files))


def start_rankmix(argv: list[str], cwd: Path | str, env: dict[str, str], out: Path | str,
                  err: Path | str, append: bool = False) -> multiprocessing.Process:
    """`rankmix ARGV` started in a child of the preloaded server, in `cwd` with `env`, its
    stdout and stderr into `out` and `err` (`append`: written after what they hold, as a
    caller's own /proc/PID/fd/N); not waited for (`rankmix` waits)."""
    child = _server().Process(target=_command, args=(argv, str(cwd), env, str(out), str(err), append))
    child.start()
    return child


def read_output(path: Path) -> str:
    """What the child wrote to `path`; nothing if it died before it opened it."""
    return path.read_text() if path.exists() else ""


def _command(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, append: bool = False) -> None:
    """In the child: become `rankmix ARGV` started in `cwd` with `env`, output to files."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":  # read at start-up only, which the fork skipped
        warnings.simplefilter("ignore")
    flags = os.O_WRONLY | (os.O_APPEND if append else os.O_CREAT | os.O_TRUNC)
    for fd, path in ((1, out), (2, err)):  # file descriptors too: C++ libraries write there
        target = os.open(path, flags)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [str(Path(sys.executable).parent / "rankmix"), *argv]
    from launch.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


SHIM = """#!{python}
# rankmix, forked from the test suite's preloaded server (tests/cli.py, `shim_server`): the
# command line, working folder and environment go over {socket!r}; this process's own stdout and
# stderr receive the output; its exit code is the command's.
import json, os, socket, sys
client = socket.socket(socket.AF_UNIX)
client.connect({socket!r})
request = {{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid()}}
client.sendall(json.dumps(request).encode() + b"\\n")
sys.exit(int(client.makefile().readline()))
"""


@contextlib.contextmanager
def shim_server(folder: Path) -> Iterator[str]:
    """A `rankmix` executable in `folder` whose commands run as `rankmix` children of the
    preloaded server (each a process of its own, as `rankmix(...)` starts them) instead of fresh
    interpreters, which spend seconds importing the stack: for scripts that call
    `.venv/bin/rankmix` many times (the guide's blocks, tests/test_readme.py). Yields its path."""
    import json
    import socketserver

    socket_folder = tempfile.mkdtemp(prefix="rankmix-shim-")  # short: a socket's path has 108 bytes
    socket_path = os.path.join(socket_folder, "socket")

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            request = json.loads(self.rfile.readline())
            fds = [f"/proc/{request['pid']}/fd/{n}" for n in (1, 2)]  # the shim's own output
            child = start_rankmix(request["argv"], request["cwd"], request["env"], *fds, append=True)
            child.join()
            code = child.exitcode
            self.wfile.write(f"{128 - code if code < 0 else code}\n".encode())

    _server()
    server = socketserver.ThreadingUnixStreamServer(socket_path, Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    shim = folder / "rankmix"
    shim.write_text(SHIM.format(python=sys.executable, socket=socket_path))
    shim.chmod(0o755)
    try:
        yield str(shim)
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(socket_folder, ignore_errors=True)
