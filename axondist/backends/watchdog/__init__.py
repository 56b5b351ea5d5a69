"""The watchdog of a multi-process job (:mod:`~axondist.backends.watchdog.watchdog`), the
diagnostics server its peers ask (:mod:`~axondist.backends.watchdog.diagnostics`), the wait
graph it reads for deadlocks (:mod:`~axondist.backends.watchdog.wait_graph`), and the lines a
rank sends to the launcher that started it (:mod:`~axondist.backends.watchdog.launcher_report`).
Imports nothing itself: a rank that never starts a watchdog pays for none of it."""
