"""Each model's run in a fresh process of its own, without paying for the imports nine times.

A server (this file, started once per test process by ``ModelProcesses``) imports what every run imports:
run_transformers_model.py (FLA hidden, then torch, transformers and laqat) and the parts of Dynamo,
AOTAutograd, Inductor and transformers that every compile loads. For each model asked of it, it forks: the
child runs ``run_transformers_model.main(name)`` and exits. Nothing ran in the child's process before
``main`` but those imports: no Dynamo cache, compile record or kernel, as in a process started for the
model alone.

Protocol (one JSON line each way per model): the request names the model and the child's stdout and stderr
files; the child writes main's JSON as the last line of its stdout (a traceback to stderr if main raises),
the reply gives its exit code and the CPU seconds of the child and the compilers it waited for.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).parents[2]
TIMEOUT_S = 1800  # one model's run, as the per-model subprocess had


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_child(runner, request: dict) -> None:
    """In the forked child: main(name), its JSON on the redirected stdout; never returns."""
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's, not the child's
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdin = open(os.devnull)
        signal.alarm(TIMEOUT_S)  # SIGALRM ends the child: a nonzero exit the test reports
        print(json.dumps(runner.main(request["name"])))
        code = 0
    except BaseException:  # noqa: BLE001  (reported through stderr and the exit code)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    sys.path.insert(0, str(ROOT))
    from tests.models import run_transformers_model as runner  # FLA hidden before transformers

    import torch
    import torch._functorch.aot_autograd  # noqa: F401  (what every compile loads; nothing runs)
    import torch._inductor.compile_fx  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    torch.set_num_threads(1)  # as the runner's command line; no thread pool exists when it forks
    for line in sys.stdin:
        request = json.loads(line)
        before = _children_cpu()
        pid = os.fork()
        if pid == 0:
            _run_child(runner, request)
        _, status = os.waitpid(pid, 0)
        reply = {"returncode": os.waitstatus_to_exitcode(status), "cpu_seconds": _children_cpu() - before}
        print(json.dumps(reply), flush=True)
    own = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"server_cpu_seconds": own.ru_utime + own.ru_stime}), flush=True)


class ModelProcesses:
    """The test side: starts the server on first use; ``run(name, workdir)`` -> (exit code, CPU seconds, stdout,
    stderr) of that model's child."""

    def __init__(self, env: dict):
        self._env, self._server = env, None

    def run(self, name: str, workdir: Path) -> tuple[int, float, str, str]:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True, env=self._env, cwd=ROOT)
        out, err = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
        self._server.stdin.write(json.dumps({"name": name, "stdout": str(out), "stderr": str(err)}) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            return -1, 0.0, "", f"the model server exited with {self._server.wait()}"
        reply = json.loads(line)
        return reply["returncode"], reply["cpu_seconds"], out.read_text(), err.read_text()

    def close(self) -> float:
        """Stops the server; its own CPU seconds (the imports), which no model's run counts."""
        if self._server is None:
            return 0.0
        self._server.stdin.close()
        line = self._server.stdout.readline()
        self._server.wait()
        self._server = None
        return json.loads(line)["server_cpu_seconds"] if line else 0.0


if __name__ == "__main__":
    serve()
