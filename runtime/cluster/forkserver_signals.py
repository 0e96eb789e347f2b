"""Imported by the local launcher's fork server alone (`process_ranks.PRELOAD`), for its
side effect: that process ignores SIGTERM (Python's fork server already ignores SIGINT), so a
scheduler's SIGTERM to the whole job, or a terminal's signal to the process group, leaves
the ranks it forked running while the driver finishes the step in flight and saves it. The
server still ends with its driver (it exits when the driver's end of its pipe closes).
Nothing else may import this module: it would make that process deaf to SIGTERM."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
