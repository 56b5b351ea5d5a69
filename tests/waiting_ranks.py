"""Waiting MPI ranks that give their core away: a ``sched_yield`` that sleeps once a wait
has lasted half a millisecond, preloaded into every process the test session starts.

MPICH has no blocking wait: a rank waiting for a peer polls, and with the settings the
suite's launches use (``MPIR_CVAR_POLLS_BEFORE_YIELD=1``) calls ``sched_yield`` between
polls, which still costs a whole core for as long as the wait lasts (a 1 s wait: 0.99 CPU-s
of the waiting rank, measured with ``process_time``). On the two cores the suite runs on,
the spinning ranks of one job take the time that the other jobs' ranks, and the ranks they
wait for, need. The replacement below spins for the first 0.5 ms of a wait (calls less than
50 us apart are one wait), then sleeps a sixteenth of the time waited so far, at most 1 ms:
a 1 s wait costs 0.02 CPU-s, and a wait ends at most 1 ms (or a sixteenth of it) late.

Nothing is built where no C compiler is found; the suite runs as before there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

#define SAME_WAIT_NS 50000LL
#define SPIN_NS 500000LL
#define LONGEST_SLEEP_NS 1000000LL

static __thread long long last_call_ns, wait_start_ns;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int sched_yield(void) {
    long long now = now_ns();
    if (now - last_call_ns > SAME_WAIT_NS) wait_start_ns = now;
    long long waited = now - wait_start_ns;
    if (waited < SPIN_NS) {
        last_call_ns = now;
        return (int)syscall(SYS_sched_yield);
    }
    long long pause = waited / 16 < LONGEST_SLEEP_NS ? waited / 16 : LONGEST_SLEEP_NS;
    struct timespec t = {0, (long)pause};
    nanosleep(&t, 0);
    last_call_ns = now_ns();
    return 0;
}
"""


def build(folder: str) -> str | None:
    """Compile the library into ``folder``; its path, or None where no C compiler works."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source, library = Path(folder, "waiting_ranks.c"), Path(folder, "libwaiting_ranks.so")
    source.write_text(SOURCE)
    try:
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library),
                               str(source)], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return str(library) if done.returncode == 0 else None


def preload_for_children() -> str | None:
    """Build the library in a new temporary folder and add it to ``LD_PRELOAD`` for every
    process started from now on; the folder (to remove when the session ends), or None
    where nothing was built or the user preloads something of their own."""
    if os.environ.get("LD_PRELOAD") or not os.path.exists("/proc/self/maps"):
        return None
    folder = tempfile.mkdtemp(prefix="axondist-waiting-ranks-")
    library = build(folder)
    if library is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    os.environ["LD_PRELOAD"] = library
    return folder
