"""Every flag of Horovod 0.28.1's ``horovodrun``, and what it means here (pure data).

One row per flag: its spellings, the ``HOROVOD_*`` variable Horovod reads for the same
setting (None where there is none), its argument, and its *kind*:

- ``mapped``: ringtrain has the meaning; :mod:`ringtrain.launch.horovodrun` translates
  it (the row says into what);
- ``no-effect``: accepted, with one line saying why it changes nothing here (Horovod's
  own engine knobs: cycle time, response cache, autotune, MPI and NCCL stream options);
- ``refused``: its meaning cannot hold (another launcher underneath); one line naming
  the alternative, exit 2.

The parser of ``horovodrun`` is built from this table, and docs/migrate.md's flag table
is generated from it (``python -m ringtrain.launch.horovod_flags``; a test compares), so
neither can drift from the other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["FLAGS", "LOG_LEVELS", "Flag", "by_dest", "markdown_table"]


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    dest: str  #: Horovod's argparse destination (and its --config-file key, see horovod_config)
    kind: str  #: "mapped", "no-effect" or "refused"
    meaning: str  #: what ringtrain does with it, or why it has no effect / what to use instead
    env: str | None = None  #: Horovod's environment variable for the same setting
    value: str = "flag"  #: "flag" (no argument), "int", "float", "str", "choice" or "int int"
    choices: tuple[str, ...] = ()
    inverse: tuple[str, ...] = ()  #: the spellings that set ``dest`` False (``--no-...``)

    @property
    def takes_value(self) -> bool:
        return self.value != "flag"


LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

_CYCLE = "ringtrain starts an exchange as soon as every rank has submitted it (no cycle to wait for)"
_CACHE = "ringtrain matches named operations across ranks without a response cache"
_HIER = ("ringtrain's strategies are native, ring and ps (DistributedOptimizer(strategy=...)); "
         "the backend's allreduce is NCCL's or Gloo's own")
_AUTOTUNE = ("no autotuner: ringtrain plan --calibrate measures this machine's links and "
             "predicts the step; set --fusion-threshold-mb yourself")
_MPI = "there is no MPI underneath (torch.distributed with Gloo or NCCL)"
_NCCL = "ringtrain uses torch's NCCL process groups, whose streams torch manages"

FLAGS: tuple[Flag, ...] = (
    Flag(("-v", "--version"), "version", "mapped", "prints ringtrain's version"),
    Flag(("-np", "--num-proc"), "num_proc", "mapped", "ringrun -np", value="int"),
    Flag(("-cb", "--check-build"), "check_build", "mapped",
         "the frameworks, controllers and tensor operations of this torch"),
    Flag(("--disable-cache",), "disable_cache", "no-effect",
         "ringrun checks the hosts at every start; there is no check cache to skip"),
    Flag(("--start-timeout",), "start_timeout", "mapped", "ringrun --start-timeout", "HOROVOD_START_TIMEOUT",
         value="int"),
    Flag(("--network-interfaces",), "nics", "mapped",
         "ringrun --network-interface with the first one listed (Horovod's Gloo controller also "
         "uses only the first)", value="str"),
    Flag(("--network-interface",), "nics", "mapped", "as --network-interfaces", value="str"),
    Flag(("--output-filename",), "output_filename", "mapped",
         "ringrun --output-filename --output-tee --output-layout horovod: as in Horovod, each "
         "rank's stdout and stderr in DIR/rank.<rank>/stdout and stderr (the rank zero-padded) "
         "and on the terminal too", value="str"),
    Flag(("--verbose",), "verbose", "mapped", "prints the ringrun command line it runs"),
    Flag(("--config-file",), "config_file", "mapped",
         "Horovod's YAML of these settings; flags on the command line win (needs PyYAML)", value="str"),
    Flag(("-p", "--ssh-port"), "ssh_port", "mapped", "ringrun -p", value="int"),
    Flag(("-i", "--ssh-identity-file"), "ssh_identity_file", "mapped", "ringrun -i", value="str"),
    Flag(("--fusion-threshold-mb",), "fusion_threshold_mb", "mapped",
         "ringtrain's fusion_mb (0: every tensor travels alone)", "HOROVOD_FUSION_THRESHOLD", value="float"),
    Flag(("--cycle-time-ms",), "cycle_time_ms", "no-effect", _CYCLE, "HOROVOD_CYCLE_TIME", value="float"),
    Flag(("--cache-capacity",), "cache_capacity", "no-effect", _CACHE, "HOROVOD_CACHE_CAPACITY", value="int"),
    Flag(("--hierarchical-allreduce",), "hierarchical_allreduce", "no-effect", _HIER,
         "HOROVOD_HIERARCHICAL_ALLREDUCE", inverse=("--no-hierarchical-allreduce",)),
    Flag(("--hierarchical-allgather",), "hierarchical_allgather", "no-effect", _HIER,
         "HOROVOD_HIERARCHICAL_ALLGATHER", inverse=("--no-hierarchical-allgather",)),
    Flag(("--torus-allreduce",), "torus_allreduce", "no-effect", _HIER, "HOROVOD_TORUS_ALLREDUCE",
         inverse=("--no-torus-allreduce",)),
    Flag(("--autotune",), "autotune", "no-effect", _AUTOTUNE, "HOROVOD_AUTOTUNE", inverse=("--no-autotune",)),
    Flag(("--autotune-log-file",), "autotune_log_file", "no-effect", _AUTOTUNE, "HOROVOD_AUTOTUNE_LOG",
         value="str"),
    Flag(("--autotune-warmup-samples",), "autotune_warmup_samples", "no-effect", _AUTOTUNE,
         "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", value="int"),
    Flag(("--autotune-steps-per-sample",), "autotune_steps_per_sample", "no-effect", _AUTOTUNE,
         "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", value="int"),
    Flag(("--autotune-bayes-opt-max-samples",), "autotune_bayes_opt_max_samples", "no-effect", _AUTOTUNE,
         "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", value="int"),
    Flag(("--autotune-gaussian-process-noise",), "autotune_gaussian_process_noise", "no-effect", _AUTOTUNE,
         "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", value="float"),
    Flag(("--min-np", "--min-num-proc"), "min_num_proc", "mapped", "ringrun --min-np", value="int"),
    Flag(("--max-np", "--max-num-proc"), "max_num_proc", "mapped", "ringrun --max-np", value="int"),
    Flag(("--slots-per-host",), "slots", "mapped",
         "ringrun --slots-per-host: the slots of a host the discovery script prints without any",
         value="int"),
    Flag(("--elastic-timeout",), "elastic_timeout", "mapped",
         "ringrun --elastic-timeout: how long a resizable job waits for --min-np slots after "
         "losing ranks (default 600 s, as Horovod's)",
         "HOROVOD_ELASTIC_TIMEOUT", value="int"),
    Flag(("--reset-limit",), "reset_limit", "mapped",
         "the most times the job may re-form (resize) before it ends", value="int"),
    Flag(("--blacklist-cooldown-range",), "cooldown_range", "mapped",
         "ringrun --blacklist-cooldown-range: a failed host comes back after a cooldown within "
         "[min, max] s, doubled at each failure",
         value="int int"),
    Flag(("--timeline-filename",), "timeline_filename", "mapped",
         "ringtrain's step timeline and the Horovod timeline (NEGOTIATE_<OP>, <OP> spans), in one file",
         "HOROVOD_TIMELINE", value="str"),
    Flag(("--timeline-mark-cycles",), "timeline_mark_cycles", "mapped",
         "a CYCLE_START mark per coordinator cycle in the timeline", "HOROVOD_TIMELINE_MARK_CYCLES",
         inverse=("--no-timeline-mark-cycles",)),
    Flag(("--no-stall-check",), "no_stall_check", "mapped",
         "no stall warnings (HOROVOD_STALL_CHECK_DISABLE=1 for every rank) and ringtrain's "
         "stall_timeout set to a year: a stalled exchange waits as long as it takes",
         "HOROVOD_STALL_CHECK_DISABLE", inverse=("--stall-check",)),
    Flag(("--stall-check-warning-time-seconds",), "stall_check_warning_time_seconds", "mapped",
         "HOROVOD_STALL_CHECK_TIME_SECONDS for every rank: how often a stalled operation's "
         "warning names the ranks that have not submitted it (default 60 s)",
         "HOROVOD_STALL_CHECK_TIME_SECONDS", value="int"),
    Flag(("--stall-check-shutdown-time-seconds",), "stall_check_shutdown_time_seconds", "mapped",
         "ringtrain's stall_timeout: a stalled exchange ends the job naming the missing ranks "
         "after this long (0, the default, as Horovod's: never; as in Horovod, never also when "
         "it is less than the stall check time, with a warning)",
         "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", value="int"),
    Flag(("--mpi-threads-disable",), "mpi_threads_disable", "no-effect", _MPI, "HOROVOD_MPI_THREADS_DISABLE",
         inverse=("--no-mpi-threads-disable",)),
    Flag(("--mpi-args",), "mpi_args", "no-effect", _MPI + "; its arguments go nowhere", value="str"),
    Flag(("--tcp",), "tcp_flag", "mapped",
         "NCCL_IB_DISABLE=1 for every rank (NCCL over TCP sockets); Gloo always uses TCP"),
    Flag(("--binding-args",), "binding_args", "no-effect", _MPI + "; bind processes with numactl or "
         "taskset in the command", value="str"),
    Flag(("--num-nccl-streams",), "num_nccl_streams", "no-effect", _NCCL, "HOROVOD_NUM_NCCL_STREAMS",
         value="int"),
    Flag(("--thread-affinity",), "thread_affinity", "no-effect",
         "ringtrain has no background thread of Horovod's kind to pin", "HOROVOD_THREAD_AFFINITY", value="int"),
    Flag(("--gloo-timeout-seconds",), "gloo_timeout_seconds", "mapped",
         "ringtrain's init_timeout: how long ranks wait for each other at the rendezvous",
         "HOROVOD_GLOO_TIMEOUT_SECONDS", value="int"),
    Flag(("--log-level",), "log_level", "mapped", "the level of ringtrain's loggers in every rank",
         "HOROVOD_LOG_LEVEL", value="choice", choices=LOG_LEVELS),
    Flag(("--log-with-timestamp", "--no-log-hide-timestamp"), "log_with_timestamp", "mapped",
         "ringtrain's log lines start with the time", "HOROVOD_LOG_HIDE_TIME",
         inverse=("--log-without-timestamp", "--log-hide-timestamp")),
    Flag(("-prefix-timestamp", "--prefix-output-with-timestamp"), "prefix_output_with_timestamp", "mapped",
         "ringrun --timestamp-output: each line of the ranks' output starts with the time it was written"),
    Flag(("-H", "--hosts"), "hosts", "mapped", "ringrun -H", value="str"),
    Flag(("-hostfile", "--hostfile"), "hostfile", "mapped", "ringrun --hostfile", value="str"),
    Flag(("--host-discovery-script",), "host_discovery_script", "mapped",
         "ringrun --host-discovery-script (a resizable job)", value="str"),
    Flag(("--gloo",), "use_gloo", "mapped", "the default: ringtrain's controller is Gloo-style"),
    Flag(("--mpi",), "use_mpi", "refused",
         "ringtrain runs on torch.distributed, not MPI; drop --mpi (mpirun can start a ringtrain "
         "script itself: rt.init() reads its environment)"),
    Flag(("--jsrun",), "use_jsrun", "refused",
         "jsrun starts MPI jobs; drop --jsrun and list the hosts with -H or --hostfile"),
)


def by_dest() -> dict[str, Flag]:
    """The row of each destination (the first row where two spellings share one)."""
    out: dict[str, Flag] = {}
    for flag in FLAGS:
        out.setdefault(flag.dest, flag)
    return out


def markdown_table() -> str:
    """docs/migrate.md's table of horovodrun's flags."""
    lines = ["| Horovod flag | variable | ringtrain |", "|---|---|---|"]
    for f in FLAGS:
        names = " / ".join(f"`{n}`" for n in f.names)
        names += "".join(f" / `{n}`" for n in f.inverse)
        arg = "" if f.value == "flag" else f" {f.value.upper()}"
        what = {"mapped": "", "no-effect": "no effect: ", "refused": "refused: "}[f.kind] + f.meaning
        lines.append(f"| {names}{arg} | {f'`{f.env}`' if f.env else ''} | {what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
