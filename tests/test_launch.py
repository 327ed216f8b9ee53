"""``python -m trainscale.launch``: its flags, every command the book hands a reader, and
one real job watched for listening sockets (plus one stopped with Ctrl-C)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from own_processes import own_children

from trainscale import __main__ as summary
from trainscale import distributed, launch, planner, train
from trainscale.planner import cli as planner_cli

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "python -m trainscale.launch"

# --------------------------------------------------------------------------- the flags


def test_torchruns_common_flags_and_the_modules_own_after_it():
    job = launch.parse(
        ["--nproc-per-node=8", "--max-restarts=1", "-m", "trainscale.train", "--tp", "2", "-m"]
    )
    assert job == launch.Launch("trainscale.train", ("--tp", "2", "-m"), 8, 1)
    assert launch.parse(["--nproc_per_node", "2", "-m", "x"]).nproc_per_node == 2  # torchrun's
    assert launch.parse(["-m", "x"]) == launch.Launch("x", (), 1, 0)  # torchrun's defaults
    assert (
        job.command()
        == f"{LAUNCHER} --nproc-per-node=8 --max-restarts=1 -m trainscale.train --tp 2 -m"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node=0", "-m", "x"], "--nproc-per-node must be a whole number >= 1, got 0"),
        (["--max-restarts=-1", "-m", "x"], "--max-restarts must be a whole number >= 0, got -1"),
        (["--nnodes=2", "-m", "x"], "--nnodes must be 1"),
        (["train.py"], "-m must come before the target"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        launch.parse(argv)
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"{LAUNCHER}: error: {err.split('error: ', 1)[1]}" and err.count("\n") == 1
    assert message in err


def test_no_module_is_argparses_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        launch.main(["--nproc-per-node=2"])
    assert stopped.value.code == 2
    assert "the following arguments are required: target" in capsys.readouterr().err


def test_exit_status_follows_the_shell():
    assert [launch.exit_status(c) for c in (0, 1, 17, -2, -9, -15)] == [0, 1, 17, 130, 137, 143]


@pytest.mark.parametrize(("failures", "status"), [((), 0), ((1,), 1), ((-9, 1), 137)])
def test_the_launcher_returns_the_jobs_exit_status(monkeypatch, failures, status):
    asked = {}

    def job(module, args, **kwargs):
        asked.update(module=module, args=args, **kwargs)
        return distributed.TorchrunJob("", (), 2, 0, 1, failures=failures)

    monkeypatch.setattr(distributed, "run_job", job)
    assert launch.main(["--nproc-per-node=2", "--max-restarts=1", "-m", "m", "--x"]) == status
    assert asked["module"] == "m" and asked["args"] == ["--x"]
    assert (asked["nnodes"], asked["nproc_per_node"], asked["max_restarts"]) == (1, 2, 1)
    assert asked["echo"] is sys.stdout  # streamed to the terminal as it comes


# --------------------------------------------------------------------------- what the book prints

RUN_IT_YOURSELF = {
    "05": "trainscale.workers.data_parallel",
    "06": "trainscale.workers.collectives",
    "07": "trainscale.workers.sharding",
    "08": "trainscale.workers.tensor_parallel",
    "09": "trainscale.workers.pipeline",
    "10": "trainscale.workers.context",
    "11": "trainscale.workers.experts",
    "17": "trainscale.train",
}
"""The chapters that show a reader how to run their real multi-process check themselves,
and the module each runs."""


def _shell_lines(markdown: str) -> list[str]:
    """Each command of the ``bash`` blocks in ``markdown``, continuation lines joined."""
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", markdown, re.S)
    lines = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        lines += [" ".join(line.split()) for line in joined.splitlines() if line.strip()]
    return lines


def _markdown_of(path: Path) -> str:
    if path.suffix == ".md":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _starts_a_job(command: str) -> bool:
    """Whether ``command`` starts ranks: a worker module, the capstone, or torchrun."""
    return bool(re.search(r"-m trainscale\.(workers\.\w+|train)\b|\btorchrun\b", command))


def _printed_commands() -> dict[str, list[str]]:
    """Every command that starts a job, by where the book prints it: the notebooks'
    text, the README, ``python -m trainscale --help``, the capstone's docstring, and
    the planner's ``--laptop`` command."""
    places = [*sorted((ROOT / "notebooks").glob("*.ipynb")), ROOT / "README.md"]
    found = {
        path.name: [c for c in _shell_lines(_markdown_of(path)) if _starts_a_job(c)]
        for path in places
    }
    # --help's commands are indented by two spaces, what each does by six.
    help_lines = re.findall(r"^  (\S.*)$", summary.COMMANDS, re.M)
    found["python -m trainscale --help"] = [c for c in help_lines if _starts_a_job(c)]
    docstring = re.findall(r"::\n\n(.*?)\n\n", train.__doc__ or "", re.S)
    found["trainscale.train"] = [" ".join(d.replace("\\\n", " ").split()) for d in docstring]
    request = planner_cli.parse(["--model", "70b", "--laptop", "4"])
    layout = planner.top_layouts(
        planner.plan(request.model, request.cluster, request.global_batch), 1
    )[0]
    found["--laptop 4"] = [
        " ".join(planner_cli.laptop_command(layout, 4).replace("\\\n", " ").split())
    ]
    return found


@pytest.fixture(scope="module")
def printed() -> dict[str, list[str]]:
    return _printed_commands()


def test_every_run_it_yourself_line_uses_the_launcher(printed):
    for chapter, module in RUN_IT_YOURSELF.items():
        (name,) = [n for n in printed if n.startswith(f"{chapter}_")]
        assert any(f"-m {module}" in c for c in printed[name]), (name, printed[name])
    assert printed["README.md"] and printed["python -m trainscale --help"]
    assert printed["trainscale.train"]
    commands = [c for lines in printed.values() for c in lines]
    assert len(commands) >= 12
    for command in commands:
        assert re.match(r"(\S*/)?python -m trainscale\.launch ", command), command
        assert "torchrun" not in command, command


def test_every_printed_launch_parses_and_names_a_module_that_runs(printed):
    # Parsed as the launcher will parse it; the capstone's flags with its own checks, on
    # as many ranks as the command starts.
    for command in (c for lines in printed.values() for c in lines):
        words = shlex.split(command.replace("NAME", "collectives"))
        job = launch.parse(words[3:])
        source = ROOT / "src" / Path(*job.module.split(".")).with_suffix(".py")
        if not source.exists():  # a package (the capstone): its __main__.py
            source = source.with_suffix("") / "__main__.py"
        assert 'if __name__ == "__main__":' in source.read_text(), command
        if job.module == "trainscale.train":
            train.parse_args(list(job.args)).layout(job.nproc_per_node)


def test_the_cluster_command_stays_torchrun_on_the_head_nodes_endpoint():
    request = planner_cli.parse(["--model", "70b"])
    layout = planner.top_layouts(
        planner.plan(request.model, request.cluster, request.global_batch), 1
    )[0]
    command = " ".join(planner_cli.cluster_command(layout, request).replace("\\\n", " ").split())
    assert command.startswith("torchrun --nnodes=8 --nproc-per-node=8 --rdzv-backend=c10d")
    assert "--rdzv-endpoint=$HEAD_NODE:29500" in command


# --------------------------------------------------------------------------- real jobs


@pytest.fixture
def no_leftover_processes():
    before = own_children()
    yield
    deadline = time.monotonic() + 10
    while own_children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert own_children() <= before, f"processes left behind: {own_children() - before}"


def _environment(*folders: Path) -> dict[str, str]:
    """This environment, with the package (and ``folders``) importable by a second Python."""
    paths = [str(f) for f in folders] + [p for p in sys.path if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


class Watcher:
    """Reads the launcher's stdout as it comes, and samples (:meth:`sample`) every listening
    TCP socket of the launcher and of each of its descendants (the torchrun agent, the ranks)."""

    def __init__(self, launcher: psutil.Popen) -> None:
        self.launcher = launcher
        self.listeners: dict[tuple[str, int], set[str]] = {}  # (ip, port) -> who listened
        self.processes: dict[int, str] = {}
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.launcher.stdout:
            self.lines.append(line)

    def _role(self, process: psutil.Process) -> str:
        if process.pid == self.launcher.pid:
            return "launcher"
        command = " ".join(process.cmdline())
        return "agent" if "torch.distributed.run" in command else "rank"

    def sample(self) -> None:
        for process in [self.launcher, *self.launcher.children(recursive=True)]:
            try:
                role = self.processes.setdefault(process.pid, self._role(process))
                for c in process.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN:
                        self.listeners.setdefault((c.laddr.ip, c.laddr.port), set()).add(role)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue


JOB = """
import sys
import time

import torch
import torch.distributed as dist

from trainscale.distributed import torchrun_main


def main(rank, world_size):
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    sys.stdout.write(f"rank {rank} of {world_size}: all_reduce gives {total.item():g}\\n")
    sys.stdout.flush()  # one write: the ranks share the launcher's output file
    time.sleep(300)  # until the launcher is stopped


if __name__ == "__main__":
    torchrun_main(main)
"""
"""A job that joins the process group as every module of the package does
(:func:`trainscale.distributed.torchrun_main`), all-reduces, says so, and waits: its
lines can only reach the test while it runs, and every listener of the job is open
while it waits."""


@pytest.mark.slow  # a launcher, its torchrun agent and two gloo ranks: ~9 s on 2 cores
def test_a_launched_job_streams_listens_on_loopback_only_and_stops_on_ctrl_c(
    no_leftover_processes, tmp_path
):
    (tmp_path / "allreduce_then_wait.py").write_text(JOB)
    command = [sys.executable, "-m", "trainscale.launch", "--nproc-per-node=2"]
    launcher = psutil.Popen(
        [*command, "-m", "allreduce_then_wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(tmp_path),
        cwd=tmp_path,
    )
    watcher = Watcher(launcher)
    try:
        said = [f"rank {r} of 2: all_reduce gives 3\n" for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all(line in watcher.lines for line in said) and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stderr.read()
            watcher.sample()
            time.sleep(0.05)
        assert all(line in watcher.lines for line in said), watcher.lines  # while it runs
        watcher.sample()  # once more, with the whole job waiting
        job = launcher.children(recursive=True)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=30) == 128 + signal.SIGINT
        _, alive = psutil.wait_procs(job, timeout=10)
        assert alive == [], alive
        assert launcher.stderr.read().endswith(
            "stopped by SIGINT; every process of the job has ended\n"
        )
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert sorted(watcher.processes.values()) == ["agent", "launcher", "rank", "rank"]
    who = {role for roles in watcher.listeners.values() for role in roles}
    assert who == {"launcher", "rank"}, watcher.listeners  # the agent hosts nothing
    assert len(watcher.listeners) >= 3, watcher.listeners  # two stores, gloo's listeners
    assert all(ip == "127.0.0.1" for ip, _ in watcher.listeners), watcher.listeners
