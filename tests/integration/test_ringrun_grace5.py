"""``--stop-grace``: a script written for torchrun that saves a last checkpoint in
``except KeyboardInterrupt:`` and needs more than ringrun's default 2.5 s gets the time
it asks for (torchrun waits up to its ``--shutdown-timeout``, 30 s), remote ranks too;
a second Ctrl-C still kills at once; resizable jobs pass the received signal on as
fixed-size ones do; and horovodrun's ranks get SIGTERM with 5 s, as Horovod's launcher
stops its ranks (a Horovod script saves in a SIGTERM handler)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hosts.harness import BIN, RINGRUN, assert_no_orphans, env_for, new_marker

import ringtrain.launch.agent as agent_module
from ringtrain.launch.agent import agent_grace
from ringtrain.launch.members import stop_all
from ringtrain.launch.output import OutputSink
from ringtrain.launch.remote import RemoteHost

# No torch: the launcher's side is what is tested. On Ctrl-C the rank "saves" for SAVE_S
# seconds, longer than the default grace (2.5 s), then writes the file named in argv[1].
SAVE_S = 4
SCRIPT = ("import sys, time\n"
          "print('ready', flush=True)\n"
          "try:\n"
          "    time.sleep(60)\n"
          "except KeyboardInterrupt:\n"
          "    time.sleep(float(sys.argv[2]))\n"
          "    open(sys.argv[1], 'w').write('saved')\n")


def _interrupt(argv: list[str], marker: str, second_after: float | None = None,
               launcher: str = RINGRUN) -> tuple[int, str, float]:
    """Start ringrun, SIGINT it once its rank is ready (and again ``second_after`` seconds
    later); its exit code, stderr and the seconds from the first SIGINT to its exit."""
    proc = subprocess.Popen([launcher, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_for(marker))
    assert proc.stdout is not None
    # 40 s: a resizable job's start beside other load took over 20 s once, and a SIGINT
    # before the rank's try block saves nothing
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.rstrip().endswith("ready"):  # (no line: ringrun ended, e.g. a bad flag)
            break
    proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    if second_after is not None:
        time.sleep(second_after)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    return proc.returncode, err, time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace,saved", [(None, False), ("8", True)], ids=["default", "stop-grace-8"])
def test_a_checkpoint_on_ctrl_c_gets_the_stop_grace(tmp_path: Path, grace: str | None, saved: bool) -> None:
    marker, done = new_marker(), tmp_path / "saved"
    flag = ["--stop-grace", grace] if grace else []
    code, err, _ = _interrupt([*flag, "-np", "1", sys.executable, "-c", SCRIPT, str(done), str(SAVE_S)],
                              marker)
    assert code == 130, err
    assert done.exists() == saved, err  # default: SIGKILLed after 2.5 s, in the middle of the save
    assert_no_orphans(marker, within=1.0)


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    marker, done = new_marker(), tmp_path / "saved"
    code, err, took = _interrupt(["--stop-grace", "60", "-np", "1", sys.executable, "-c", SCRIPT,
                                  str(done), "30"], marker, second_after=0.5)
    assert code == 130, err
    assert took < 10, f"ringrun took {took:.1f} s after a second SIGINT (grace 60 s): {err}"
    assert not done.exists()
    assert_no_orphans(marker, within=1.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag,save_s", [([], 0), (["--stop-grace", "8"], SAVE_S)],
                         ids=["default", "stop-grace-8"])
def test_a_resizable_job_passes_ctrl_c_on_and_honours_the_grace(tmp_path: Path, flag: list[str],
                                                                 save_s: int) -> None:
    # Before, its workers got SIGTERM (no KeyboardInterrupt, nothing saved) and 2.5 s.
    marker, done = new_marker(), tmp_path / "saved"
    code, err, _ = _interrupt([*flag, "--min-np", "1", "--max-np", "1", "-H", "localhost:1",
                               sys.executable, "-c", SCRIPT, str(done), str(save_s)], marker)
    assert code == 130, err
    assert done.exists(), err
    assert_no_orphans(marker, within=1.0)


@pytest.mark.timeout(60)
def test_a_remote_hosts_agent_honours_the_specs_grace(tmp_path: Path) -> None:
    # The agent run as ssh would run it, without ssh: RemoteHost only needs its argv.
    marker, done, out = new_marker(), tmp_path / "saved", tmp_path / "out.log"
    grace = 8.0
    with out.open("wb") as stream:
        sink = OutputSink(None, prefix=True, stream=stream)
        host = RemoteHost("h1", [sys.executable, agent_module.__file__], (0,), sink, 0, env_for(marker))
        try:
            assert host.wait_ready(time.monotonic() + 40), host.problem()
            host.send_spec({"cwd": str(Path.cwd()),
                            "command": [sys.executable, "-c", SCRIPT, str(done), "3"],
                            "ranks": [{"rank": 0, "local_size": 1, "env": {"RINGTEST_MARKER": marker}}],
                            "listen": None, "stop_grace": agent_grace(grace)})
            deadline = time.monotonic() + 40
            while b"ready" not in out.read_bytes() and time.monotonic() < deadline:
                time.sleep(0.05)
            stop_all([host], grace=grace, signum=signal.SIGINT)
        finally:
            stop_all([host], grace=0.5)
    assert done.exists(), out.read_text()  # before: the agent SIGKILLed its ranks after 1.5 s
    assert_no_orphans(marker, within=1.0)


# A Horovod script: it saves in a SIGTERM handler (Horovod's launcher stops its ranks with
# SIGTERM, then SIGKILL 5 s later) and never catches KeyboardInterrupt.
TERM_SCRIPT = ("import signal, sys, time\n"
               "def save(*_):\n"
               "    time.sleep(float(sys.argv[2]))\n"
               "    open(sys.argv[1], 'w').write('saved')\n"
               "    sys.exit(0)\n"
               "signal.signal(signal.SIGTERM, save)\n"
               "print('ready', flush=True)\n"
               "time.sleep(60)\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [["-np", "1"], ["--min-np", "1", "--max-np", "2", "-H", "localhost:2"]],
                         ids=["fixed", "resizable"])
def test_horovodrun_stops_its_ranks_with_sigterm_and_horovods_grace(tmp_path: Path, size: list[str]) -> None:
    # 3 s of saving: past ringrun's 2.5 s, within Horovod's 5 s. Before, the rank got
    # SIGINT (a KeyboardInterrupt in time.sleep) and its handler never ran.
    marker, done = new_marker(), tmp_path / "saved"
    code, err, _ = _interrupt([*size, sys.executable, "-c", TERM_SCRIPT, str(done), "3"], marker,
                              launcher=str(BIN / "horovodrun"))
    assert code == 130, err
    assert done.exists(), err
    assert_no_orphans(marker, within=1.0)
