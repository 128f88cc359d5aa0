"""Phase 6: ``replicator`` with a reactor-stall monitor inside.

``python -m tests.fuzz.stallmon STALL_FILE run -c CONFIG`` runs the CLI
exactly as ``replicator`` does, plus a LoopingCall every 20 ms on the same
reactor.  Whenever a beat comes more than 100 ms late (the reactor was held
by something), one line ``<monotonic time> <lateness seconds> <reactor
thread CPU seconds during the gap>`` is appended to ``STALL_FILE`` (a gap
the reactor thread spent on the CPU is the daemon's own stall; a gap without
CPU is the machine not scheduling it, or a blocking call); at exit the largest lateness seen is
appended as
``max <seconds>``.  The harness counts only stalls after the daemon was
ready (``time.monotonic`` is the same clock in every process).
"""

import sys
import time

INTERVAL = 0.02
THRESHOLD = 0.1


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    from twisted.internet import reactor
    from twisted.internet.task import LoopingCall

    out = open(path, "a", buffering=1)
    state = {"last": None, "cpu": 0.0, "max": 0.0}

    def beat() -> None:
        now, cpu = time.monotonic(), time.thread_time()
        last, last_cpu = state["last"], state["cpu"]
        state["last"], state["cpu"] = now, cpu
        if last is None:
            return
        late = now - last - INTERVAL
        if late > state["max"]:
            state["max"] = late
        if late > THRESHOLD:
            out.write(f"{now:.3f} {late:.3f} {cpu - last_cpu:.3f}\n")

    def start() -> None:
        LoopingCall(beat).start(INTERVAL)
        reactor.addSystemEventTrigger("after", "shutdown",
                                      lambda: out.write(f"max {state['max']:.3f}\n"))

    reactor.callWhenRunning(start)
    from replicator.cli import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
