"""A real Slurm on this machine for tests/test_slurm.py: munge, slurmctld and two slurmd ("nodes" n1, n2).

`make test-slurm` installs Debian's slurmctld, slurmd, slurm-client and munge where they are
missing (scripts/install_slurm.sh) and runs tests/test_slurm.py, which starts one cluster for
the module: every daemon in the foreground as a child of the test (so its pid is known), with a
private folder for keys, state, spool and logs, and tests/slurm/slurm.conf's fields filled in.
`stop()` cancels every job, stops the daemons by pid, and then kills whatever process still
carries the cluster's token in its environment: the daemons, slurmstepd and every job's
processes all inherit it (slurmd's environment, and sbatch's, which the job exports).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from conftest import kill_all, processes_whose_environment
from forked_ranks import free_port
from slowness import guard

HERE = Path(__file__).resolve().parent
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
TOKEN = "GPT2_REPRO_SLURM"  # in the environment of every process of the test's cluster
NODE = "GPT2_REPRO_SLURM_NODE"  # in a slurmd's environment, and so in its slurmstepd's: which node it is
NODES = ("n1", "n2")


def missing_commands() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def executable(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.token = uuid.uuid4().hex
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), TOKEN: self.token}

    # --- the daemons ---

    def start(self) -> "SlurmCluster":
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        fields = {"ROOT": str(self.root), "HOST": socket.gethostname(), "CTLD_PORT": free_port(),
                  "N1_PORT": free_port(), "N2_PORT": free_port()}
        text = (HERE / "slurm" / "slurm.conf").read_text()
        for name, value in fields.items():
            text = text.replace(f"@{name}@", str(value))
        self.conf.write_text(text)
        munge = self.root / "munge"
        self.spawn("munged", ["--foreground", "--force", f"--socket={munge}/munge.sock", f"--key-file={key}",
                              f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                              f"--seed-file={munge}/seed"])
        self.wait_until(lambda: (munge / "munge.sock").exists(), 30, "munged's socket")
        self.spawn("slurmctld", ["-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self.start_node(node)
        self.wait_until(lambda: self.node_states() == {node: "idle" for node in NODES}, 60, "both nodes idle")
        return self

    def spawn(self, name: str, args: list[str], key: str | None = None, env: dict | None = None) -> None:
        log = open(self.root / "log" / f"{key or name}.out", "ab")
        self.daemons[key or name] = subprocess.Popen([executable(name), *args], env={**self.env, **(env or {})},
                                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def start_node(self, node: str) -> None:
        self.spawn("slurmd", ["-D", "-N", node, "-f", str(self.conf)], key=f"slurmd-{node}", env={NODE: node})

    def node_processes(self, node: str) -> list[int]:
        """The node's slurmd, its slurmstepd, and every process of a job step on it."""
        name = node.encode()
        return processes_whose_environment(lambda env: name in (env.get(NODE.encode()), env.get(b"SLURMD_NODENAME")))

    def freeze_node(self, node: str) -> None:
        """The node stops answering, as one whose power or network failed: every process on it is stopped
        (SIGSTOP) at once, so nothing on it can report a task's end or close a connection."""
        kill_all(self.node_processes(node), signal.SIGSTOP)

    def restart_node(self, node: str) -> None:
        """The failed node reboots: what ran on it is gone (SIGKILL), and its slurmd starts afresh."""
        self.daemons.pop(f"slurmd-{node}").kill()
        kill_all(self.node_processes(node))
        self.start_node(node)

    def stop(self) -> None:
        """Cancel every job, stop each daemon by its pid, then kill anything of the cluster still running."""
        try:
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self.run("scancel", "--user=root", check=False)
                self.wait_until(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 60, "no job",
                                raise_=False)
        finally:
            for name, daemon in reversed(list(self.daemons.items())):
                kill_all([daemon.pid], signal.SIGCONT)  # a frozen node's slurmd
                if daemon.poll() is None:
                    daemon.terminate()
                    try:
                        daemon.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        daemon.kill()
                        daemon.wait()
            kill_all(processes_whose_environment(lambda env: env.get(TOKEN.encode()) == self.token.encode()))

    # --- what a user does ---

    def run(self, *cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([executable(cmd[0]), *cmd[1:]], env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=guard(60))
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def sbatch(self, script: Path, *args: str, options: tuple[str, ...] = (), env: dict | None = None,
               cwd: Path | None = None) -> str:
        proc = subprocess.run([executable("sbatch"), "--parsable", *options, str(script), *args],
                              env={**self.env, **(env or {})}, capture_output=True, text=True, cwd=cwd,
                              timeout=guard(60))
        if proc.returncode != 0:
            raise AssertionError(f"sbatch exited {proc.returncode}: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol show job's fields (JobState, Restarts, ExitCode, ...); {} once Slurm forgot the job."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            return {}
        return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)

    def wait_for_job(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        """The job's fields once its JobState is one of states (a hang guard of timeout s)."""
        found: dict[str, str] = {}

        def reached() -> bool:
            found.update(self.job(job_id))
            return found.get("JobState") in states

        self.wait_until(reached, timeout, f"job {job_id} in {sorted(states)} (last: {found.get('JobState')})")
        return found

    def node_states(self) -> dict[str, str]:
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)

    def log(self, name: str) -> str:
        path = self.root / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""

    # --- helpers ---

    def wait_until(self, condition, timeout: float, what: str, raise_: bool = True) -> bool:
        deadline = time.monotonic() + guard(timeout)
        while time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.25)
        if raise_:
            raise AssertionError(f"slurm: waited {guard(timeout):.0f} s for {what}\n"
                                 f"{self.log('slurmctld.log')[-3000:]}")
        return False

