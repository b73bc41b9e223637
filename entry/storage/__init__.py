"""Files a run writes: the run folder and its logs, atomic writes, folder locks, and which
folders each rank sees."""
