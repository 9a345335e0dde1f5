"""``ringrun --min-np M --max-np N``: the driver of a resizable job (Horovod's elastic mode).

    ringrun --min-np 2 --max-np 4 -H a:1,b:1,c:1 python train.py
    ringrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py

The job is a series of *worlds* (:mod:`.worlds`): world 0 is started as a fixed-size job
is, with every worker told its world number (``RINGTRAIN_WORLD_VERSION``) and a file of
its own (``RINGTRAIN_ELASTIC_FILE``). The driver is a state machine (:mod:`.states`: the
states, the events and every transition in one table); each poll of :meth:`Driver.step`
turns what happened into one event at a time:

- **a worker exits non-zero or its host is lost** (``LOST``): the others are not
  stopped. If at least ``--min-np`` are left, ringrun writes the next world (ranks,
  rendezvous, the lost hosts' addresses) into each survivor's file
  (:mod:`ringtrain.assignment`). The survivors' next collective fails;
  ``hvd.elastic.run`` / ``rt.elastic.run`` restore the last commit in memory, leave the
  broken world and join the new one. The host is not used again until the discovery
  script stops listing it and lists it again, or after
  :data:`~ringtrain.launch.elastic.worlds.COOLDOWN_S` (a fixed ``-H`` host: never).
- **the discovery script lists a new host** (``GROWN``; only while ``RUNNING``, below
  ``--max-np``): ringrun starts workers there in the next world and writes it to the
  others, who move at their next ``state.commit()`` (Horovod's
  ``HostsUpdatedInterrupt``); the new workers get the state from rank 0.
- **a worker exits 0** (``FINISHED``): the job is ending; once every worker of the last
  formed world has exited (``ALL_EXITED``), what is left (new workers of a world that
  never formed) is stopped.

Every worker reserves a rendezvous port at its start (ringrun for this host, the agent
for a remote one), since any survivor may become rank 0 and host the store. A world has
*formed* (``FORMED``) when each of its workers acknowledged it (``<file>.joined``);
ringrun prints each step with the time it took (the timeline in docs/launch.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from typing import Any, Protocol

from ringtrain import addresses, assignment
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.launch import reaper
from ringtrain.launch.elastic.discovery import Discovery
from ringtrain.launch.elastic.states import Event, JobState, next_state
from ringtrain.launch.elastic.workers import JobHost, JobWorkers, WorkerProc
from ringtrain.launch.elastic.worlds import Blacklist, WorkerOnHost, next_world
from ringtrain.launch.hosts import Host, place_ranks
from ringtrain.launch.job import (
    HEARTBEAT_EVERY_S,
    STOP_GRACE_S,
    HostsDown,
    JobConfig,
    Stopped,
    await_agents,
    describe_exit,
    exit_status,
    job_run,
    say,
)
from ringtrain.launch.members import Member, StartFailure, stop_all
from ringtrain.launch.output import OutputSink
from ringtrain.launch.remote import HOST_LOST, RemoteHost

__all__ = ["HOROVOD_FAILED", "HOROVOD_RESET_LIMIT", "Driver", "Workers", "run_elastic"]

#: Horovod's words when an elastic job fails for good (its driver's RuntimeError), which
#: horovodrun users' tooling may look for; ringrun says it in its own words.
HOROVOD_FAILED = "Horovod detected that one or more processes exited with non-zero status"
#: Horovod's words when the job re-formed --reset-limit times (its elastic constants).
HOROVOD_RESET_LIMIT = ("Horovod was shutdown because number of resets during elastic job exceeded "
                       "limit: {}")


class Workers(Protocol):
    """What the driver needs of the job's workers (:class:`~.workers.JobWorkers`; a fake
    in the driver's unit tests)."""

    procs: dict[int, WorkerProc]
    hosts: dict[str, JobHost]

    def members(self) -> list[Member]: ...
    def remote(self, name: str, ids: list[int]) -> RemoteHost: ...
    def register(self, name: str, remote: RemoteHost | None, infos: dict[str, dict[str, Any]]) -> JobHost: ...
    def remotes(self) -> dict[str, RemoteHost]: ...
    def launch(self, order: list[WorkerOnHost], new: list[WorkerOnHost], lost: list[str], reason: str,
               version: int) -> None: ...
    def can_be_rank0(self, slot: WorkerOnHost, hosts: set[str]) -> bool: ...
    def remove(self, workers: list[int], version: int, reason: str) -> None: ...


class Driver:
    """The state machine of one resizable job (see the module docstring)."""

    def __init__(self, cfg: JobConfig, run_id: str, sink: OutputSink, stop_flag: list[int],
                 watchdog: reaper.Watchdog | None, workers: Workers | None = None,
                 discovery: Discovery | None = None) -> None:
        assert cfg.elastic is not None
        self.cfg, self.ecfg = cfg, cfg.elastic
        self.run_id, self.sink, self.stop_flag, self.watchdog = run_id, sink, stop_flag, watchdog
        self.discovery = discovery or Discovery(list(self.ecfg.hosts), self.ecfg.discovery_script, say=say,
                                               slots=self.ecfg.slots_per_host)
        # ringrun's rule: a failed host of a discovery script comes back after COOLDOWN_S;
        # Horovod's: only with --blacklist-cooldown-range (fixed lists too).
        plain = self.ecfg.cooldown if self.ecfg.discovery_script and not self.ecfg.like_horovod else 0.0
        self.blacklist = Blacklist(plain, self.ecfg.cooldown_range)
        self.dir = os.path.join(tempfile.gettempdir(), f"ringtrain-elastic-{run_id}")
        self.workers: Workers = workers or JobWorkers(cfg, run_id, sink, stop_flag, watchdog, self.dir)
        self.procs = self.workers.procs
        self.hosts = self.workers.hosts
        self.state = JobState.STARTING
        #: Every transition taken, in order: (from, event, to).
        self.history: list[tuple[JobState, Event, JobState]] = []
        #: The job's exit code, once ENDED.
        self.exit_code: int | None = None
        #: Remote hosts found by discovery whose agent is still coming up.
        self.connecting: dict[str, tuple[RemoteHost, list[int], float]] = {}
        self.version = 0  # the newest world announced
        self.world: list[int] = []  # its workers, in rank order
        self.formed = -1  # the newest world every worker joined
        self.formed_world: list[int] = []
        self.changed_at = time.monotonic()
        self.resets = 0
        self.cancelled: set[int] = set()
        #: Workers told to leave (their slots are no longer listed): exit 0 expected.
        self.removing: set[int] = set()
        #: WAITING: when the job gives up waiting for hosts (--elastic-timeout).
        self.waiting_until = 0.0
        #: WAITING: hosts that joined, whose workers start with the next world.
        self.pending: list[WorkerOnHost] = []
        self.next_id = 0
        self.rounds = 0

    # -- the one place the state changes -------------------------------------------------------

    def _on(self, event: Event, code: int | None = None) -> None:
        before, self.state = self.state, next_state(self.state, event)
        self.history.append((before, event, self.state))
        if self.state is JobState.ENDED:
            self.exit_code = 0 if code is None else code

    @property
    def ended(self) -> bool:
        return self.state is JobState.ENDED

    # -- members -------------------------------------------------------------------------------

    def members(self) -> list[Member]:
        return self.workers.members() + [r for r, _, _ in self.connecting.values()]

    def _new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    # -- STARTING: the first world ---------------------------------------------------------------

    def start(self) -> None:
        hosts = self._first_hosts()
        total = sum(h.slots for h in hosts)
        # ringrun keeps -np as the first size; Horovod takes every slot there is (up to
        # --max-np) once -np are there.
        np = min(self.ecfg.max_np, total) if self.ecfg.like_horovod else (
            self.ecfg.np or min(self.ecfg.max_np, total))
        placed = place_ranks(hosts, np, slots_note="the hosts available now")
        ids = self._new_ids(len(placed))
        remote_ids: dict[str, list[int]] = {}
        for p in placed:
            if not self.cfg.is_local(p.host):
                remote_ids.setdefault(p.host, []).append(p.rank)
        remotes = {name: self.workers.remote(name, w) for name, w in remote_ids.items()}
        try:
            await_agents(self.cfg, remotes, 0, self.stop_flag)
        except BaseException:
            stop_all(list(remotes.values()), grace=0.5)
            raise
        infos = {h: r.info or {} for h, r in remotes.items()}
        for p in placed:
            if p.host not in self.hosts:
                self.workers.register(p.host, remotes.get(p.host), infos)
        order = [WorkerOnHost(w, p.host) for w, p in zip(ids, placed, strict=True)]
        self._launch(order, order, [], "first world")
        self.formed_world = list(self.world)
        self.discovery.start()
        self._on(Event.LAUNCHED)
        say(f"elastic: world 0 started: {len(order)} rank(s) on {self._where(order)} "
            f"(--min-np {self.ecfg.min_np}, --max-np {self.ecfg.max_np})")

    def _first_hosts(self) -> list[Host]:
        """The hosts to start on: wait (``--start-timeout``) for ``--min-np`` slots (with
        Horovod's rules, for ``-np``: the processes it needs before training starts)."""
        need = max(self.ecfg.min_np, self.ecfg.np or 0) if self.ecfg.like_horovod else self.ecfg.min_np
        what = "-np" if need > self.ecfg.min_np else "--min-np"
        deadline = time.monotonic() + self.cfg.start_timeout
        while True:
            hosts = self.discovery.first()
            if sum(h.slots for h in hosts) >= need:
                return hosts
            if time.monotonic() > deadline:
                raise ConfigError(f"the hosts available ({self._hosts_text(hosts) or 'none'}) have fewer "
                                  f"than {what} {need} slots after {self.cfg.start_timeout:g} s")
            if self.stop_flag:
                self._on(Event.STOPPED, 128 + self.stop_flag[0])
                raise Stopped(self.stop_flag[0])
            time.sleep(1.0)

    @staticmethod
    def _hosts_text(hosts: list[Host]) -> str:
        return ",".join(f"{h.name}:{h.slots}" for h in hosts)

    def _where(self, order: list[WorkerOnHost]) -> str:
        counts: dict[str, int] = {}
        for s in order:
            counts[s.host] = counts.get(s.host, 0) + 1
        return ",".join(f"{h}:{n}" for h, n in counts.items())

    def _launch(self, order: list[WorkerOnHost], new: list[WorkerOnHost], lost: list[str], reason: str) -> None:
        self.workers.launch(order, new, lost, reason, self.version)
        self.world = [s.worker for s in order]
        self.changed_at = time.monotonic()

    # -- watching --------------------------------------------------------------------------------

    def watch(self) -> int:
        """Poll until the job has ended; its exit code."""
        next_beat = 0.0
        while True:
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_EVERY_S
                # Not to hosts still connecting: before its spec an agent takes an empty
                # line for "ringrun went away".
                for remote in self.workers.remotes().values():
                    remote.heartbeat()
            self.step()
            if self.exit_code is not None:
                return self.exit_code
            time.sleep(0.05)

    def step(self) -> None:
        """Look at the job once and take the events it shows, in order."""
        if self.stop_flag:
            self._on(Event.STOPPED, 128 + self.stop_flag[0])
            raise Stopped(self.stop_flag[0])
        if self.sink.failure is not None:
            say(f"error: {self.sink.failure.message}; stopping the job")
            self._on(Event.OUTPUT_FAILED, self.sink.failure.exit_code)
            return
        self._acks()
        self._exits()
        if not self.ended:
            self._grow()
        if self.state is JobState.WAITING:
            self._wait_for_hosts()

    def _acks(self) -> None:
        for proc in self.procs.values():
            if proc.code is not None:
                continue
            remote = proc.remote
            joined = remote.joined.get(proc.id) if remote is not None else assignment.read_ack(proc.file)
            if joined is not None:
                proc.joined = joined
        if self.formed < self.version and all(self.procs[w].joined >= self.version for w in self.world):
            self.formed = self.version
            self.formed_world = list(self.world)
            took = time.monotonic() - self.changed_at
            order = [WorkerOnHost(w, self.procs[w].host) for w in self.world]
            say(f"elastic: world {self.version} formed: {len(self.world)} rank(s) on "
                f"{self._where(order)} ({took:.1f} s after it was announced)")
            self._on(Event.FORMED)

    def _exit_codes(self) -> tuple[list[int], list[int], list[int]]:
        """Workers that exited since the last look: finished (0), dead (in a world), and
        removed ones that did not leave cleanly (their host vanished first)."""
        finished: list[int] = []
        dead: list[int] = []
        lost_removed: list[int] = []
        for proc in self.procs.values():
            if proc.code is not None:
                continue
            member: Member | None = proc.local if proc.local is not None else proc.remote
            code = member.exits().get(proc.id) if member is not None else None
            if member is None or code is None:
                continue
            proc.code = code
            proc.exited_at = _exit_time(member, proc.id)
            if proc.id in self.cancelled:
                continue
            if proc.id in self.removing:
                self.removing.discard(proc.id)
                if code != 0:
                    lost_removed.append(proc.id)
                continue
            (finished if code == 0 else dead).append(proc.id)
        dead.sort(key=lambda w: (self.procs[w].exited_at, w))  # the first failure first
        return finished, dead, lost_removed

    def _first_failure(self, workers: list[int]) -> int | None:
        """Of ``workers``, the one that failed first; never one ringrun stopped itself."""
        failed = [w for w in workers if self.procs[w].code not in (None, 0) and w not in self.cancelled]
        return min(failed, key=lambda w: (self.procs[w].exited_at, w), default=None)

    def _exits(self) -> None:
        finished, dead, lost_removed = self._exit_codes()
        if lost_removed and self.state is not JobState.FINISHING:
            self._removed_lost(lost_removed)
            if self.ended:
                return
        dead = [w for w in dead if w in self.world]  # not yet in a world: nothing to re-form
        if dead:
            if self.state is JobState.FINISHING:
                w = dead[0]
                say(f"{self._describe(w)} while the job was ending; stopping the others")
                self._on(Event.LOST, exit_status(self.procs[w].code or 1))
                return
            self._shrink(dead)
            if self.ended:
                return
        for name in [h for h, host in self.hosts.items() if host.workers
                     and all(self.procs[x].code is not None for x in host.workers)]:
            self._forget(name)  # its workers left (removed by discovery): free for a later grow
        if finished and self.state is not JobState.FINISHING:
            self._on(Event.FINISHED)
        if self.state is JobState.FINISHING and all(self.procs[w].code is not None for w in self.formed_world):
            bad = self._first_failure(self.formed_world)
            if bad is None and any(self.procs[w].code != 0 for w in self.formed_world):
                bad = next(w for w in self.formed_world if self.procs[w].code != 0)
            if bad is not None:
                say(f"{self._describe(bad)}; stopping the others")
                self._on(Event.ALL_EXITED, exit_status(self.procs[bad].code or 1))
            else:
                self._on(Event.ALL_EXITED, 0)

    def _describe(self, w: int) -> str:
        proc = self.procs[w]
        remote = proc.remote
        if remote is not None and proc.code == HOST_LOST and remote.lost():
            why = remote.error or (remote.problem() if remote.ssh_tail else "the connection closed")
            return f"host {proc.host} was lost ({why}) with worker {w}"
        member: Member | None = proc.local if proc.local is not None else remote
        where = member.where(w) if member is not None else f"on {proc.host}"
        rank = self.world.index(w) if w in self.world else None
        return (f"worker {w}" + (f" (rank {rank}, {where})" if rank is not None else f" ({where})")
                + f" {describe_exit(proc.code or 0)}")

    # -- LOST: a smaller world -------------------------------------------------------------------

    def _shrink(self, dead: list[int]) -> None:
        now = time.monotonic()
        failed_hosts: list[str] = []
        for w in dead:
            host = self.procs[w].host
            wait = self.blacklist.add(host, now)
            failed_hosts.append(host)
            back = "" if wait == float("inf") else f" (blacklisted for {wait:.0f} s)"
            say(f"elastic: {self._describe(w)}{back if self.ecfg.like_horovod else ''}")
        pending = self.state is JobState.FORMING and self.version > 0
        # New workers of a world that has not formed hold no state: stop them; their hosts
        # are taken again at a later discovery round.
        unjoined = [w for w in self.world if pending and self.procs[w].started_in == self.version
                    and self.procs[w].joined < self.version and self.procs[w].code is None]
        if unjoined:
            self._cancel(unjoined)
        if self.ecfg.like_horovod:
            # Horovod blacklists the host of a failed rank with all its ranks.
            hosted = [w for w in self.world if self.procs[w].host in failed_hosts
                      and self.procs[w].code is None and w not in unjoined]
            if hosted:
                self._cancel(hosted, f"host(s) {', '.join(sorted(set(failed_hosts)))} left the job "
                                     "with the failed rank(s)")
                unjoined += hosted
        survivors = [w for w in self.world if self.procs[w].code is None and w not in unjoined]
        lost_hosts = [h for h in {self.procs[w].host for w in dead} if h in self.hosts
                      and all(self.procs[x].code is not None for x in self.hosts[h].workers)]
        # A lost remote host's addresses: the survivors close their connections there,
        # which a host that vanished silently would leave hanging. (Loopback is every
        # host's own; this host's dead workers' connections were closed by the kernel.)
        lost = sorted({a for h in lost_hosts for a in self.hosts[h].addresses
                       if self.hosts[h].remote is not None and not addresses.is_loopback(a)})
        for h in lost_hosts:
            self._forget(h)
        reason = "lost " + ", ".join(
            f"rank {self.world.index(w)} on {self.procs[w].host}" if w in self.world else f"worker {w}"
            for w in dead)
        if self._short(survivors, reason):
            return
        if not self._change(survivors, [], lost, reason, Event.LOST):
            raise LaunchError("no surviving worker can host the rendezvous of a multi-host world "
                              "(its port is on loopback); pass --network-interface")

    def _removed_lost(self, workers: list[int]) -> None:
        """Workers told to leave died instead (their host went down as the discovery
        script dropped it): the survivors may be blocked on its connections, which a
        host that vanished silently never closes. The same world again, told the lost
        host's addresses, frees them (they sever those connections at once)."""
        for w in workers:
            say(f"elastic: {self._describe(w)} (it was leaving the job)")
        hosts = {self.procs[w].host for w in workers}
        gone = [h for h in hosts if h in self.hosts
                and all(self.procs[x].code is not None for x in self.hosts[h].workers)]
        lost = sorted({a for h in gone for a in self.hosts[h].addresses
                       if self.hosts[h].remote is not None and not addresses.is_loopback(a)})
        for h in gone:
            self._forget(h)
        if lost and self.state in (JobState.FORMING, JobState.RUNNING):
            self._change(list(self.world), [], lost, f"lost host(s) {', '.join(sorted(gone))}", Event.LOST)

    def _short(self, survivors: list[int], reason: str) -> bool:
        """Fewer than ``--min-np`` left: wait for hosts (``--elastic-timeout``, WAITING) or
        end the job (TOO_FEW; at once when no rank is left: every host failed or is
        blacklisted). False: enough are left."""
        if len(survivors) >= self.ecfg.min_np:
            return False
        limited = self.ecfg.reset_limit is not None and self.resets >= self.ecfg.reset_limit
        if survivors and self.ecfg.elastic_timeout > 0 and not limited:
            self.world = list(survivors)
            self.pending = []
            if self.state is JobState.WAITING:
                self._on(Event.LOST)
            else:
                self.waiting_until = time.monotonic() + self.ecfg.elastic_timeout
                self._on(Event.SHORT)
            say(f"elastic: {len(survivors)} rank(s) left ({reason}), fewer than --min-np "
                f"{self.ecfg.min_np}; waiting up to {self.ecfg.elastic_timeout:g} s for hosts")
            return True
        first = self._first_failure(list(self.procs))
        code = exit_status((self.procs[first].code if first is not None else 1) or 1)
        if survivors and self.ecfg.elastic_timeout > 0:  # no new world may come: end now
            self._say_limit()
            self._on(Event.LIMIT, 1)
            return True
        if self.ecfg.like_horovod:
            say(f"error: {HOROVOD_FAILED} ({len(survivors)} rank(s) left, --min-np {self.ecfg.min_np})")
        else:
            say(f"elastic: {len(survivors)} rank(s) left, fewer than --min-np {self.ecfg.min_np}; "
                "stopping the job")
        self._on(Event.TOO_FEW, code)
        return True

    def _wait_for_hosts(self) -> None:
        """WAITING: once the survivors and the hosts that joined make ``--min-np``, the
        next world; past ``--elastic-timeout``, the end."""
        if len(self.world) + len(self.pending) >= self.ecfg.min_np and not self.connecting:
            new, self.pending = self.pending, []
            names = ",".join(sorted({s.host for s in new}))
            try:
                self._change(list(self.world), new, [], f"host(s) {names} added", Event.GROWN)
            except StartFailure as exc:  # still waiting, for other hosts (or the timeout)
                say(f"elastic: warning: {exc}; not using host(s) {names}")
                for name in {s.host for s in new}:
                    self._drop_new_host(name)
            return
        if time.monotonic() >= self.waiting_until:
            for remote, _ids, _deadline in self.connecting.values():
                stop_all([remote], grace=0.5)
            self.connecting.clear()
            message = (HOROVOD_FAILED if self.ecfg.like_horovod else
                       f"fewer than --min-np {self.ecfg.min_np} ranks")
            say(f"error: {message}: no hosts for {self.ecfg.min_np - len(self.world)} more rank(s) "
                f"within --elastic-timeout {self.ecfg.elastic_timeout:g} s; stopping the job")
            self._on(Event.TOO_FEW, 1)

    def _change(self, survivors: list[int], new: list[WorkerOnHost], lost: list[str], reason: str,
                event: Event) -> bool:
        """Announce the next world (``event``: LOST, GROWN or REMOVED), or end the job when
        it may not change any more (TOO_FEW, LIMIT). False, and nothing changes, when no
        survivor's rendezvous can be reached from every host of the next world."""
        if len(survivors) + len(new) < self.ecfg.min_np:
            self._on(Event.TOO_FEW, 1)
            return True
        if self.ecfg.reset_limit is not None and self.resets >= self.ecfg.reset_limit:
            self._say_limit()
            self._on(Event.LIMIT, 1)
            return True
        order = next_world([WorkerOnHost(w, self.procs[w].host) for w in survivors], new,
                           self.workers.can_be_rank0)
        if order is None:
            return False
        self.version += 1
        try:
            self._launch(order, new, lost, reason)
        except BaseException:
            self.version -= 1  # nothing of it reached the survivors (they are told last)
            for s in new:
                self.procs.pop(s.worker, None)
            raise
        self.resets += 1
        self._on(event)
        verb = "growing" if new else "re-forming"
        say(f"elastic: {verb} to {len(order)} rank(s) on {self._where(order)} as world {self.version} "
            f"({reason})")
        return True

    def _say_limit(self) -> None:
        if self.ecfg.like_horovod:
            say("error: " + HOROVOD_RESET_LIMIT.format(self.ecfg.reset_limit))
        else:
            say(f"elastic: the job changed size {self.resets} time(s), --reset-limit "
                f"{self.ecfg.reset_limit}; stopping the job")

    def _cancel(self, workers: list[int], why: str = "their world will not form") -> None:
        self.cancelled.update(workers)
        hosts = {self.procs[w].host for w in workers}
        say(f"elastic: stopping worker(s) {', '.join(map(str, workers))}: {why}")
        members: list[Member] = []
        for w in workers:
            proc = self.procs[w]
            if proc.local is not None:
                members.append(proc.local)
        for h in hosts:
            remote = self.hosts[h].remote
            if remote is not None and all(x in self.cancelled or self.procs[x].code is not None
                                          for x in self.hosts[h].workers):
                members.append(remote)
        # The driver waits here while the rest of the job runs, and a worker whose world
        # never formed has no training state to save: no longer than the default grace.
        stop_all(members, grace=min(self.cfg.stop_grace, STOP_GRACE_S))
        for h in hosts:
            if all(self.procs[x].code is not None or x in self.cancelled for x in self.hosts[h].workers):
                self._forget(h)

    def _forget(self, name: str) -> None:
        """Every worker of host ``name`` is gone: it is free for a later grow."""
        host = self.hosts.pop(name, None)
        if host is not None and host.remote is not None:
            stop_all([host.remote], grace=0.5)  # the agent exits once its workers did

    # -- GROWN: a larger world; REMOVED: slots the discovery script no longer lists ------------

    def _grow(self) -> None:
        now = time.monotonic()
        if self.discovery.rounds() != self.rounds or self.blacklist.cooldown_range is not None:
            # (a fixed host list has one round; its hosts come back by cooldown only)
            self.rounds = self.discovery.rounds()
            for back in self.blacklist.observe([h.name for h in self.discovery.hosts()], now):
                if self.ecfg.like_horovod:
                    say(f"elastic: host {back} is no longer blacklisted")
        waiting = self.state is JobState.WAITING
        for name, (remote, ids, deadline) in list(self.connecting.items()):
            if self.state is JobState.FINISHING:
                # The job is ending: a world with this host could never form.
                del self.connecting[name]
                stop_all([remote], grace=0.5)
            elif remote.wait_ready(time.monotonic() + 0.001):
                del self.connecting[name]
                self._join_host(name, remote, ids)
                if self.ended:
                    return
            elif remote.ssh_done() or now > deadline:
                del self.connecting[name]
                say(f"elastic: warning: host {name} did not answer ({remote.problem()}); not using it")
                stop_all([remote], grace=0.5)
                self.blacklist.add(name, now)
        if self.state is JobState.RUNNING and self.ecfg.discovery_script and self._remove_unlisted():
            return
        limited = self.ecfg.reset_limit is not None and self.resets >= self.ecfg.reset_limit
        if not (self.state is JobState.RUNNING or waiting) or self.connecting or limited:
            return
        room = self.ecfg.max_np - len(self.world) - len(self.pending)
        for host in self.discovery.hosts():
            if room <= 0:
                break
            if self.blacklist.blocked(host.name):
                continue
            # a new host, or more slots listed for one the job has (Horovod adds them)
            have = len([w for w in [*self.world, *(s.worker for s in self.pending)]
                        if self.procs[w].host == host.name]) if host.name in self.hosts else 0
            if host.name in self.hosts and (have == 0 or host.slots <= have or host.name in self.connecting):
                continue
            ids = self._new_ids(min(host.slots - have, room))
            room -= len(ids)
            if self.cfg.is_local(host.name):
                self._join_host(host.name, None, ids)
                if not waiting:
                    return
                continue
            self.connecting[host.name] = (self.workers.remote(host.name, ids), ids,
                                          now + self.cfg.start_timeout)

    def _join_host(self, name: str, remote: RemoteHost | None, ids: list[int]) -> None:
        if name not in self.hosts:
            infos = {h: r.info or {} for h, r in self.workers.remotes().items()}
            if remote is not None:
                infos[name] = remote.info or {}
            self.workers.register(name, remote, infos)
        new = [WorkerOnHost(w, name) for w in ids]
        if self.state is JobState.WAITING:
            # The survivors are not training: the next world comes once there are enough.
            say(f"elastic: host {name} added ({len(ids)} slot(s))")
            self.pending += new
            return
        say(f"elastic: host {name} added ({len(ids)} slot(s)); the job grows at its next commit")
        try:
            why = None if self._change(list(self.world), new, [], f"host {name} added", Event.GROWN) else (
                "rank 0's rendezvous is on loopback, which it cannot reach; pass --network-interface")
        except HostsDown as exc:  # its agent could not reserve the workers' ports
            why = str(exc)
        except StartFailure as exc:  # a new rank could not start: the job goes on without it
            why = str(exc)
        if why is not None:
            say(f"elastic: warning: host {name}: {why}; not using it")
            self._drop_new_host(name)
            if remote is not None:
                stop_all([remote], grace=0.5)

    def _drop_new_host(self, name: str) -> None:
        """A host whose new workers could not start: blacklisted, and forgotten unless
        it runs workers of the job already (this host, listed with more slots)."""
        if not (name in self.hosts and self.hosts[name].workers):
            host = self.hosts.pop(name, None)
            if host is not None and host.remote is not None:
                stop_all([host.remote], grace=0.5)
        self.blacklist.add(name, time.monotonic())

    def _remove_unlisted(self) -> bool:
        """RUNNING: the discovery script lists fewer slots of a host than it has workers
        (or not the host at all): a smaller world without the excess workers, taken at the
        next commit (they leave then, with nothing lost). True when it announced one."""
        listed = {h.name: h.slots for h in self.discovery.hosts()}
        removed: list[int] = []
        for name in self.hosts:
            mine = [w for w in self.world if self.procs[w].host == name]
            extra = len(mine) - listed.get(name, 0)
            if extra > 0:
                removed += mine[-extra:]  # the host's last ranks: its first keeps rank 0's state
        if not removed:
            return False
        survivors = [w for w in self.world if w not in removed]
        gone = sorted({self.procs[w].host for w in removed})
        reason = "; ".join(f"the discovery script lists {h}:{listed[h]}" if h in listed else
                           f"the discovery script no longer lists {h}" for h in gone)
        if self._short(survivors, reason):
            self._cancel(removed)
            return True
        self.removing.update(removed)  # their exit is expected, not a failure or the end
        if not self._change(survivors, [], [], reason, Event.REMOVED):
            self.removing.difference_update(removed)
            return False
        self.workers.remove(removed, self.version, reason)
        return True

    def close(self) -> None:
        self.discovery.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _exit_time(member: Member, worker: int) -> float:
    """When ``worker``'s exit was seen (its member's note, else now)."""
    note = getattr(member, "exit_time", None)  # the driver's unit tests fake members without it
    when = note(worker) if note is not None else None
    return time.monotonic() if when is None else float(when)


def run_elastic(cfg: JobConfig) -> int:
    """Run a resizable job to completion; returns ringrun's exit code."""
    local = cfg.elastic is not None and (any(cfg.is_local(h.name) for h in cfg.elastic.hosts)
                                         or cfg.elastic.discovery_script is not None)
    with job_run(cfg, local) as run:
        driver = Driver(cfg, run.run_id, run.sink, run.stop_flag, run.watchdog)
        # The workers are asked to stop with SIGTERM, or with the signal ringrun got as a
        # fixed-size job's ranks are (job.py, members.Rank); a signal after that one (a
        # second Ctrl-C) kills them at once.
        signum, signals_seen = int(signal.SIGTERM), 0

        def cut_short() -> bool:
            return len(run.stop_flag) > signals_seen
        launched = False
        try:
            try:
                driver.start()
                launched = True
                code = driver.watch()
            except Stopped as stop:
                say(f"received {signal.Signals(stop.signum).name}; stopping the job")
                signum, signals_seen = cfg.stop_signal or stop.signum, 1  # --stop-signal wins
                return 128 + stop.signum
            except HostsDown as down:
                raise LaunchError(str(down)) from None
            if code == 0:
                # never joined a formed world
                stop_all(driver.members(), grace=cfg.stop_grace, cut_short=cut_short)
                if run.sink.failure is not None:
                    say(f"error: {run.sink.failure.message}")
                    return run.sink.failure.exit_code
            return code
        finally:
            stop_all(driver.members(), grace=cfg.stop_grace, run_id=run.run_id if local else None,
                     signum=signum, cut_short=cut_short)
            driver.close()
            if not launched:  # the first world never ran: no empty logs left (job.run_fixed)
                run.sink.remove_unused()
