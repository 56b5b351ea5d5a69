"""What a backend remembers of its calls: the flight recorder's ring of recent calls
(:mod:`~axondist.backends.recording.recorder`) and the per-rank trace file it can write
(:mod:`~axondist.backends.recording.trace_file`)."""
